"""OPTIMIZER.NAME muon: the hidden layers' 2-D weights trained by torch.optim.Muon, the rest by
AdamW. The split is right for the models users train (a transformers Llama and GPT-2, the nanoGPT
example); a Muon step and an AdamW step are torch's own, bit for bit; the LR of each side follows
the schedule; a run killed with SIGKILL and rerun ends with the same bytes; two processes end where
one does."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers.configs import CFG, LM_CFG, SMALL_LM
from helpers.in_process import run_cli, run_here
from helpers.nanogpt import load_example
from helpers.rollback import NAN_RUN  # registers the poisoned_digits dataset
from helpers.runs import Result, TrainRun, assert_resumed_from, assert_same_run, read_summary
from safetensors.torch import load_file
from torch import nn

from linnaeus_accel.config import ConfigError, load_config
from linnaeus_accel.config.optimizer import MuonConfig
from linnaeus_accel.optim import build_from_config
from linnaeus_accel.optim.muon import MuonWithAdamW, muon_split, warmed_momentum
from linnaeus_accel.training.start.backends import check_optimizer_backend
from linnaeus_accel.training.start.setup import parameter_groups

transformers.logging.set_verbosity_error()


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return transformers.LlamaForCausalLM(config)  # untied lm_head


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(config)  # Conv1D weights, lm_head tied to wte


def nanogpt() -> nn.Module:
    example = load_example()  # examples/nanogpt_model.py
    return example.GPT(example.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))


LLAMA_MUON = [f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkvo"] + [
    f"model.layers.0.mlp.{m}_proj.weight" for m in ("gate", "up", "down")
]
GPT2_MUON = [f"transformer.h.0.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
NANOGPT_MUON = [f"blocks.0.{m}.weight" for m in ("attn.qkv", "attn.proj", "mlp.up", "mlp.proj")]


@pytest.mark.parametrize(
    ("build", "muon", "adamw"),
    [
        # Llama: every projection to Muon; the input embedding, the untied lm_head and the RMSNorm gains to AdamW
        (
            llama,
            LLAMA_MUON,
            {
                "model.embed_tokens.weight": "embedding",
                "lm_head.weight": "head",
                "model.layers.0.input_layernorm.weight": "not 2-D",
                "model.layers.0.post_attention_layernorm.weight": "not 2-D",
                "model.norm.weight": "not 2-D",
            },
        ),
        # GPT-2: its Conv1D weights are 2-D (stored in, out) and go to Muon; the tied lm_head is wte itself
        (
            gpt2,
            GPT2_MUON,
            {"transformer.wte.weight": "embedding", "transformer.wpe.weight": "embedding"},
        ),
        # the nanoGPT example: fused qkv and the MLP to Muon; both embeddings (the head is tied) to AdamW
        (
            nanogpt,
            NANOGPT_MUON,
            {"token_embedding.weight": "embedding", "position_embedding.weight": "embedding"},
        ),
    ],
)
def test_the_split_sends_hidden_matrices_to_muon_and_the_rest_to_adamw(
    build: Any, muon: list[str], adamw: dict[str, str]
) -> None:
    model = build()
    split = muon_split(model, MuonConfig())
    assert split.muon == muon
    assert {n: r for n, r in split.adamw.items() if r != "not 2-D" or n in adamw} == adamw
    # every trained parameter is on exactly one side, every one not 2-D on AdamW's
    names = [n for n, _ in model.named_parameters()]
    assert sorted(split.muon + list(split.adamw)) == sorted(names)
    assert all(split.adamw[n] == "not 2-D" for n, p in model.named_parameters() if p.ndim != 2)


def test_overrides_by_name_and_their_mistakes() -> None:
    model = llama()
    # a hidden weight kept on AdamW, the untied head sent to Muon
    config = MuonConfig(ADAMW_MATCH=["*.down_proj.weight"], MUON_MATCH=["lm_head.weight"])
    split = muon_split(model, config)
    assert split.adamw["model.layers.0.mlp.down_proj.weight"] == "ADAMW_MATCH"
    assert "lm_head.weight" in split.muon
    with pytest.raises(ConfigError) as exc:
        muon_split(model, MuonConfig(MUON_MATCH=["*norm*"], ADAMW_MATCH=["decoder.*"]))
    assert exc.value.problems == [
        ("OPTIMIZER.MUON.ADAMW_MATCH", "'decoder.*' matches no trained parameter name"),
        (
            "OPTIMIZER.MUON.MUON_MATCH",
            "matches model.layers.0.input_layernorm.weight of shape [16]: torch.optim.Muon trains 2-D "
            "matrices only; narrow the pattern",
        ),
        (
            "OPTIMIZER.MUON.MUON_MATCH",
            "matches model.layers.0.post_attention_layernorm.weight of shape [16]: torch.optim.Muon trains "
            "2-D matrices only; narrow the pattern",
        ),
        (
            "OPTIMIZER.MUON.MUON_MATCH",
            "matches model.norm.weight of shape [16]: torch.optim.Muon trains 2-D matrices only; narrow the "
            "pattern",
        ),
    ]


@pytest.mark.parametrize(
    ("optimizer", "key", "start"),
    [
        # Muon's settings on another optimizer would be silently ignored
        ({"NAME": "adamw", "MUON": {"LR": 0.05}}, "OPTIMIZER.MUON", "is read only with NAME: muon"),
        # SGD's momentum is not Muon's
        ({"NAME": "muon", "MOMENTUM": 0.9}, "OPTIMIZER.MOMENTUM", "is SGD's; Muon's is MUON.MOMENTUM"),
        # two optimizers: extra keyword arguments would be ambiguous
        ({"NAME": "muon", "OPTIONS": {"amsgrad": True}}, "OPTIMIZER.OPTIONS", "is not read with NAME: muon"),
        # torch's bound
        ({"NAME": "muon", "MUON": {"NS_STEPS": 100}}, "OPTIMIZER.MUON.NS_STEPS", "must be below 100"),
        # a start with no warmup to start it
        (
            {"NAME": "muon", "MUON": {"MOMENTUM_START": 0.5}},
            "OPTIMIZER.MUON.MOMENTUM_START, OPTIMIZER.MUON.MOMENTUM_WARMUP_STEPS",
            "is read only with a warmup",
        ),
        # torch.optim.Muon's two LR adjustments only
        (
            {"NAME": "muon", "MUON": {"ADJUST_LR": "none"}},
            "OPTIMIZER.MUON.ADJUST_LR",
            "'original' or 'match_rms_adamw'",
        ),
    ],
)
def test_config_mistakes_name_the_key(optimizer: dict[str, Any], key: str, start: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"OPTIMIZER": optimizer})
    found = dict(exc.value.problems)
    assert key in found, exc.value.problems
    assert start in found[key]


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.85),  # the first step at MOMENTUM_START
        (150, 0.90),  # half way up the line
        (299, 0.85 + 0.10 * 299 / 300),  # the last step of the warmup
        (300, 0.95),  # MOMENTUM from the warmup's end
        (10_000, 0.95),  # and held
    ],
)
def test_the_momentum_warmup_is_nanochats_line(step: int, expected: float) -> None:
    assert warmed_momentum(step, 0.85, 0.95, 300) == pytest.approx(expected, abs=1e-15)


class MLP(nn.Module):
    """Two hidden matrices (Muon), biases and a head (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 5)
        self.head = nn.Linear(5, 3)


def built(model: nn.Module, **optimizer: Any) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    config = load_config({"OPTIMIZER": {"NAME": "muon", **optimizer}, "LR_SCHEDULER": {"BASE_LR": 1e-3}})
    groups = parameter_groups(model, config.OPTIMIZER, config.LR_SCHEDULER)
    return build_from_config(groups, config), groups


def set_lrs(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """As the training loop does: the LR group's curve, x lr_scale on the Muon side."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def gradients(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_each_side_steps_exactly_as_torchs_optimizer_does() -> None:
    """Three steps (momentum and Adam's moments build up) over the same gradients: the Muon side
    equals torch.optim.Muon at MUON.LR, the AdamW side torch.optim.AdamW at BASE_LR, bit for bit."""
    ours_model = MLP()
    theirs_model = copy.deepcopy(ours_model)
    ours, groups = built(ours_model, WEIGHT_DECAY=0.1, NO_DECAY=["bias"], MUON={"WEIGHT_DECAY": 0.01})
    assert isinstance(ours, MuonWithAdamW)
    assert [(g["algorithm"], g.get("lr_scale")) for g in groups] == [
        ("adamw", None),  # the head's weight
        ("adamw", None),  # the biases: NO_DECAY
        ("muon", 20.0),  # up and down: MUON.LR / BASE_LR
    ]
    theirs_by_name = dict(theirs_model.named_parameters())
    muon = torch.optim.Muon(
        [theirs_by_name["up.weight"], theirs_by_name["down.weight"]],
        lr=0.02,
        weight_decay=0.01,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
    )
    adamw = torch.optim.AdamW([theirs_by_name["head.weight"]], lr=1e-3, weight_decay=0.1)
    biases = torch.optim.AdamW(
        [p for n, p in theirs_by_name.items() if n.endswith("bias")], lr=1e-3, weight_decay=0
    )
    for step in range(3):
        gradients(ours_model, step)
        gradients(theirs_model, step)
        set_lrs(ours, 1e-3)
        ours.step()
        for o in (muon, adamw, biases):
            o.step()
    for (name, p), q in zip(ours_model.named_parameters(), theirs_model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_state_dict_is_torchs_plain_format_and_resumes_exactly() -> None:
    model = MLP()
    optimizer, _ = built(model)
    for step in range(2):
        gradients(model, step)
        set_lrs(optimizer, 1e-3)
        optimizer.step()
    state = optimizer.state_dict()
    assert [g["algorithm"] for g in state["param_groups"]] == ["adamw", "muon"]
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # AdamW's, the head's weight
    muon_index = state["param_groups"][1]["params"][0]
    assert set(state["state"][muon_index]) == {"momentum_buffer"}

    resumed_model = copy.deepcopy(model)
    resumed, _ = built(resumed_model)
    resumed.load_state_dict(copy.deepcopy(state))
    for m, o in ((model, optimizer), (resumed_model, resumed)):
        gradients(m, 7)
        set_lrs(o, 5e-4)
        o.step()
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_sharded_backends_are_refused_before_the_first_step() -> None:
    """FSDP and DeepSpeed run only on accelerators: this checks the decision on their names."""
    from accelerate.utils import DistributedType

    optimizer, _ = built(MLP())

    class Backend:
        def __init__(self, kind: DistributedType) -> None:
            self.distributed_type = kind

    check_optimizer_backend(Backend(DistributedType.MULTI_GPU), optimizer)  # DDP: whole matrices
    for kind, name in ((DistributedType.FSDP, "FSDP"), (DistributedType.DEEPSPEED, "DeepSpeed")):
        with pytest.raises(ConfigError) as exc:
            check_optimizer_backend(Backend(kind), optimizer)
        ((key, message),) = exc.value.problems
        assert key == "OPTIMIZER.NAME"
        assert f"but {name} gives every process only a shard of it" in message


def test_plan_prints_each_sides_share_and_peak_lr() -> None:
    rc, out, err = run_cli("plan", "--cfg", LM_CFG, "--opts", *SMALL_LM, "OPTIMIZER.NAME", "muon")
    assert rc == 0, err
    assert "Optimizer: muon, Muon on the 2-D hidden weights: momentum 0.95 (Nesterov), 5 Newton-Schulz" in out
    # lm_tiny's BASE_LR 3e-3: the Muon side's curve is x 0.02 / 3e-3
    assert "Muon LR:  each LR group's curve x 6.667 (MUON.LR / BASE_LR): peak 'default' 0.02" in out
    muon = re.search(r"Muon:  (\d+) tensors, ([\d,]+) parameters \(2-D hidden weights\), peak LR 0.02", out)
    assert muon is not None, out
    assert muon.group(1) == "7"  # q, k, v, o, gate, up, down of the one layer
    assert "AdamW: 4 tensors" in out  # the tied embedding, two norms and the final norm
    assert "  embedding: model.embed_tokens.weight" in out


def test_plan_warns_of_a_momentum_warmup_longer_than_the_run() -> None:
    opts = [*SMALL_LM, "OPTIMIZER.NAME", "muon", "OPTIMIZER.MUON.MOMENTUM_WARMUP_STEPS", "100000"]
    rc, _, err = run_cli("plan", "--cfg", LM_CFG, "--opts", *opts)
    assert rc == 0, err
    assert "OPTIMIZER.MUON.MOMENTUM_WARMUP_STEPS: a warmup of 100000 steps is longer than the run (" in err
    assert "the momentum never reaches MUON.MOMENTUM (0.95); shorten the warmup" in err


# lm_tiny, small: 24 steps of 8 sequences, each as two micro-batches of 4 (one process accumulating
# two, or two processes), a checkpoint every 8; Muon's momentum warmed over the first 20 steps, so
# that a resume at step 16 lands inside the warmup.
MUON_RUN = [
    *SMALL_LM,
    "OPTIMIZER.NAME", "muon",
    "OPTIMIZER.MUON.MOMENTUM_WARMUP_STEPS", "20",
    "TRAIN.TARGET_TOKENS", str(24 * 8 * 128),
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "8",
    "DATA.BATCH_SIZE", "4",
]  # fmt: skip
ACCUMULATING = [*MUON_RUN, "TRAIN.ACCUMULATION_STEPS", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Result:
    return run_here(TrainRun(tmp_path_factory.mktemp("muon_ref"), ACCUMULATING, cfg=LM_CFG)).check_ok()


@pytest.mark.slow
def test_killed_then_rerun_ends_with_the_same_bytes(uninterrupted: Result, tmp_path: Path) -> None:
    run = TrainRun(tmp_path, ACCUMULATING, cfg=LM_CFG)
    run.run(kill_at="checkpoint_committed:2").check_killed()  # right after step 16's checkpoint
    resumed = run_here(run)
    assert_resumed_from(resumed.output, 16)
    assert_same_run(resumed, uninterrupted)
    assert "Optimizer built: MuonWithAdamW (Muon 7 tensors" in resumed.output


@pytest.mark.slow
def test_killed_on_one_process_then_resumed_on_two_ends_with_the_same_bytes(
    uninterrupted: Result, tmp_path: Path
) -> None:
    """One process accumulating two micro-batches of 4 trains the first 16 steps and is SIGKILLed;
    two processes of 4 resume it (elastic, onto more processes than wrote the checkpoint) and end
    with the bytes of the run that was one process throughout: both take the same 8 sequences a
    step, summed in the same order. (Against one micro-batch of 8 they agree only to rounding: its
    gradient is summed in another order, and torch's Muon orthogonalises it in bf16, where a
    rounding step can flip.)"""
    run = TrainRun(tmp_path, ACCUMULATING, cfg=LM_CFG)
    run.run(kill_at="checkpoint_committed:2").check_killed()
    run.processes, run.opts = 2, list(MUON_RUN)
    resumed = run.run().check_ok()
    assert_resumed_from(resumed.output, 16)
    final = resumed.dir / "final" / "model.safetensors"
    assert final.read_bytes() == (uninterrupted.dir / "final" / "model.safetensors").read_bytes()
    # (the losses logged after the resume are added up across processes, in another order)
    got, want = read_summary(resumed.dir), read_summary(uninterrupted.dir)
    assert [got[k] for k in ("global_step", "tokens_seen")] == [
        want[k] for k in ("global_step", "tokens_seen")
    ]


def test_the_lr_and_momentum_of_each_side_follow_the_schedule(uninterrupted: Result) -> None:
    """The loop sets lr/default from the schedule, the Muon groups' LR at x MUON.LR / BASE_LR and
    their momentum on its warmup: the checkpoints' optimizer state holds them as step 16's (inside
    the warmup) and step 24's set them."""
    config = load_config(LM_CFG, ACCUMULATING)
    ratio = config.OPTIMIZER.MUON.LR / config.LR_SCHEDULER.BASE_LR
    checkpoints = uninterrupted.dir / "checkpoints"
    for step, momentum in ((16, 0.85 + 0.10 * 15 / 20), (24, 0.95)):  # set before 0-based steps 15 and 23
        state = torch.load(checkpoints / f"step_{step:08d}" / "optimizer.bin", weights_only=True)
        groups = {g["algorithm"]: g for g in state["param_groups"]}
        assert groups["muon"]["lr"] == pytest.approx(groups["adamw"]["lr"] * ratio)
        assert groups["adamw"]["lr"] > 0
        assert groups["muon"]["momentum"] == pytest.approx(momentum, abs=1e-12)


# tests/test_rollback.py's run (sample 773 of the digits has NaN pixels, in steps 7 and 19), with Muon.
MUON_NAN_RUN = [*NAN_RUN[: NAN_RUN.index("TRAIN.NONFINITE")], "OPTIMIZER.NAME", "muon"]


@pytest.mark.parametrize(
    ("mode", "rollbacks"),
    [
        ("skip", 0),  # the two NaN steps are dropped (no update), the run trains on
        ("rollback", 2),  # each NaN rolls the run back to its last checkpoint, Muon's momentum with it
    ],
)
def test_a_nan_is_skipped_or_rolled_back_and_the_weights_stay_finite(
    mode: str, rollbacks: int, tmp_path: Path
) -> None:
    from helpers.in_process import reset_accelerate

    reset_accelerate()
    try:
        rc, out, err = run_cli(
            "train", "--cfg", CFG, "--opts", *MUON_NAN_RUN, "TRAIN.NONFINITE", mode,
            "ENV.OUTPUT.BASE_DIR", str(tmp_path), "EXPERIMENT.NAME", "run",
        )  # fmt: skip
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    summary = read_summary(tmp_path / "run")
    assert (summary["status"], summary["global_step"], len(summary["rollbacks"])) == (
        "completed",
        24,
        rollbacks,
    )
    weights = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert "Optimizer built: MuonWithAdamW" in out
