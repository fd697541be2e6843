"""Checkpoints run no code: every file a resume reads is data, and a file that is not is refused.

The attack: replace a checkpoint's file with a pickle whose loading runs a shell command,
and rewrite COMMITTED.json's sizes and digests to match (whoever can write the files can write the
manifest). For every pickle-format file of real checkpoints (an EMA, a user's stateful callbacks,
one registered through Accelerate's ``register_for_checkpointing``, GradNorm; ASYNC mode; a LoRA
adapter), the command never runs and the verification every resume runs first names the file.
For one file of each kind (and for the RNG states and a planted ``custom_checkpoint_0.pkl``) the
command line is run too: an explicit ``--resume`` exits 2 naming the file, writing nothing; a rerun
skips the checkpoint, moves it to ``rejected/`` with the reason, and resumes from the one before.
Random states that load as data but are not Accelerate's are refused too (Accelerate would log
"Could not load random states" at INFO and go on). With ``LINNAEUS_CHECKPOINT_KEY``, a checkpoint
whose manifest was rewritten without the key is refused, and kill -9 and resume stay byte-identical.
A checkpoint of the previous layout (registered state pickled by Accelerate) resumes only with
``--unsafe-load-pickles``.

The runs killed with SIGKILL are processes of their own; the runs that refuse, resume or serve as
the reference run in this process, whose torch is imported already (that import is most of a
short run's cost in a process of its own), through the same command line.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import stateful_script  # noqa: F401  (registers the user's callbacks for the runs made in this process)
import torch
from helpers.checkpoints import RunsCode, reseal
from helpers.configs import LM_CFG, REPO
from helpers.in_process import run_cli, run_here
from helpers.processes import AFTER_FIRST_COMMIT
from helpers.runs import TrainRun, assert_resumed_from

from linnaeus_accel.checkpoint.directory import MARKER, read_marker
from linnaeus_accel.checkpoint.directory.marker import KEY_ENV, SIGNATURE, signature, signature_problem
from linnaeus_accel.checkpoint.state import tensor_state
from linnaeus_accel.checkpoint.state.content import content_problem
from linnaeus_accel.checkpoint.state.files import checkpoint_store

SCRIPT = (REPO / "tests" / "stateful_script.py").read_text(encoding="utf-8")
STEP_6, STEP_12 = "step_00000006", "step_00000012"
DIGITS = [
    *("TRAIN.EPOCHS", "3", "DATA.BATCH_SIZE", "256", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"),
    *("SCHEDULE.CHECKPOINT.KEEP_LAST_N", "3", "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0"),
]  # 6 steps an epoch: checkpoints at 6, 12, 18
TINY_LM = [
    *("DATA.BATCH_SIZE", "4", "MODEL.OPTIONS.hidden_size", "32", "MODEL.OPTIONS.intermediate_size", "64"),
    *("MODEL.OPTIONS.num_hidden_layers", "2", "MODEL.OPTIONS.num_attention_heads", "2"),
    *("TRAIN.TARGET_TOKENS", str(18 * 4 * 128), "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "6"),
    *("SCHEDULE.CHECKPOINT.MID_EPOCH", "true", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null"),
    *("SCHEDULE.CHECKPOINT.KEEP_LAST_N", "3", "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0"),
    *("MODEL.OPTIONS.lora", "{r: 4}"),
]
KINDS = {
    # (config, overrides, through the script with the user's callbacks)
    "ema-callbacks-gradnorm": (
        None,
        [
            *DIGITS,
            *("CALLBACKS", "[{NAME: ema}, {NAME: tensor_sum}, {NAME: accelerate_registered}]"),
            *("LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED", "true"),
            *("LOSS.GRAD_WEIGHTING.TASK.GRADNORM_WARMUP_STEPS", "0"),
        ],
        True,
    ),
    "async-ema": (None, [*DIGITS, "SCHEDULE.CHECKPOINT.ASYNC", "true", "CALLBACKS", "[{NAME: ema}]"], False),
    "lora": (LM_CFG, TINY_LM, False),
}
PICKLE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")


def new_run(root: Path, opts: list[str], cfg: str | None = None) -> TrainRun:
    root.mkdir(parents=True)
    return TrainRun(root, opts, cfg=cfg) if cfg else TrainRun(root, opts)


def make_run(root: Path, kind: str) -> TrainRun:
    cfg, opts, _ = KINDS[kind]
    return TrainRun(root, opts, cfg=cfg) if cfg else TrainRun(root, opts)


class KilledRuns:
    """Each kind's run, killed right after its step-12 checkpoint (steps 6 and 12 committed), made
    the first time a test of this process asks for it (xdist workers make only those they need).
    Killed with SIGKILL, so in a process of its own (through tests/stateful_script.py where the kind
    has the user's callbacks); the runs that resume or refuse it run in this process, where the
    import of stateful_script registered those callbacks."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.runs: dict[str, TrainRun] = {}

    def __getitem__(self, kind: str) -> TrainRun:
        if kind not in self.runs:
            run = make_run(self.factory.mktemp(kind), kind)
            done = run.run(kill_at="checkpoint_committed:2", python_code=SCRIPT if KINDS[kind][2] else None)
            assert done.returncode != 0, done.tail()
            assert (run.dir / "checkpoints" / STEP_12 / MARKER).is_file(), done.tail()
            self.runs[kind] = run
        return self.runs[kind]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> KilledRuns:
    return KilledRuns(tmp_path_factory)


def pickle_files(checkpoint: Path) -> list[str]:
    return sorted(
        p.relative_to(checkpoint).as_posix()
        for p in checkpoint.rglob("*")
        if p.is_file() and p.suffix in PICKLE_SUFFIXES
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_pickle_in_any_file_of_a_checkpoint_runs_no_code(
    kind: str, killed_runs: KilledRuns, tmp_path: Path
) -> None:
    checkpoint = killed_runs[kind].dir / "checkpoints" / STEP_12
    files = pickle_files(checkpoint)
    # Only Accelerate's own files are pickles: registered state (the EMA, the user's tensors, the
    # object registered through Accelerate) is safetensors and JSON.
    assert files
    assert not [f for f in files if f.startswith("custom_checkpoint")], files
    if kind != "lora":
        assert (checkpoint / "trainer_state.safetensors").is_file()
    marker = tmp_path / "code-ran"
    for i, name in enumerate(files):
        run = killed_runs[kind].clone(tmp_path / f"attack{i}")
        target = run.dir / "checkpoints" / STEP_12
        torch.save(RunsCode(marker), target / name)
        reseal(target)
        if i > 0:
            # The verification every resume runs first, in-process (the command line's refusal and
            # fallback do not depend on which file failed: they run for the first file of a kind).
            problem = checkpoint_store(target.parent).verify(target)
            assert problem is not None
            assert f"{name}: not loadable as data" in problem, problem
            assert not marker.exists(), f"loading {name} ran code"
            continue
        # Resumed into a new run (a colleague's checkpoint), which must be left empty.
        into = new_run(tmp_path / f"new{i}", run.opts, run.cfg)
        explicit = run_here(into, args=["--resume", str(target)])
        assert explicit.returncode == 2, explicit.tail()
        assert f"{name}: not loadable as data" in explicit.output, explicit.tail()
        assert "Traceback" not in explicit.output
        assert not marker.exists(), f"loading {name} ran code"
        assert (target / MARKER).is_file()  # the user's own path: reported, never moved
        assert [f.name for f in into.dir.rglob("*") if f.is_file()] == [".lock"]
        auto = run_here(run)
        assert auto.returncode == 0, auto.tail()
        assert not marker.exists(), f"loading {name} ran code"
        assert f"skipping checkpoint {STEP_12}: {name}: not loadable as data" in auto.output, auto.tail()
        assert_resumed_from(auto.output, 6)
        reason = (run.dir / "checkpoints" / "rejected" / STEP_12 / "REJECTED.txt").read_text()
        assert name in reason


@pytest.mark.slow
def test_a_pickle_this_layout_never_writes_is_refused(killed_runs: KilledRuns, tmp_path: Path) -> None:
    """custom_checkpoint_0.pkl (Accelerate's registered objects, which it loads with
    weights_only=False) added to a checkpoint written by this version: tampered, refused."""
    run = killed_runs["async-ema"].clone(tmp_path / "run")
    target = run.dir / "checkpoints" / STEP_12
    marker = tmp_path / "code-ran"
    torch.save(RunsCode(marker), target / "custom_checkpoint_0.pkl")
    reseal(target)
    explicit = run_here(run, args=["--resume", str(target)])
    assert explicit.returncode == 2, explicit.tail()
    assert "custom_checkpoint_0.pkl: a pickle that this layout of checkpoint never holds" in explicit.output
    auto = run_here(run)
    assert auto.returncode == 0, auto.tail()
    assert_resumed_from(auto.output, 6)
    assert not marker.exists()


@pytest.mark.slow
def test_random_states_that_accelerate_cannot_restore_are_refused(
    killed_runs: KilledRuns, tmp_path: Path
) -> None:
    """Data, but not random states: Accelerate logs "Could not load random states" at INFO level and
    would resume as if nothing happened; the run instead refuses the checkpoint, naming the file."""
    run = killed_runs["async-ema"].clone(tmp_path / "run")
    target = run.dir / "checkpoints" / STEP_12
    torch.save({"step": 0, "random_state": "not a state"}, target / "random_states_0.pkl")
    reseal(target)
    explicit = run_here(run, args=["--resume", str(target)])
    assert explicit.returncode == 2, explicit.tail()
    assert "random_states_0.pkl: its random states were not restored" in explicit.output, explicit.tail()
    assert "Traceback" not in explicit.output
    auto = run_here(run)
    assert auto.returncode == 0, auto.tail()
    assert "could not be loaded: random_states_0.pkl" in auto.output
    assert_resumed_from(auto.output, 6)
    assert (run.dir / "checkpoints" / "rejected" / STEP_12 / MARKER).is_file()


EMA_RUN = [*DIGITS, "CALLBACKS", "[{NAME: ema}]"]
KEY = {KEY_ENV: "a secret only the jobs hold"}


@pytest.fixture(scope="module")
def ema_reference(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    """An uninterrupted run with the ema callback (signed or not, its weights are the same)."""
    reference = TrainRun(tmp_path_factory.mktemp("reference"), EMA_RUN)
    run_here(reference).check_ok()
    return reference


@pytest.fixture(scope="module")
def killed_signed(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    """The ema run with ``KEY``, killed -9 right after its step-12 checkpoint (steps 6 and 12
    committed, signed): one kill for the tests below, which clone it."""
    run = TrainRun(tmp_path_factory.mktemp("killed_signed"), EMA_RUN)
    assert run.run(kill_at="checkpoint_committed:2", extra_env=KEY).returncode != 0
    return run


@pytest.mark.slow
def test_with_a_checkpoint_key_only_signed_checkpoints_resume(
    ema_reference: TrainRun, killed_signed: TrainRun, tmp_path: Path
) -> None:
    reference = ema_reference
    run = killed_signed.clone(tmp_path / "run")
    signed = read_marker(run.dir / "checkpoints" / STEP_12)
    assert signature_problem(signed, KEY[KEY_ENV].encode()) is None

    # Rewritten by a writer of the checkpoints who does not hold the key: refused.
    forged = run.clone(tmp_path / "forged")
    reseal(forged.dir / "checkpoints" / STEP_12)
    explicit = run_here(forged, args=["--resume", str(forged.dir / "checkpoints" / STEP_12)], extra_env=KEY)
    assert explicit.returncode == 2, explicit.tail()
    assert f"COMMITTED.json is not signed, and {KEY_ENV} is set" in explicit.output
    wrong = run_here(forged, extra_env={KEY_ENV: "another key"})
    assert wrong.returncode == 2, wrong.tail()  # none of its checkpoints is signed with that key
    assert "signature does not match" in wrong.output

    # With the key: killed -9 and resumed, byte-identical to the uninterrupted run.
    resumed = run_here(run, extra_env=KEY).check_ok()
    assert_resumed_from(resumed.output, 12)
    for name in ("model.safetensors", "ema/model.safetensors"):
        assert (run.dir / "final" / name).read_bytes() == (reference.dir / "final" / name).read_bytes()


def to_previous_layout(checkpoint: Path) -> None:
    """What an earlier linnaeus-accel wrote for a run with the ema callback: the average pickled by
    Accelerate in custom_checkpoint_0.pkl, nothing of it in trainer_state.json."""
    from safetensors.torch import load_file

    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    tensors = load_file(checkpoint / "trainer_state.safetensors")
    average = tensor_state.join(state.pop("registered.ema"), tensors)
    del state["state_layout"]
    state_file.write_text(json.dumps(state))
    (checkpoint / "trainer_state.safetensors").unlink()
    torch.save(average, checkpoint / "custom_checkpoint_0.pkl")
    reseal(checkpoint)


@pytest.mark.slow
def test_a_checkpoint_of_the_previous_layout_resumes_only_when_its_owner_says_so(
    ema_reference: TrainRun, killed_signed: TrainRun, tmp_path: Path
) -> None:
    reference = ema_reference
    run = killed_signed.clone(tmp_path / "run")
    for name in (STEP_6, STEP_12):
        # Resealed without the key: unsigned, as an earlier linnaeus-accel wrote them.
        to_previous_layout(run.dir / "checkpoints" / name)
        assert SIGNATURE not in read_marker(run.dir / "checkpoints" / name)
    refused = run_here(run)
    assert refused.returncode == 2, refused.tail()
    assert (
        "keeps registered state (an EMA of the weights, a callback's tensors) in custom_checkpoint_0.pkl"
        in (refused.output)
    )
    assert "--unsafe-load-pickles" in refused.output
    assert (run.dir / "checkpoints" / STEP_12 / MARKER).is_file()  # not corrupt: not moved
    resumed = run_here(run, args=["--unsafe-load-pickles"]).check_ok()
    assert_resumed_from(resumed.output, 12)
    for name in ("model.safetensors", "ema/model.safetensors"):
        assert (run.dir / "final" / name).read_bytes() == (reference.dir / "final" / name).read_bytes(), name
    # What it wrote since is of this layout: no pickle of ours.
    newest = run.dir / "checkpoints" / "step_00000018"
    assert not list(newest.glob("custom_checkpoint_*")), sorted(p.name for p in newest.iterdir())


@pytest.mark.slow
def test_state_registered_by_users_survives_kill_and_resume(tmp_path: Path) -> None:
    """register_state and Accelerate's register_for_checkpointing: restored as they were (a
    float64 tensor, int keys, tuples), and as an uninterrupted run ends them."""
    opts = [*DIGITS, "CALLBACKS", "[{NAME: tensor_sum}, {NAME: accelerate_registered}]"]
    reference = new_run(tmp_path / "reference", opts)
    run_here(reference).check_ok()
    run = new_run(tmp_path / "run", opts)
    assert (
        run.run(kill_at="optimizer_step:15", python_code=SCRIPT, extra_env=AFTER_FIRST_COMMIT).returncode != 0
    )
    run_here(run).check_ok()
    for name in ("tensor_sum", "accelerate_registered"):
        got = json.loads((run.dir / f"state_{name}.json").read_text())
        assert got == json.loads((reference.dir / f"state_{name}.json").read_text())
        assert got["calls"] == list(range(1, 19))


# -- the pieces, without a run -------------------------------------------------------------------
def test_split_and_join_give_back_what_was_saved() -> None:
    weight = torch.randn(3, 4)
    state = {
        "weight": weight,
        "tied": weight,  # shares memory: saved once, comes back shared
        "row": weight[1],  # a view of part of a tensor: saved on its own
        "counts": {1: (2, "two"), 3: None},
        "scale": float("nan"),
        "noise": np.arange(4, dtype=np.float32),
        "flag": True,
        "__tensor__": "a user's key that looks like ours",
    }
    data, tensors = tensor_state.split(state)
    text = json.dumps(data, allow_nan=False)  # plain JSON: no NaN token, nothing pickled
    back = tensor_state.join(json.loads(text), tensors)
    assert len(tensors) == 3
    assert torch.equal(back["weight"], weight)
    assert back["tied"] is back["weight"]
    assert torch.equal(back["row"], weight[1])
    assert back["counts"] == {1: (2, "two"), 3: None}
    assert np.isnan(back["scale"])
    assert np.array_equal(back["noise"], np.arange(4, dtype=np.float32))
    assert back["__tensor__"] == "a user's key that looks like ours"


def test_split_names_what_a_checkpoint_cannot_hold() -> None:
    with pytest.raises(TypeError, match=r"state\.model is a torch.nn.modules.linear.Linear"):
        tensor_state.split({"model": torch.nn.Linear(2, 2)})
    with pytest.raises(TypeError, match="has a key of type tuple"):
        tensor_state.split({(1, 2): 3})


def test_a_dcp_metadata_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    """torch.distributed.checkpoint unpickles .metadata with plain pickle: only DCP's own classes,
    sizes, dtypes and paths are let through."""
    checkpoint = tmp_path / "step_00000001"
    (checkpoint / "pytorch_model_fsdp_0").mkdir(parents=True)
    marker = tmp_path / "code-ran"
    (checkpoint / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    problem = content_problem(checkpoint, {"state_layout": 2})
    assert problem is not None
    assert problem.startswith("pytorch_model_fsdp_0/.metadata: not loadable as torch.distributed.checkpoint")
    assert "posix.system" in problem
    assert not marker.exists()


def deepspeed_names(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Classes pickled under the names DeepSpeed's ZeRO files refer to (DeepSpeed is not installed
    here; the GPU check's sharded part reads real ZeRO-3 checkpoints the same way)."""
    import dataclasses
    import enum
    import sys
    import types

    import accelerate.utils  # noqa: F401 (before the names below: it looks for an installed DeepSpeed)

    class LossScaler:
        def __init__(self) -> None:
            self.cur_scale = 1.0

    class ZeroStageEnum(enum.IntEnum):
        weights = 3

    @dataclasses.dataclass
    class fragment_address:  # DeepSpeed's name
        numel: int
        start: int

    class DeepSpeedEngine:  # a DeepSpeed class that is not checkpoint data
        pass

    classes = {
        "deepspeed.runtime.engine": [DeepSpeedEngine],
        "deepspeed.runtime.fp16.loss_scaler": [LossScaler],
        "deepspeed.runtime.zero.config": [ZeroStageEnum],
        "deepspeed.utils.tensor_fragment": [fragment_address],
    }
    for name in (
        "deepspeed",
        "deepspeed.runtime",
        "deepspeed.runtime.fp16",
        "deepspeed.runtime.zero",
        "deepspeed.utils",
        *classes,
    ):
        module = types.ModuleType(name)
        for cls in classes.get(name, []):
            cls.__module__, cls.__qualname__ = name, cls.__name__
            setattr(module, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, name, module)
    return {cls.__name__: cls for found in classes.values() for cls in found}


def test_deepspeed_files_are_opened_as_data_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed unpickles its pytorch_model/*.pt with weights_only=False: they are read as data
    first, with the few DeepSpeed classes its ZeRO files hold; a pickle that runs code, or refers to
    any other DeepSpeed class, is refused naming the file."""
    names = deepspeed_names(monkeypatch)
    checkpoint = tmp_path / "step_00000001"
    files = checkpoint / "pytorch_model"
    files.mkdir(parents=True)
    optim = files / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(
        {
            "zero_stage": names["ZeroStageEnum"].weights,
            "loss_scaler": names["LossScaler"](),
            "param_slice_mappings": [{"w": names["fragment_address"](4, 0)}],
            "fp32_flat_groups": [torch.zeros(4)],
        },
        optim,
    )
    torch.save(
        {"module": None, "param_shapes": [{"w": torch.Size([2, 2])}]},
        files / "zero_pp_rank_0_mp_rank_00_model_states.pt",
    )
    assert content_problem(checkpoint, {}) is None  # what DeepSpeed writes loads as data

    marker = tmp_path / "code-ran"
    torch.save({"loss_scaler": RunsCode(marker)}, optim)
    problem = content_problem(checkpoint, {})
    assert problem == (
        f"pytorch_model/{optim.name}: not loadable as data (UnpicklingError: Unsupported global: GLOBAL posix.system)"
    )
    assert not marker.exists()

    torch.save({"engine": names["DeepSpeedEngine"]()}, optim)
    assert "GLOBAL deepspeed.runtime.engine.DeepSpeedEngine" in str(content_problem(checkpoint, {}))


def test_the_signature_covers_the_whole_marker() -> None:
    marker = {"version": 1, "step": 5, "files": [{"path": "a", "size": 1, "xxh3_128": "00"}], "info": {}}
    key = b"key"
    signed = {**marker, SIGNATURE: signature(marker, key)}
    assert signature_problem(signed, key) is None
    assert signature_problem(signed, None) is None  # no key set: checked by digests only
    assert "does not match" in str(signature_problem({**signed, "step": 6}, key))
    assert "not signed" in str(signature_problem(marker, key))


# -- the rest of what a run reads ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_evaluate_refuses_a_tampered_checkpoint_and_runs_no_code(
    killed_runs: KilledRuns, tmp_path: Path
) -> None:
    run = killed_runs["async-ema"].clone(tmp_path / "run")
    target = run.dir / "checkpoints" / STEP_12
    marker = tmp_path / "code-ran"
    torch.save(RunsCode(marker), target / "optimizer.bin")
    reseal(target)
    opts = ["ENV.OUTPUT.BASE_DIR", str(run.base), "EXPERIMENT.NAME", "run", *run.opts]
    rc, out, err = run_cli("evaluate", "--cfg", run.cfg, "--checkpoint", str(target), "--opts", *opts)
    assert rc == 2, out + err
    assert "optimizer.bin: not loadable as data" in err
    assert not marker.exists()
    assert not (run.dir / "eval").exists()  # nothing measured


def test_a_pretrained_directory_holding_a_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    """transformers reads pytorch_model.bin with torch's weights-only unpickler (and the options that
    would turn it off, weights_only and trust_remote_code, are refused as MODEL.OPTIONS keys)."""
    import transformers

    from linnaeus_accel.config import ConfigError, load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model

    base = tmp_path / "base"
    transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(base)
    marker = tmp_path / "code-ran"
    torch.save(RunsCode(marker), base / "pytorch_model.bin")
    ft_cfg = REPO / "configs" / "lm_finetune.yaml"
    config = load_config(ft_cfg, ["MODEL.OPTIONS.pretrained", str(base), "MODEL.OPTIONS.lora", "null"])
    with pytest.raises(ConfigError, match=r"MODEL.OPTIONS.pretrained: transformers cannot load the weights"):
        build_model(config, build_dataset(config, "train"))
    assert not marker.exists()
    for key in ("weights_only", "trust_remote_code"):
        bad = load_config(ft_cfg, ["MODEL.OPTIONS.pretrained", str(base), f"MODEL.OPTIONS.{key}", "false"])
        with pytest.raises(ConfigError, match=key):
            build_model(bad, build_dataset(bad, "train"))


def test_evaluate_reads_adapters_and_weights_as_safetensors_only(tmp_path: Path) -> None:
    """A directory whose only weights are pickles (peft's adapter_model.bin, pytorch_model.bin) is
    not read: evaluate takes safetensors files."""
    from linnaeus_accel.config import ConfigError
    from linnaeus_accel.evaluate import locate

    marker = tmp_path / "code-ran"
    for name in ("adapter_model.bin", "pytorch_model.bin"):
        directory = tmp_path / name.split(".")[0]
        directory.mkdir()
        (directory / "adapter_config.json").write_text("{}")
        torch.save(RunsCode(marker), directory / name)
        with pytest.raises(ConfigError, match="nor a directory of weights"):
            locate(directory)
    assert not marker.exists()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_state_a_checkpoint_cannot_hold_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """Found when the run starts, naming the callback, not at its first checkpoint (which would lose
    every step before it)."""
    from linnaeus_accel import Callback, Trainer
    from linnaeus_accel.config import ConfigError, load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model

    class HoldsAModule(Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"layer": torch.nn.Linear(2, 2)}

    config = load_config(
        REPO / "configs" / "default.yaml", ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.EPOCHS", "1"]
    )
    train = build_dataset(config, "train")
    trainer = Trainer(config, build_model(config, train), train, callbacks=[HoldsAModule()])
    with pytest.raises(
        ConfigError, match=r"CALLBACKS: its state_dict\(\) cannot be saved in a checkpoint: .*Linear"
    ):
        trainer.fit()
    assert not (tmp_path / "default").exists()  # refused before the output directory was claimed


def test_pickled_globals_are_read_without_loading(tmp_path: Path) -> None:
    """What the GPU check reports of DeepSpeed's files (to learn which globals a new DeepSpeed
    version's checkpoints hold): the globals a torch-saved pickle refers to, read without running it."""
    from linnaeus_accel.checkpoint.state.content import pickled_globals

    marker = tmp_path / "code-ran"
    torch.save({"weights": torch.zeros(2), "attack": RunsCode(marker)}, tmp_path / "file.pt")
    found = pickled_globals(tmp_path / "file.pt")
    assert "posix.system" in found
    assert "torch._utils._rebuild_tensor_v2" in found
    assert not marker.exists()


# A few steps of the digits MLP in-process, checkpointed at its last step.
QUICK = [
    *("TRAIN.EPOCHS", "null", "TRAIN.STEPS", "2", "DATA.BATCH_SIZE", "64", "MODEL.OPTIONS.hidden", "16"),
    *("SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED", "false", "EXPERIMENT.NAME", "run"),
    *("SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false"),
]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_checkpoint_whose_weights_file_is_damaged_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """The weights are read by Accelerate's load, after the run directory was written to: their
    safetensors header (and offsets) is checked at verification, as the pickles are, naming the file."""

    cfg = str(REPO / "configs" / "default.yaml")
    rc, _, err = run_cli(
        "train", "--cfg", cfg, "--opts", *QUICK, "ENV.OUTPUT.BASE_DIR", str(tmp_path / "old")
    )
    assert rc == 0, err
    checkpoint = next((tmp_path / "old" / "run" / "checkpoints").glob("step_*"))
    weights = (checkpoint / "model.safetensors").read_bytes()
    damages = {
        "header": weights[:8] + b"x" + weights[9:],  # its JSON no longer parses
        "truncated": weights[:-4],  # the last tensor's offsets past the end
    }
    for name, damaged in damages.items():
        (checkpoint / "model.safetensors").write_bytes(damaged)
        reseal(checkpoint)  # digests rewritten to match, as an attacker or a careless copy would
        new = tmp_path / name
        opts = [*QUICK, "ENV.OUTPUT.BASE_DIR", str(new)]
        rc, _, err = run_cli("train", "--cfg", cfg, "--resume", str(checkpoint), "--opts", *opts)
        assert rc == 2, err
        assert [f.relative_to(new).as_posix() for f in new.rglob("*") if f.is_file()] == ["run/.lock"]
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if "--resume" in line]
        assert len(lines) == 1, err
        assert (
            f"{checkpoint} is not a usable checkpoint: model.safetensors: not a safetensors file" in lines[0]
        )
