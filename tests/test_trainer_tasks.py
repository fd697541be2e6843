"""The Trainer with each task, on real Accelerate in this process (world size 1, CPU).

- causal_lm: a step's loss is the mean over all its target tokens: accumulating two padded
  micro-batches of different token counts equals one batch holding both, step by step, and
  ``tokens_seen`` equals the target tokens counted here independently.
- ``TRAIN.TARGET_TOKENS``: the run stops at the step ``plan`` resolves, mid-epoch, with the final
  validation and checkpoint there, and has seen exactly that many tokens.
- classification: a small convnet learns the digits to more than 90% top-1; checkpoints are ranked
  by top-1 accuracy, higher being better because the task says so.
- A task of your own in a few lines trains, validates and stops early on its own metric.
- A dataset or model that lacks what the task needs is one ConfigError at construction, naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import REPO
from helpers.datasets import Sequences
from helpers.in_process import reset_accelerate
from helpers.runs import read_metrics, read_summary
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.utils.data import IterableDataset, TensorDataset

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.cli import main
from linnaeus_accel.config import Config, ConfigError
from linnaeus_accel.data.tokens.packing import PackedTokens
from linnaeus_accel.tasks import STANDARD_PASS, Direction, Task, ValidationPass

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# -- causal_lm ---------------------------------------------------------------------------------


class CausalBag(nn.Module):
    """A tiny causal model: position t sees tokens 0..t only, so right padding changes nothing
    before it (as a transformer with an attention mask)."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, 12), nn.Linear(12, vocab)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.out(torch.tanh(self.embed(input_ids).cumsum(1)))


def pad(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run_config(out: Path, name: str, **sections: Any) -> Config:
    base: dict[str, Any] = {
        "EXPERIMENT": {"NAME": name, "SEED": 3},
        "ENV": {"OUTPUT": {"BASE_DIR": str(out)}},
        "TASK": {"NAME": "causal_lm"},
        "TRAIN": {"EPOCHS": 2, "CLIP_GRAD": None},
        "LR_SCHEDULER": {"NAME": "cosine", "BASE_LR": 0.05, "REFERENCE_BS": None, "WARMUP_STEPS": 2},
        "SCHEDULE": {"VALIDATION": {"INTERVAL_EPOCHS": 1}, "METRICS": {"STEP_INTERVAL": 1}},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return load_config(base)


def train_lm(out: Path, name: str, batch: int, accumulation: int) -> Path:
    config = run_config(out, name, DATA={"BATCH_SIZE": batch}, TRAIN={"ACCUMULATION_STEPS": accumulation})
    torch.manual_seed(0)
    Trainer(config, CausalBag(), Sequences(60, 1), Sequences(20, 2), collate_fn=pad).fit()
    return out / name


def test_accumulated_padded_micro_batches_weigh_like_one_batch(tmp_path: Path) -> None:
    split = train_lm(tmp_path, "split", batch=4, accumulation=2)
    whole = train_lm(tmp_path, "whole", batch=8, accumulation=1)
    data = Sequences(60, 1)
    # The data is what makes this a test: sequences of many lengths, so the two micro-batches of a
    # step hold different numbers of tokens and a mean of per-micro-batch means would weigh a token
    # of the short one more than one of the long one.
    counts = [len(data.items[i]) - 1 for i in range(60)]
    assert len(set(counts)) > 5

    a, b = read_metrics(split), read_metrics(whole)
    ta, tb = [r for r in a if "train/loss" in r], [r for r in b if "train/loss" in r]
    assert [r["global_step"] for r in ta] == [r["global_step"] for r in tb] == list(range(1, 17))
    for ra, rb in zip(ta, tb, strict=True):
        assert ra["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5), ra["global_step"]
        assert ra["tokens_seen"] == rb["tokens_seen"]
    wa, wb = (
        load_file(str(split / "final" / "model.safetensors")),
        load_file(str(whole / "final" / "model.safetensors")),
    )
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    # tokens_seen: every target token (every token after a sequence's first), once per epoch.
    assert read_summary(split)["tokens_seen"] == read_summary(whole)["tokens_seen"] == 2 * sum(counts)
    va = [r for r in a if "val/loss" in r]
    assert va[-1]["val/perplexity"] == pytest.approx(torch.tensor(va[-1]["val/loss"]).exp().item())


def test_target_tokens_stops_where_plan_says_mid_epoch(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    train = PackedTokens(torch.randint(1, 16, (8 * 100 + 1,), generator=gen), seq_len=9)  # 100 samples
    val = PackedTokens(torch.randint(1, 16, (8 * 20 + 1,), generator=gen), seq_len=9)
    # 20 batches of 5 per epoch, 2 per step: 10 steps of 80 tokens; two epochs and half of a third.
    target = 80 * 25
    config = run_config(
        tmp_path,
        "tokens",
        DATA={"BATCH_SIZE": 5, "DROP_LAST": True},
        TRAIN={"EPOCHS": None, "TARGET_TOKENS": target, "ACCUMULATION_STEPS": 2},
        SCHEDULE={"CHECKPOINT": {"INTERVAL_EPOCHS": 1, "KEEP_TOP_N": 0, "KEEP_LAST_N": 0}},
    )
    torch.manual_seed(0)
    trainer = Trainer(config, CausalBag(), train, val)
    assert (trainer.plan.total_steps, trainer.plan.epochs, trainer.plan.tokens_per_step) == (25, 3, 80)
    result = trainer.fit()
    out = tmp_path / "tokens"
    assert result["status"] == "completed"
    assert (result["global_step"], result["tokens_seen"]) == (25, target)
    validated = [r["global_step"] for r in read_metrics(out) if "val/loss" in r]
    assert validated == [10, 20, 25]  # each epoch's boundary, and the final one where the target is reached
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_00000010", "step_00000020", "step_00000025"]
    state = json.loads((out / "checkpoints" / "step_00000020" / "trainer_state.json").read_text())
    assert state["progress"]["tokens_seen"] == 20 * 80


def test_throughput_and_mfu_are_counted_in_tokens(tmp_path: Path) -> None:
    peak = 1e9  # ENV.PEAK_FLOPS: on a CPU, MFU is reported only when the peak is given
    config = run_config(
        tmp_path,
        "mfu",
        DATA={"BATCH_SIZE": 8},
        ENV={"PEAK_FLOPS": peak, "OUTPUT": {"BASE_DIR": str(tmp_path)}},
    )
    torch.manual_seed(0)
    model = CausalBag()
    Trainer(config, model, Sequences(60, 1), Sequences(20, 2), collate_fn=pad).fit()
    logged = [r for r in read_metrics(tmp_path / "mfu") if "train/loss" in r]
    flops_per_token = 6 * sum(p.numel() for p in model.parameters())  # causal_lm's default estimate
    for record in logged:
        assert record["perf/tokens_per_s"] > record["perf/samples_per_s"] > 0
        assert record["perf/mfu"] == pytest.approx(record["perf/tokens_per_s"] * flops_per_token / peak)
    # tokens_seen grows by the tokens of each logged step.
    assert logged[-1]["tokens_seen"] == read_summary(tmp_path / "mfu")["tokens_seen"]


# -- classification ----------------------------------------------------------------------------


def test_classification_convnet_learns_digits_above_90_percent(tmp_path: Path) -> None:
    cfg = str(REPO / "configs" / "digits_classification.yaml")
    assert (
        main(["train", "--cfg", cfg, "--opts", "ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.EPOCHS", "6"])
        == 0
    )
    out = tmp_path / "digits_classification"
    result = read_summary(out)
    assert result["status"] == "completed"
    assert result["last_validation"]["val/acc"] > 0.9
    assert result["last_validation"]["val/acc_top5"] >= result["last_validation"]["val/acc"]
    accuracies = {r["global_step"]: r["val/acc"] for r in read_metrics(out) if "val/acc" in r}
    best = max(accuracies, key=lambda step: (accuracies[step], -step))
    # Ranked by accuracy, higher is better (the task's direction, not a name containing "loss").
    assert result["best_metric"] == {"name": "val/acc", "value": accuracies[best], "step": best}


# -- a task of one's own -----------------------------------------------------------------------


class Regression(Task):
    """Mean squared error on (x, y) pairs; the metric ``mae`` is better lower."""

    name = "regression"
    metric_directions: Mapping[str, Direction] = {"loss": "min", "mae": "min"}

    def prepare(self, batch: Any, step: int, epoch: int, batch_index: int, real: Tensor | None) -> Any:
        x, y = batch
        return x, y, torch.ones_like(y) if real is None else real.float()

    def units(self, batch: Any) -> Tensor:
        return batch[2].sum().reshape(1)

    def loss_sums(self, model: nn.Module, batch: Any) -> Tensor:
        x, y, weight = batch
        return ((model(x).squeeze(-1) - y) ** 2 * weight).sum().reshape(1)

    def validation_step(
        self, model: nn.Module, batch: Any, real: Tensor | None, vpass: ValidationPass
    ) -> Tensor:
        x, y, weight = self.prepare(batch, 0, 0, 0, real)
        error = model(x).squeeze(-1) - y
        return torch.stack([(error**2 * weight).sum(), (error.abs() * weight).sum(), weight.sum()]).double()

    def validation_metrics(self, sums: list[float], vpass: ValidationPass) -> dict[str, float]:
        return {f"{vpass.prefix}/loss": sums[0] / sums[2], f"{vpass.prefix}/mae": sums[1] / sums[2]}


def test_a_task_of_ones_own_trains_and_stops_on_its_metric(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100, 3, generator=gen)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(100, generator=gen)
    config = run_config(
        tmp_path,
        "regression",
        TASK={"NAME": "regression"},  # a name for the record; the instance given is what runs
        DATA={"BATCH_SIZE": 16},
        TRAIN={"EPOCHS": 30, "EARLY_STOP": {"ACTIVE": True, "METRIC": "val/mae", "PATIENCE_STEPS": 21}},
        SCHEDULE={"METRICS": {"STEP_INTERVAL": 7}},
    )
    torch.manual_seed(0)
    trainer = Trainer(
        config,
        nn.Linear(3, 1),
        TensorDataset(x[:80], y[:80]),
        TensorDataset(x[80:], y[80:]),
        task=Regression(),
    )
    assert trainer.early_stopping.mode == "min"
    result = trainer.fit()
    maes = [r["val/mae"] for r in read_metrics(tmp_path / "regression") if "val/mae" in r]
    assert maes[-1] < 0.5 * maes[0]
    assert result["best_metric"]["name"] == "val/mae"
    assert result["best_metric"]["value"] == min(maes)
    assert result["status"] in {"completed", "early_stopped"}


# -- resuming a run of one's own ---------------------------------------------------------------


def resume_case(case: str, out: Path) -> tuple[Config, Any, Any, Any, Any]:
    """(config, model factory, training data, validation data, collate) of a user's own run."""
    checkpoints = {"CHECKPOINT": {"INTERVAL_STEPS": 5, "MID_EPOCH": True, "KEEP_LAST_N": 0, "KEEP_TOP_N": 0}}
    if case == "causal_lm":
        config = run_config(out, "run", DATA={"BATCH_SIZE": 4}, SCHEDULE=checkpoints)
        return config, CausalBag, Sequences(60, 1), Sequences(20, 2), pad
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 8, generator=gen), torch.randint(0, 3, (200,), generator=gen)
    config = run_config(
        out, "run", TASK={"NAME": "classification"}, DATA={"BATCH_SIZE": 16}, SCHEDULE=checkpoints
    )
    loader = torch.utils.data.DataLoader(
        TensorDataset(x, y), batch_size=16, shuffle=True
    )  # its own shuffling
    model = lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 3))  # noqa: E731
    return config, model, loader, TensorDataset(x[:50], y[:50]), None


@pytest.mark.parametrize("case", ["classification", "causal_lm"])
def test_resuming_a_users_run_mid_epoch_ends_byte_identical(tmp_path: Path, case: str) -> None:
    """A user's DataLoader with shuffle=True and a model with dropout (classification), or a
    dataset with its own padding collate (causal_lm): resumed in a new directory from the first
    run's checkpoint at step 20, inside epoch 2, the run ends with the uninterrupted run's weights."""
    checkpoint = tmp_path / "whole" / "run" / "checkpoints" / "step_00000020"
    for name, resume in (("whole", None), ("resumed", checkpoint)):
        reset_accelerate()
        config, model, train, val, collate = resume_case(case, tmp_path / name)
        torch.manual_seed(0)
        Trainer(config, model(), train, val, collate_fn=collate).fit(resume_from=resume)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["progress"]["epoch"] == 1
    assert state["progress"]["batches_seen_in_epoch"] > 0
    final = [
        (tmp_path / n / "run" / "final" / "model.safetensors").read_bytes() for n in ("whole", "resumed")
    ]
    assert final[0] == final[1]


# -- what a task needs, checked at construction ------------------------------------------------


class Endless(IterableDataset[dict[str, Tensor]]):
    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        while True:
            yield {"input_ids": torch.ones(4, dtype=torch.long), "labels": torch.ones(4, dtype=torch.long)}


def digits(split: str) -> Any:
    from linnaeus_accel.data.digits import DigitsDataset

    return DigitsDataset(split)  # type: ignore[arg-type]


def packed() -> PackedTokens:
    return PackedTokens(torch.randint(1, 16, (8 * 40 + 1,)), seq_len=9)


class Broken(nn.Module):
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        raise RuntimeError("expected pixels")


# (what is wrong, task, extra config, model, training data, what the error names)
MISMATCHES = [
    ("digits data for a language model", "causal_lm", {}, lambda: CausalBag(), lambda: digits("train"), "'input_ids'"),
    ("tokens for an image classifier", "classification", {}, lambda: nn.Linear(8, 3), packed, "TASK.INPUT_KEY"),
    ("a model without a sequence axis", "causal_lm", {}, lambda: nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.LazyLinear(16)), packed, "[batch, length, vocab]"),
    ("a model that raises", "causal_lm", {}, Broken, packed, "expected pixels"),
    ("a stream without a length", "causal_lm", {}, lambda: CausalBag(), Endless, "__len__"),
    ("no levels for the hierarchical task", "hierarchical", {"SCHEDULE": {}}, lambda: nn.Linear(8, 3), lambda: TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long)), "levels"),
    ("a metric the task never reports", "causal_lm", {"TRAIN": {"EARLY_STOP": {"ACTIVE": True, "METRIC": "val/acc_digit", "PATIENCE_STEPS": 5}}}, lambda: CausalBag(), packed, "TRAIN.EARLY_STOP.METRIC"),
    ("a token target for a task without tokens", "classification", {"TRAIN": {"EPOCHS": None, "TARGET_TOKENS": 1000}}, lambda: nn.Linear(64, 10), lambda: TensorDataset(torch.randn(8, 64), torch.zeros(8, dtype=torch.long)), "TRAIN.TARGET_TOKENS"),
    ("a token target without tokens_per_sample", "causal_lm", {"TRAIN": {"EPOCHS": None, "TARGET_TOKENS": 1000}, "DATA": {"DROP_LAST": True}}, lambda: CausalBag(), lambda: Sequences(16, 0), "tokens_per_sample"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("task", "extra", "model", "data", "named"),
    [pytest.param(*row[1:], id=row[0]) for row in MISMATCHES],
)
def test_a_mismatch_is_one_clear_error_at_construction(
    tmp_path: Path, task: str, extra: dict[str, Any], model: Any, data: Any, named: str
) -> None:
    sections: dict[str, Any] = {"TASK": {"NAME": task}, **extra}
    sections["DATA"] = {"BATCH_SIZE": 4, **extra.get("DATA", {})}
    config = run_config(tmp_path, "mismatch", **sections)
    train = data()
    with pytest.raises(ConfigError) as error:
        Trainer(config, model(), train, None, collate_fn=pad if isinstance(train, Sequences) else None)
    assert named in str(error.value)
    assert "Traceback" not in str(error.value)
    assert not (tmp_path / "mismatch").exists()  # nothing written


def test_readme_python_api_names() -> None:
    import linnaeus_accel

    assert linnaeus_accel.Trainer is Trainer
    assert {"Trainer", "load_config"} <= set(linnaeus_accel.__all__)
    assert STANDARD_PASS.prefix == "val"
