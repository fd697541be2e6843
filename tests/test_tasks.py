"""The built-in tasks on single micro-batches (a task is tested on a micro-batch, without a run).

Each task's summed losses and unit counts against hand computations; even-batch repeats (rows
outside ``real``) weigh nothing anywhere; validation sums turn into the documented metrics; the
checks that turn a mismatched batch or model into one clear message.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.configs import DEFAULT_CONFIG
from torch import Tensor, nn

from linnaeus_accel.config import load_config
from linnaeus_accel.progress import TrainingStage
from linnaeus_accel.schedule import resolve_plan
from linnaeus_accel.tasks import STANDARD_PASS, TaskContext, ValidationPass, build_task
from linnaeus_accel.tasks.causal_lm import CausalLMTask
from linnaeus_accel.tasks.classification import ClassificationTask
from linnaeus_accel.tasks.hierarchical import HierarchicalTask, level_loss_sums

# -- hierarchical ------------------------------------------------------------------------------

# (labels, classes per level); logits are drawn from a fixed seed.
LEVEL_CASES = [
    ([[0, 1], [2, 0], [1, 1]], (3, 2)),  # every label present
    ([[0, -1], [2, 0], [1, -1]], (3, 2)),  # null at level 1: summed over the one labelled row
    ([[-1, 1], [-1, 0], [-1, 1]], (3, 2)),  # level 0 all null: sums to 0 over 0 units
    ([[-100, 1], [2, -7], [1, 0]], (3, 2)),  # any negative label is null, -100 included
    ([[4], [0], [3], [3]], (5,)),  # a single level
]


@pytest.mark.parametrize(("labels", "classes"), LEVEL_CASES)
def test_level_loss_sums_and_units_match_hand_computation(
    labels: list[list[int]], classes: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(len(labels) * 10 + len(classes))
    lab = torch.tensor(labels)
    logits = [torch.randn(len(labels), c, generator=gen, requires_grad=True) for c in classes]
    sums = level_loss_sums(logits, lab)
    for i, lg in enumerate(logits):
        keep = lab[:, i] >= 0
        want = F.cross_entropy(lg[keep], lab[keep, i], reduction="sum") if keep.any() else torch.tensor(0.0)
        torch.testing.assert_close(sums[i], want)
    task = HierarchicalTask()
    assert task.units({"labels": lab}).tolist() == (lab >= 0).sum(0).tolist()
    sums.sum().backward()
    assert all(torch.isfinite(lg.grad).all() for lg in logits if lg.grad is not None)


def digits_context(opts: list[str] | None = None) -> TaskContext:
    from linnaeus_accel.data.digits import DigitsDataset

    config = load_config(DEFAULT_CONFIG, opts or [])
    dataset = DigitsDataset("train")
    plan = resolve_plan(config, 45, 1, len(dataset))
    return TaskContext(config, plan, dataset, 0, 1, torch.device("cpu"))


def test_hierarchical_repeats_get_no_label_and_never_mix() -> None:
    from torch.utils.data import DataLoader

    context = digits_context()
    task = HierarchicalTask()
    task.bind(context)
    batch = next(iter(DataLoader(context.dataset, batch_size=8)))
    real = torch.arange(8) < 5
    out = task.prepare(batch, 0, 1, 0, real)  # step 0: mixup probability 1
    assert (out["labels"][5:] == -1).all()
    assert torch.equal(out["labels"][:5], batch["labels"][:5])
    assert task.units(out).tolist() == [5, 5]
    # Each real sample got the partner it gets without the repeats present.
    alone = task.prepare(
        {k: (v[:5] if k != "meta" else {c: x[:5] for c, x in v.items()}) for k, v in batch.items()},
        0,
        1,
        0,
        None,
    )
    torch.testing.assert_close(out["image"][:5], alone["image"])


def test_hierarchical_validation_counts_real_samples_once() -> None:
    from torch.utils.data import DataLoader

    context = digits_context()
    task = HierarchicalTask()
    task.bind(context)
    torch.manual_seed(0)
    model = nn.Sequential()  # replaced below: a fixed two-head model on flattened images

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shape, self.digit = nn.Linear(64, 3), nn.Linear(64, 10)

        def forward(self, batch: dict[str, Any]) -> list[Tensor]:
            x = batch["image"].flatten(1)
            return [self.shape(x), self.digit(x)]

    model = Heads()
    batch = next(iter(DataLoader(context.dataset, batch_size=6)))
    full = task.validation_metrics(
        task.validation_step(model, batch, None, STANDARD_PASS).tolist(), STANDARD_PASS
    )
    # The same 4 samples followed by 2 repeats of the first two: the repeats change nothing.
    padded = {
        k: (
            torch.cat([v[:4], v[:2]]) if k != "meta" else {c: torch.cat([x[:4], x[:2]]) for c, x in v.items()}
        )
        for k, v in batch.items()
    }
    first4 = {k: (v[:4] if k != "meta" else {c: x[:4] for c, x in v.items()}) for k, v in batch.items()}
    real = torch.arange(6) < 4
    got = task.validation_metrics(
        task.validation_step(model, padded, real, STANDARD_PASS).tolist(), STANDARD_PASS
    )
    want = task.validation_metrics(
        task.validation_step(model, first4, None, STANDARD_PASS).tolist(), STANDARD_PASS
    )
    assert got == pytest.approx(want)
    assert set(full) == {
        "val/loss",
        "val/chain_acc",
        "val/partial_chain_acc",
        "val/acc_shape",
        "val/acc_digit",
        "val/acc3_shape",
        "val/acc3_digit",
    }


def test_hierarchical_dataset_without_levels_is_named() -> None:
    context = digits_context()
    task = HierarchicalTask()
    task.bind(TaskContext(context.config, context.plan, [1, 2, 3], 0, 1, torch.device("cpu")))
    problem = task.dataset_problem()
    assert problem is not None
    assert "levels" in problem
    assert "classification" in problem


# -- classification --------------------------------------------------------------------------


def classification() -> ClassificationTask:
    return ClassificationTask(input_key="x")


def test_classification_sums_over_labelled_real_samples() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 7)
    x, y = torch.randn(6, 4), torch.tensor([0, 6, 3, -100, 2, 2])
    task = classification()
    batch = task.prepare({"x": x, "labels": y}, 0, 1, 0, torch.arange(6) < 5)  # the last row repeats
    assert task.units(batch).tolist() == [4]  # 6 rows - 1 ignored - 1 repeat
    keep = torch.tensor([True, True, True, False, True, False])
    want = F.cross_entropy(model(x)[keep], y[keep], reduction="sum")
    torch.testing.assert_close(task.loss_sums(model, batch), want.reshape(1))


def test_classification_takes_pairs_and_label_smoothing() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    task = ClassificationTask(label_smoothing=0.1)
    want = F.cross_entropy(model(x), y, reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(task.loss_sums(model, (x, y)), want.reshape(1))


def test_classification_metrics_top1_and_top5_only_above_five_classes() -> None:
    logits = torch.tensor([[9.0, 8, 7, 6, 5, 4, 0], [0.0, 1, 2, 3, 4, 5, 9], [5.0, 0, 0, 0, 0, 0, 0]])
    labels = torch.tensor([0, 1, 5])  # top-1 right; in the top 5; not in the top 5
    task = ClassificationTask(input_key="x")
    sums = task.validation_step(lambda _: logits, {"x": None, "labels": labels}, None, STANDARD_PASS)  # type: ignore[arg-type]
    metrics = task.validation_metrics(sums.tolist(), STANDARD_PASS)
    assert metrics["val/acc"] == pytest.approx(1 / 3)
    assert metrics["val/acc_top5"] == pytest.approx(2 / 3)
    assert metrics["val/loss"] == pytest.approx(F.cross_entropy(logits, labels).item())
    sums = task.validation_step(
        lambda _: logits[:, :3], {"x": None, "labels": torch.tensor([0, 2, 0])}, None, STANDARD_PASS
    )  # type: ignore[arg-type]
    assert "val/acc_top5" not in task.validation_metrics(sums.tolist(), STANDARD_PASS)


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ({"image": torch.zeros(2, 4)}, "'labels'"),  # no labels key
        (
            {"pixels": torch.zeros(2, 4), "labels": torch.zeros(2, dtype=torch.long)},
            "TASK.INPUT_KEY",
        ),  # another input key
        (
            {"image": torch.zeros(2, 4), "labels": torch.zeros(2, 3, dtype=torch.long)},
            "one integer label",
        ),  # 2-D labels
        ({"image": torch.zeros(2, 4), "labels": torch.zeros(2)}, "one integer label"),  # float labels
        (torch.zeros(2, 4), "dict batches or (input, label) pairs"),  # a bare tensor
    ],
)
def test_classification_names_what_a_batch_lacks(batch: Any, expected: str) -> None:
    problem = ClassificationTask().batch_problem(batch)
    assert problem is not None
    assert expected in problem


# -- causal_lm -----------------------------------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.out(torch.tanh(self.embed(input_ids).cumsum(1)))


def lm_batch() -> dict[str, Tensor]:
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0], [9, 1, 2, 3, 0]])
    labels = ids.masked_fill(ids == 0, -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": (ids != 0).long()}


def test_causal_lm_counts_shifted_targets_and_sums_their_loss() -> None:
    torch.manual_seed(0)
    model, batch, task = TinyLM(), lm_batch(), CausalLMTask()
    assert task.units(batch).tolist() == [4 + 2 + 3]  # labels after the first position, not -100
    logits = model(batch["input_ids"])[:, :-1]
    targets = batch["labels"][:, 1:]
    want = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(task.loss_sums(model, batch), want.reshape(1))
    # An even-batch repeat of the first row adds nothing.
    padded = {k: torch.cat([v, v[:1]]) for k, v in batch.items()}
    padded = task.prepare(padded, 0, 1, 0, torch.arange(4) < 3)
    assert task.units(padded).tolist() == [9]
    torch.testing.assert_close(task.loss_sums(model, padded), want.reshape(1))


def test_causal_lm_accepts_model_outputs_with_logits() -> None:
    class WithOutput(TinyLM):
        def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Any:  # type: ignore[override]
            return type("Out", (), {"logits": super().forward(input_ids)})()

    torch.manual_seed(0)
    plain = TinyLM()
    wrapped = WithOutput()
    wrapped.load_state_dict(plain.state_dict())
    task = CausalLMTask()
    torch.testing.assert_close(task.loss_sums(wrapped, lm_batch()), task.loss_sums(plain, lm_batch()))


def test_causal_lm_validation_is_loss_and_perplexity_over_every_token() -> None:
    torch.manual_seed(0)
    model, batch, task = TinyLM(), lm_batch(), CausalLMTask()
    sums = task.validation_step(model, batch, None, STANDARD_PASS)
    metrics = task.validation_metrics(sums.tolist(), STANDARD_PASS)
    mean = task.loss_sums(model, batch).item() / 9
    assert metrics["val/loss"] == pytest.approx(mean)
    assert metrics["val/perplexity"] == pytest.approx(math.exp(mean))


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, "'labels'"),  # no labels
        ({"text": ["a"]}, "'input_ids'"),  # raw text
        (
            {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 3, dtype=torch.long)},
            "[batch, length]",
        ),
    ],
)
def test_causal_lm_names_what_a_batch_lacks(batch: Any, expected: str) -> None:
    problem = CausalLMTask().batch_problem(batch)
    assert problem is not None
    assert expected in problem


def test_causal_lm_names_a_model_without_logits() -> None:
    task, batch = CausalLMTask(), lm_batch()
    assert "logits" in (task.output_problem("text", batch) or "")
    assert "[batch, length, vocab]" in (task.output_problem(torch.zeros(3, 11), batch) or "")
    assert task.output_problem(torch.zeros(3, 5, 11), batch) is None


# -- every task ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "metric", "direction"),
    [
        ("hierarchical", "val/loss", "min"),
        ("classification", "val/acc", "max"),  # higher is better although it is not a loss
        ("classification", "val/acc_top5", "max"),
        ("causal_lm", "val/perplexity", "min"),  # lower is better although the name has no "loss"
        ("causal_lm", "val/acc", None),  # not a metric of this task
    ],
)
def test_metric_directions_come_from_the_task(name: str, metric: str, direction: str | None) -> None:
    task = build_task(load_config(None, ["TASK.NAME", name]).TASK)
    assert task.direction(metric) == direction


def test_non_hierarchical_tasks_refuse_metadata_schedules() -> None:
    config = load_config(DEFAULT_CONFIG, ["TASK.NAME", "classification"])
    keys = [key for key, _ in build_task(config.TASK).config_problems(config)]
    assert "SCHEDULE.META_MASKING.ENABLED" in keys
    assert "SCHEDULE.MIXUP.PROB.ENABLED" in keys
    assert "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION" in keys


def test_unknown_task_name_lists_the_known_ones() -> None:
    from linnaeus_accel.config import ConfigError

    with pytest.raises(ConfigError, match="causal_lm, classification, hierarchical"):
        build_task(load_config(None, ["TASK.NAME", "segmentation"]).TASK)


def test_validation_pass_default_is_the_standard_pass() -> None:
    assert STANDARD_PASS == ValidationPass(TrainingStage.VALIDATION_NORMAL, "val")
