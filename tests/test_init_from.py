"""``MODEL.INIT_FROM`` / ``MODEL.INIT_IGNORE``: a warm start for any model (checkpoint/init_from.py).

- A run from another run's ``final/`` trains exactly as the same run whose model was loaded from
  that file by hand (every logged float equal), and not as a run from the built weights.
- A checkpoint directory, a single ``.safetensors`` file, a ``save_pretrained`` directory (sharded
  too, a tied LM head left out of the file) and a file of a compiled or DDP-wrapped model load
  every tensor; run_info records the source and the XXH3-128 digest of its file(s).
- Strict: keys missing from the file or unknown to the model are listed with the fix, a shape that
  differs names the key and both shapes; INIT_IGNORE leaves a new head as built.
- A directory holding only a pickle is refused and the pickle never opened; a LoRA adapter, a
  missing path (exit 2, nothing written) and the config rules are refused naming the keys.
- A checkpoint (or a file in one) that a resume would refuse (uncommitted, its weights unlisted,
  damaged, rejected, unsigned while a key is set) and a path that is neither a file nor a
  directory exit 2 with one line naming MODEL.INIT_FROM, writing nothing; a transformers Trainer's
  checkpoint-N directory is no checkpoint of ours and loads.
- Killed after a checkpoint and rerun, a run with INIT_FROM ends byte-identical to the
  uninterrupted one (the checkpoint's weights count at resume). The kill is a process of its own;
  the reference, the rerun and the refused --overwrite run in the test's process through the same
  command line (``run_here``: a process of its own is mostly torch's import).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import CFG, REPO
from helpers.in_process import reset_accelerate, run_cli, run_here
from helpers.runs import TrainRun, assert_resumed_from, assert_same_run
from safetensors.torch import load_file, save_file
from torch import nn

from linnaeus_accel import Trainer
from linnaeus_accel.checkpoint.directory import MARKER, file_digest
from linnaeus_accel.checkpoint.directory.marker import KEY_ENV
from linnaeus_accel.checkpoint.directory.rejection import write_note
from linnaeus_accel.checkpoint.init_from import load_init_from
from linnaeus_accel.config import Config, ConfigError, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.models.digits import DigitsConvNet

IMAGES_CFG = str(REPO / "configs" / "digits_classification.yaml")
# digits_mlp on the default config, a few steps, every step logged, no extra validation passes.
TINY = [
    "TRAIN.EPOCHS", "null", "TRAIN.STEPS", "4", "DATA.BATCH_SIZE", "64",
    "SCHEDULE.METRICS.STEP_INTERVAL", "1", "SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED", "false",
    "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false",
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS", "null",
]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Iterator[None]:
    reset_accelerate()
    yield
    reset_accelerate()


def config_for(out: Path, *more: str, cfg: str = CFG) -> Config:
    width = ["MODEL.OPTIONS.hidden", "16"] if cfg == CFG else []
    return load_config(cfg, [*TINY, *width, "ENV.OUTPUT.BASE_DIR", str(out), *more])


def fit(config: Config, model: nn.Module | None = None) -> dict[str, Any]:
    """Train ``config`` in-process (its model built from the seed, as the CLI does, unless given)."""
    reset_accelerate()
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    if model is None:
        torch.manual_seed(config.EXPERIMENT.SEED)
        model = build_model(config, train)
    try:
        return Trainer(config, model, train, val).fit()
    finally:
        reset_accelerate()


def records(run: Config | Path) -> list[dict[str, Any]]:
    directory = run.output_dir if isinstance(run, Config) else run
    lines = (directory / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in lines]


def first_loss(run: Config | Path) -> float:
    return float(next(r["train/loss"] for r in records(run) if "train/loss" in r))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of the tiny config: its checkpoints/ and final/. Its metrics are those of a
    run from the weights built from the seed."""
    config = config_for(tmp_path_factory.mktemp("source"))
    fit(config)
    return config.output_dir


# -- (a) a run starts at the weights it is given ---------------------------------------------------
def test_a_run_from_a_final_directory_trains_as_from_those_weights_loaded_by_hand(
    tmp_path: Path, source: Path
) -> None:
    weights = source / "final" / "model.safetensors"
    warm = config_for(tmp_path / "warm", "MODEL.INIT_FROM", str(source / "final"))
    summary = fit(warm)
    by_hand = config_for(tmp_path / "by_hand")
    reset_accelerate()
    torch.manual_seed(by_hand.EXPERIMENT.SEED)
    model = build_model(by_hand, build_dataset(by_hand, "train"))
    model.load_state_dict(load_file(weights))
    fit(by_hand, model)
    assert records(warm) == records(by_hand)  # the same losses, gradient norms and validations
    assert first_loss(warm) != pytest.approx(first_loss(source), rel=1e-3)  # ... not the built weights'
    info = summary["run_info"]["model"]["init_from"]
    assert info["path"] == str((source / "final").resolve())
    assert info["weights_xxh3"] == file_digest(weights.read_bytes())[1]
    assert info["tensors_loaded"] == len(load_file(weights))
    assert info["left_as_built"] == 0
    written = json.loads((warm.output_dir / "assets" / "run_info.json").read_text(encoding="utf-8"))
    assert written["model"]["init_from"] == info


# -- (b) every kind of source ------------------------------------------------------------------------
def built(config: Config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(config, build_dataset(config, "train"))


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_checkpoint_directory_and_a_single_file_load_every_tensor(tmp_path: Path, source: Path) -> None:
    checkpoint = next((source / "checkpoints").glob("step_*"))
    for given in (checkpoint, checkpoint / "model.safetensors"):
        config = config_for(tmp_path, "MODEL.INIT_FROM", str(given))
        model = built(config)
        loaded = load_init_from(config.MODEL, config.TRAIN, config.output_dir, model)
        assert loaded is not None
        assert loaded.left_as_built == 0
        expected = load_file(checkpoint / "model.safetensors")
        assert model.state_dict().keys() == expected.keys()
        assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())
        assert loaded.digest == file_digest((checkpoint / "model.safetensors").read_bytes())[1]


def test_a_damaged_checkpoint_is_refused_by_its_manifest(tmp_path: Path, source: Path) -> None:
    copy = tmp_path / "step"
    shutil.copytree(next((source / "checkpoints").glob("step_*")), copy)
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # a bit of the last tensor flipped: same size, a valid file
    (copy / "model.safetensors").write_bytes(weights)
    config = config_for(tmp_path, "MODEL.INIT_FROM", str(copy))
    with pytest.raises(
        ConfigError, match=r"is not a usable checkpoint: model\.safetensors: checksum mismatch"
    ):
        load_init_from(config.MODEL, config.TRAIN, config.output_dir, built(config))


def unlist(checkpoint: Path, name: str) -> None:
    marker = json.loads((checkpoint / MARKER).read_text(encoding="utf-8"))
    marker["files"] = [e for e in marker["files"] if e["path"] != name]
    (checkpoint / MARKER).write_text(json.dumps(marker), encoding="utf-8")


def uncommitted(checkpoint: Path) -> Path:
    (checkpoint / MARKER).unlink()
    return checkpoint


# Each state of a checkpoint a resume refuses: what is done to a committed copy (the checkpoint
# directory it then is), the file of it given ("": the directory), and the problem named.
UNUSABLE: dict[str, tuple[Any, str, str]] = {
    "uncommitted": (uncommitted, "", "COMMITTED.json missing (never committed: cut by a kill"),
    "uncommitted-renamed": (  # known by its trainer_state.json
        lambda c: uncommitted(c).rename(c.parent / "weights"),
        "",
        "COMMITTED.json missing",
    ),
    "uncommitted-file": (uncommitted, "model.safetensors", "COMMITTED.json missing"),
    "weights-unlisted": (
        lambda c: unlist(c, "model.safetensors") or c,
        "",
        "model.safetensors: not in COMMITTED.json",
    ),
    "rejected": (
        lambda c: write_note(c, c.parent, "a test") or c,
        "",
        "REJECTED.txt: rejected before, because a test",
    ),
    "unsigned-with-a-key": (lambda c: c, "", f"COMMITTED.json is not signed, and {KEY_ENV} is set"),
}


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_a_checkpoint_a_resume_would_refuse_exits_2_before_anything_is_read_or_written(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    damage, given, problem = UNUSABLE[case]
    checkpoint = next((source / "checkpoints").glob("step_*"))
    shutil.copytree(checkpoint, tmp_path / "checkpoints" / checkpoint.name)
    copy = damage(tmp_path / "checkpoints" / checkpoint.name)
    if case == "unsigned-with-a-key":
        monkeypatch.setenv(KEY_ENV, "a key the source was not signed with")
    out = tmp_path / "out"
    opts = [*TINY, "MODEL.OPTIONS.hidden", "16", "ENV.OUTPUT.BASE_DIR", str(out)]
    opts += ["MODEL.INIT_FROM", str(copy / given)]  # of the model's shapes: loaded, were it usable
    rc, _, err = run_cli("train", "--cfg", CFG, "--opts", *opts)
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "MODEL.INIT_FROM" in line]
    assert len(lines) == 1, err
    assert f"MODEL.INIT_FROM: {copy.resolve()} is not a usable checkpoint: {problem}" in lines[0]
    assert lines[0].endswith("give a committed checkpoint that verifies, or the run's final/")
    assert not out.exists()  # refused before the output directory is claimed


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_a_source_neither_file_nor_directory_exits_2(tmp_path: Path, kind: str) -> None:
    path = Path(kind)
    if kind == "fifo":
        path = tmp_path / "weights.safetensors"
        os.mkfifo(path)
    out = tmp_path / "out"
    rc, _, err = run_cli(
        "train", "--cfg", CFG, "--opts", *TINY, "ENV.OUTPUT.BASE_DIR", str(out), "MODEL.INIT_FROM", str(path)
    )
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "MODEL.INIT_FROM" in line]
    assert len(lines) == 1, err
    assert f"MODEL.INIT_FROM: {path} is neither a regular file nor a directory" in lines[0]
    assert not out.exists()


def test_a_transformers_trainer_checkpoint_is_no_checkpoint_of_ours(tmp_path: Path, source: Path) -> None:
    """Its trainer_state.json is not ours (no progress): its weights load, as a save_pretrained
    directory's."""
    directory = tmp_path / "checkpoint-500"
    directory.mkdir()
    shutil.copy(source / "final" / "model.safetensors", directory)
    (directory / "trainer_state.json").write_text('{"global_step": 500, "log_history": []}')
    config = config_for(tmp_path, "MODEL.INIT_FROM", str(directory))
    loaded = load_init_from(config.MODEL, config.TRAIN, config.output_dir, built(config))
    assert loaded is not None
    assert loaded.left_as_built == 0


LM = [
    "MODEL.OPTIONS.num_hidden_layers", "1", "MODEL.OPTIONS.hidden_size", "32",
    "MODEL.OPTIONS.intermediate_size", "64", "MODEL.OPTIONS.num_attention_heads", "2",
]  # fmt: skip


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_save_pretrained_directory_of_a_tied_lm_loads_every_tensor(tmp_path: Path, sharded: bool) -> None:
    pytest.importorskip("transformers")
    lm = str(REPO / "configs" / "lm_tiny.yaml")
    plain = load_config(lm, [*LM, "ENV.OUTPUT.BASE_DIR", str(tmp_path)])
    trained: Any = built(plain, seed=1)
    trained.save_pretrained(tmp_path / "saved", max_shard_size="20KB" if sharded else "50GB")
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file() == sharded
    config = load_config(
        lm, [*LM, "ENV.OUTPUT.BASE_DIR", str(tmp_path), "MODEL.INIT_FROM", str(tmp_path / "saved")]
    )
    model: Any = built(config, seed=2)
    assert not same_state(model, trained)
    loaded = load_init_from(config.MODEL, config.TRAIN, config.output_dir, model)
    assert same_state(model, trained)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert loaded is not None
    assert loaded.left_as_built == 0
    assert (len(loaded.files) > 1) == sharded


class Tied(nn.Module):
    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.body = nn.Linear(3, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(3))


def test_a_compiled_or_ddp_models_file_loads_under_the_models_own_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = Tied()
    saved.scale.fill_(2.0)  # a buffer is loaded too
    state = {k: v for k, v in saved.state_dict().items() if k != "out.weight"}  # the tied copy left out
    save_file({f"module._orig_mod.{k}": v for k, v in state.items()}, tmp_path / "w.safetensors")
    config = Config.model_validate({"MODEL": {"INIT_FROM": str(tmp_path / "w.safetensors")}})
    for wrap in (False, True):
        torch.manual_seed(1)
        model = Tied()
        target: Any = torch.compile(model, backend="eager") if wrap else model
        loaded = load_init_from(config.MODEL, config.TRAIN, config.output_dir, target)
        assert same_state(model, saved)
        assert model.out.weight is model.embed.weight
        assert loaded is not None
        assert (loaded.loaded, loaded.left_as_built) == (len(state), 0)


# -- (c), (d) strict by default; INIT_IGNORE -----------------------------------------------------------
def test_missing_and_unexpected_keys_are_listed_with_the_fix(tmp_path: Path, source: Path) -> None:
    tensors = load_file(source / "final" / "model.safetensors")
    del tensors["heads.1.weight"]
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "w.safetensors")
    config = config_for(tmp_path, "MODEL.INIT_FROM", str(tmp_path / "w.safetensors"))
    with pytest.raises(ConfigError) as info:
        load_init_from(config.MODEL, config.TRAIN, config.output_dir, built(config))
    text = str(info.value)
    assert "MODEL.INIT_FROM" in text
    assert "lacks 1 key (heads.1.weight) of the model" in text
    assert "holds 1 key (extra.weight), which the model lacks" in text
    assert "MODEL.INIT_IGNORE (e.g. [heads.1.*])" in text


def convnet_file(tmp_path: Path, classes: int) -> Path:
    torch.manual_seed(3)
    save_file(DigitsConvNet(classes, channels=8).state_dict(), tmp_path / "convnet.safetensors")
    return tmp_path / "convnet.safetensors"


def test_a_head_of_another_size_is_refused_naming_both_shapes(tmp_path: Path) -> None:
    weights = convnet_file(tmp_path, classes=5)
    config = config_for(
        tmp_path, "MODEL.OPTIONS.channels", "8", "MODEL.INIT_FROM", str(weights), cfg=IMAGES_CFG
    )
    with pytest.raises(ConfigError) as info:
        load_init_from(config.MODEL, config.TRAIN, config.output_dir, built(config))
    (key, message), *rest = info.value.problems
    assert key == "MODEL.INIT_FROM"
    assert len(rest) == 1  # head.1.weight too
    assert message.startswith("head.1.bias: ")
    assert "holds shape [5], the model [10]" in message


def test_init_ignore_leaves_a_new_head_as_built(tmp_path: Path) -> None:
    weights = convnet_file(tmp_path, classes=5)
    more = ["MODEL.OPTIONS.channels", "8", "MODEL.INIT_FROM", str(weights), "MODEL.INIT_IGNORE", "[head.*]"]
    config = config_for(tmp_path, *more, cfg=IMAGES_CFG)
    model, fresh = built(config, seed=4), built(config, seed=4)
    loaded = load_init_from(config.MODEL, config.TRAIN, config.output_dir, model)
    assert loaded is not None
    assert (loaded.loaded, loaded.left_as_built) == (6, 2)
    source = load_file(weights)
    for name, tensor in model.state_dict().items():
        expected = fresh.state_dict()[name] if name.startswith("head.") else source[name]
        assert torch.equal(tensor, expected), name
    typo = config_for(tmp_path, *more[:-1], "[heads.*]", cfg=IMAGES_CFG)
    with pytest.raises(ConfigError, match=r"'heads\.\*' matches no key"):
        load_init_from(typo.MODEL, typo.TRAIN, typo.output_dir, built(typo))


# -- (e) refusals ---------------------------------------------------------------------------------------
def test_a_pickle_only_directory_is_refused_and_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "old"
    directory.mkdir()
    torch.save({"w": torch.zeros(1)}, directory / "pytorch_model.bin")
    (directory / "config.json").write_text("{}", encoding="utf-8")

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", never)
    monkeypatch.setattr("pickle.load", never)
    monkeypatch.setattr("pickle.loads", never)
    config = config_for(tmp_path, "MODEL.INIT_FROM", str(directory))
    with pytest.raises(ConfigError) as info:
        load_init_from(config.MODEL, config.TRAIN, config.output_dir, built(config))
    text = str(info.value)
    assert "MODEL.INIT_FROM" in text
    assert "pytorch_model.bin" in text
    assert "convert it" in text
    single = config_for(tmp_path, "MODEL.INIT_FROM", str(directory / "pytorch_model.bin"))
    with pytest.raises(ConfigError, match=r"is not a \.safetensors file"):
        load_init_from(single.MODEL, single.TRAIN, single.output_dir, built(single))


def test_a_lora_adapter_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}", encoding="utf-8")
    save_file({"x": torch.zeros(1)}, tmp_path / "adapter_model.safetensors")
    config = config_for(tmp_path, "MODEL.INIT_FROM", str(tmp_path))
    with pytest.raises(ConfigError, match=r"LoRA adapter .*final/merged/"):
        load_init_from(config.MODEL, config.TRAIN, config.output_dir, built(config))


def test_a_missing_path_exits_2_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    opts = [*TINY, "ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "MODEL.INIT_FROM", str(tmp_path / "none")]
    rc, _, err = run_cli("train", "--cfg", CFG, "--opts", *opts)
    assert rc == 2
    assert f"MODEL.INIT_FROM: {tmp_path / 'none'} does not exist" in err
    assert list(tmp_path.iterdir()) == []  # checked before the output directory is claimed


@pytest.mark.parametrize(
    ("opts", "keys"),
    [
        (
            ["MODEL.INIT_FROM", "/x", "MODEL.OPTIONS.pretrained", "/y"],
            "MODEL.INIT_FROM, MODEL.OPTIONS.pretrained",
        ),
        (["MODEL.INIT_IGNORE", "[head.*]"], "MODEL.INIT_IGNORE, MODEL.INIT_FROM"),
    ],
)
def test_config_rules(opts: list[str], keys: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(CFG, opts)
    assert [k for k, _ in info.value.problems] == [keys]


# -- (g) resume --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_and_rerun_with_init_from_ends_byte_identical(tmp_path: Path, source: Path) -> None:
    opts = [
        *TINY, "MODEL.OPTIONS.hidden", "16", "TRAIN.STEPS", "6", "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "3",
        "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null", "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
        "MODEL.OPTIONS.dropout", "0.1", "MODEL.INIT_FROM", str(tmp_path / "weights"),
    ]  # fmt: skip
    shutil.copytree(source / "final", tmp_path / "weights")
    (tmp_path / "reference").mkdir()
    (tmp_path / "killed").mkdir()
    reference = run_here(TrainRun(tmp_path / "reference", opts)).check_ok()
    run = TrainRun(tmp_path / "killed", opts)
    run.run(kill_at="checkpoint_committed:1").check_killed()  # right after step 3's commit
    # The source removed since (a scratch copy): the rerun resumes from its own checkpoint.
    shutil.rmtree(tmp_path / "weights")
    resumed = run_here(run)
    assert_resumed_from(resumed.output, 3)
    assert_same_run(resumed, reference)
    # --overwrite would start over from the weights as built: refused, nothing written.
    refused = run_here(run, args=["--overwrite"])
    assert refused.returncode == 2, refused.tail()
    assert "MODEL.INIT_FROM" in refused.output, refused.tail()
    assert "does not exist" in refused.output, refused.tail()
    assert (run.dir / "summary.json").is_file()  # the finished run is still there
