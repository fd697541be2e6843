"""causal_lm with a model that computes its own loss (``TASK.MODEL_LOSS``), as nanoGPT's does.

- The logged loss of a step is the exact mean over its target tokens: two accumulated micro-batches
  of different target counts (padding ignored as -1) against the cross-entropy computed here from
  the logits the model produced.
- The same GPT gives the same summed loss, counts and validation sums through its own loss as
  through the per-token path (wrapped to return logits); a micro-batch without targets adds 0;
  nothing is read back to the host.
- ``examples/nanogpt_model.py`` through the CLI: accumulation 2 logs the losses of one batch twice
  the size, and the loss falls.
- A window longer than the model's block: the message says that seq_len counts the shifted target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.configs import REPO
from helpers.datasets import Sequences
from helpers.in_process import run_cli
from helpers.nanogpt import ReadBacks, tiny_gpt
from helpers.processes import after_commits
from helpers.runs import TrainRun, assert_resumed_from, assert_same_run
from torch import Tensor, nn

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.config import ConfigError
from linnaeus_accel.tasks import STANDARD_PASS
from linnaeus_accel.tasks.causal_lm import CausalLMTask
from linnaeus_accel.training.start.task_checks import probe_problem

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

EXAMPLE_CONFIG = REPO / "examples" / "nanogpt.yaml"


def pad(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right padding with id 0, which carries no target (-100)."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    real = torch.arange(longest) < lengths[:, None]
    return {"input_ids": ids, "labels": ids.masked_fill(~real, -100)}


class Recording(nn.Module):
    """A GPT that keeps the logits and targets of every training call (with gradients)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt
        self.calls: list[tuple[Tensor, Tensor]] = []

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits, loss = self.gpt(idx, targets)
        if torch.is_grad_enabled() and targets is not None:
            self.calls.append((logits.detach().clone(), targets.clone()))
        return logits, loss


def test_logged_loss_is_the_exact_mean_over_the_steps_targets(tmp_path: Path) -> None:
    config = load_config(
        {
            "EXPERIMENT": {"NAME": "own_loss", "SEED": 3},
            "ENV": {"OUTPUT": {"BASE_DIR": str(tmp_path)}},
            "TASK": {"NAME": "causal_lm", "MODEL_LOSS": True, "MODEL_IGNORE_INDEX": -1},
            "DATA": {"BATCH_SIZE": 4},
            "TRAIN": {"EPOCHS": 1, "ACCUMULATION_STEPS": 2, "CLIP_GRAD": None},
            "LR_SCHEDULER": {"NAME": "cosine", "BASE_LR": 0.01, "REFERENCE_BS": None},
            "SCHEDULE": {"METRICS": {"STEP_INTERVAL": 1}},
        }
    )
    model = Recording(tiny_gpt())
    result = Trainer(config, model, Sequences(24, 1), Sequences(8, 2), collate_fn=pad).fit()
    assert result["status"] == "completed"
    logged = [json.loads(x) for x in (tmp_path / "own_loss" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "train/loss" in r]
    assert [r["global_step"] for r in steps] == [1, 2, 3]
    assert len(model.calls) == 6  # 2 micro-batches a step
    seen = 0
    for k, record in enumerate(steps):
        pair = model.calls[2 * k : 2 * k + 2]
        for _, targets in pair:  # unlabelled targets reach the model as its ignore index
            assert (targets == -1).any()
            assert not (targets == -100).any()
        counts = [int((targets != -1).sum()) for _, targets in pair]
        # What makes this a test: a mean of the two micro-batches' means would weigh a target of
        # the shorter one more than one of the longer.
        assert counts[0] != counts[1]
        summed = sum(
            F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1), ignore_index=-1, reduction="sum")
            for logits, targets in pair
        )
        assert record["train/loss"] == pytest.approx(float(summed) / sum(counts), rel=1e-5)
        seen += sum(counts)
        assert record["tokens_seen"] == seen


def batch_with_padding() -> dict[str, Tensor]:
    return pad([Sequences(6, 4)[i] for i in range(6)])


def test_own_loss_equals_the_per_token_path_for_the_same_gpt() -> None:
    class Logits(nn.Module):  # the same GPT as a transformers-style model: logits of the whole window
        def __init__(self, gpt: nn.Module) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
            logits: Tensor = self.gpt(input_ids)[0]
            return logits

    gpt, batch = tiny_gpt(), batch_with_padding()
    own, per_token = CausalLMTask(model_loss=True, ignore_index=-1), CausalLMTask()
    assert own.units(batch).tolist() == per_token.units(batch).tolist()
    torch.testing.assert_close(own.loss_sums(gpt, batch), per_token.loss_sums(Logits(gpt), batch))
    with torch.no_grad():
        torch.testing.assert_close(
            own.validation_step(gpt, batch, None, STANDARD_PASS),
            per_token.validation_step(Logits(gpt), batch, None, STANDARD_PASS),
        )
    # Even-batch repeats (rows outside real) count nowhere; a micro-batch of repeats only adds 0,
    # and no gradient, though the model's mean over no target is 0/0.
    repeats = own.prepare(batch, 0, 1, 0, torch.zeros(6, dtype=torch.bool))
    assert own.units(repeats).tolist() == [0]
    total = own.loss_sums(gpt, repeats)
    assert total.tolist() == [0.0]
    total.sum().backward()  # type: ignore[no-untyped-call]
    assert all(p.grad is not None and torch.all(p.grad == 0) for p in gpt.parameters())


def test_a_micro_batch_reads_nothing_back_to_the_host() -> None:
    gpt, task, padded = tiny_gpt(), CausalLMTask(model_loss=True, ignore_index=-1), batch_with_padding()
    with ReadBacks() as reads:
        batch = task.prepare(padded, 0, 1, 0, torch.arange(6) < 5)
        task.units(batch)
        task.loss_sums(gpt, batch).sum().backward()  # type: ignore[no-untyped-call]
    assert reads.found == []


def test_model_output_problems_name_the_option() -> None:
    gpt, batch = tiny_gpt(), batch_with_padding()
    # nanoGPT's model under the per-token path: it returns (logits, None), and the fix is named.
    problem = CausalLMTask().output_problem(gpt(batch["input_ids"]), batch)
    assert problem is not None
    assert "TASK.MODEL_LOSS" in problem
    # With the option, a model that returns no loss is named as such.
    own = CausalLMTask(model_loss=True, ignore_index=-1)
    problem = own.output_problem(torch.zeros(6, 18, 16), batch)
    assert problem is not None
    assert "must return its loss" in problem
    assert own.output_problem(own.forward(gpt, batch), batch) is None
    assert probe_problem(own, gpt, batch, torch.device("cpu")) is None


def test_options_are_refused_where_they_would_do_nothing() -> None:
    with pytest.raises(ConfigError, match=r"TASK\.MODEL_IGNORE_INDEX .* TASK\.MODEL_LOSS is off"):
        load_config({"TASK": {"NAME": "causal_lm", "MODEL_IGNORE_INDEX": -1}})
    with pytest.raises(ConfigError, match=r"TASK\.MODEL_LOSS is for causal_lm"):
        load_config({"TASK": {"NAME": "classification", "MODEL_LOSS": True}})


def example_run(out: Path, name: str, *opts: str) -> list[dict[str, Any]]:
    common = ["ENV.OUTPUT.BASE_DIR", str(out), "EXPERIMENT.NAME", name, "TRAIN.STEPS", "6"]
    common += ["LR_SCHEDULER.WARMUP_STEPS", "0", "SCHEDULE.METRICS.STEP_INTERVAL", "1"]
    common += ["MODEL.OPTIONS.n_layer", "2", "MODEL.OPTIONS.n_embd", "64"]
    rc, _, err = run_cli("train", "--cfg", str(EXAMPLE_CONFIG), "--opts", *common, *opts)
    assert rc == 0, err[-3000:]
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


def test_nanogpt_example_accumulated_matches_one_batch_and_learns(tmp_path: Path) -> None:
    whole = example_run(tmp_path, "whole", "DATA.BATCH_SIZE", "16")
    split = example_run(tmp_path, "split", "DATA.BATCH_SIZE", "8", "TRAIN.ACCUMULATION_STEPS", "2")
    assert [r["global_step"] for r in whole] == [r["global_step"] for r in split] == list(range(1, 7))
    for a, b in zip(whole, split, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5), a["global_step"]
        assert a["tokens_seen"] == b["tokens_seen"] == a["global_step"] * 16 * 64
    losses = [r["train/loss"] for r in whole]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(257), rel=0.05)  # a uniform guess over 257 ids
    assert losses[-1] < losses[0] - 0.25


def test_window_longer_than_the_block_says_what_seq_len_counts(tmp_path: Path) -> None:
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.STEPS", "2"]
    # 66 tokens a window: 65 inputs for a block of 64.
    rc, _, err = run_cli(
        "train", "--cfg", str(EXAMPLE_CONFIG), "--opts", *opts, "DATA.DATASET.OPTIONS.seq_len", "66"
    )
    assert rc == 2
    assert "longer than block_size 64" in err
    assert "seq_len (66) counts the shifted target" in err
    assert "inputs are seq_len - 1 tokens" in err
    # Without the option the model sees the whole window, and the message names the option.
    rc, _, err = run_cli(
        "train", "--cfg", str(EXAMPLE_CONFIG), "--opts", *opts, "TASK.MODEL_LOSS", "false",
        "TASK.MODEL_IGNORE_INDEX", "-100",
    )  # fmt: skip
    assert rc == 2
    assert "a sequence of 65 tokens is longer than block_size 64" in err
    assert "seq_len (65) counts the shifted target, and without TASK.MODEL_LOSS the model sees all" in err


# examples/nanogpt_model.py's own entry point, as `python examples/nanogpt_model.py train ...` runs it.
RUN_EXAMPLE = (
    "import runpy, sys\n"
    f"runpy.run_path({str(REPO / 'examples' / 'nanogpt_model.py')!r}, run_name='nanogpt_model')\n"
    "from linnaeus_accel.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_nanogpt_recipe_killed_then_resumed_ends_byte_identical(tmp_path: Path) -> None:
    """The whole recipe (random windows, the model's own loss, AdamW with decay on 2-D weights only,
    validation on a seeded subset of 2 batches) killed with SIGKILL between checkpoints, then rerun
    by the same command: the same weights and the same metrics, to the byte, as without the kill."""

    opts = [
        *("TRAIN.STEPS", "12", "DATA.BATCH_SIZE", "8", "LR_SCHEDULER.WARMUP_STEPS", "2"),
        *("MODEL.OPTIONS.n_layer", "1", "MODEL.OPTIONS.n_embd", "32", "MODEL.OPTIONS.n_head", "2"),
        *("SCHEDULE.VALIDATION.INTERVAL_STEPS", "4", "SCHEDULE.VALIDATION.MAX_BATCHES", "2"),
        *("SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "4", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2"),
        *("SCHEDULE.METRICS.STEP_INTERVAL", "1", "ENV.PROGRESS_BAR", "false"),
    ]
    cfg = str(EXAMPLE_CONFIG)
    (tmp_path / "ref").mkdir()
    (tmp_path / "killed").mkdir()
    reference = TrainRun(tmp_path / "ref", opts, cfg=cfg).run(python_code=RUN_EXAMPLE).check_ok()
    run = TrainRun(tmp_path / "killed", opts, cfg=cfg)
    run.run(
        kill_at="optimizer_step:10", python_code=RUN_EXAMPLE, extra_env=after_commits(2)
    ).check_killed()  # after step 8's
    resumed = run.run(python_code=RUN_EXAMPLE)
    assert_resumed_from(resumed.output, 8)
    assert_same_run(resumed, reference)
