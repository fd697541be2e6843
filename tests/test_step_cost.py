"""What one optimizer step costs and computes, against a hand-written Accelerate loop on the same
micro-batches (real Accelerate, world size 1, CPU).

- A level with no label in a batch (every label negative, any negative value) adds 0 to the step's
  loss, never NaN, and the weights follow a plainly written per-level mean cross-entropy loop.
- A step runs no more tensor ops than the hand-written loop that computes the same loss and keeps
  the same metric window on the device.
- Accelerate's optimizer wrapper is stepped through only where it has work to do (a loss scaler,
  DeepSpeed): elsewhere the optimizer inside it is stepped, with the same weights.
- The loop's per-step arithmetic (real samples of a window, batches without repeats) agrees with
  the per-batch definitions it replaces.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from accelerate.optimizer import AcceleratedOptimizer
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset

from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.sampling import real_in_batch, samples_in_global_batch
from linnaeus_accel.models import build_model
from linnaeus_accel.training.step.batches import full_batches, samples_in_window
from linnaeus_accel.training.step.micro_batch import MicroBatch
from linnaeus_accel.training.step.optimizer_step import direct_optimizer
from linnaeus_accel.training.trainer import Trainer

NO_TRANSFORMS = [  # masking and mixup change the inputs, not what a step costs or computes
    "SCHEDULE.META_MASKING.ENABLED",
    "false",
    "SCHEDULE.META_MASKING.PARTIAL.ENABLED",
    "false",
    "SCHEDULE.MIXUP.PROB.ENABLED",
    "false",
]


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


class ShapeUnlabelled(Dataset[dict[str, Any]]):
    """The digits with no ``shape`` label anywhere (-7: any negative label is missing) and no
    ``digit`` label on every third sample (-1)."""

    def __init__(self, digits: Any) -> None:
        self.digits = digits
        self.levels, self.num_classes = digits.levels, digits.num_classes
        self.meta_components = digits.meta_components

    def __len__(self) -> int:
        return len(self.digits)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = dict(self.digits[i])
        labels = item["labels"].clone()
        labels[0] = -7
        if i % 3 == 0:
            labels[1] = -1
        item["labels"] = labels
        return item


def trainer_on(tmp_path: Path, data: Any = None, opts: list[str] | None = None) -> Trainer:
    config = load_config(
        DEFAULT_CONFIG,
        ["ENV.OUTPUT.BASE_DIR", str(tmp_path), *NO_TRANSFORMS, *(opts or [])],
    )
    train = data if data is not None else build_dataset(config, "train")
    torch.manual_seed(0)
    return Trainer(config, build_model(config, train), train)


def epoch_windows(trainer: Trainer, epoch: int = 1) -> list[list[MicroBatch]]:
    trainer.train_batches.set_epoch(epoch)
    return list(trainer.train_batches.windows(0, trainer.plan.accumulation))


class HandLoop:
    """The Trainer's loss written plainly for one micro-batch per step: per level, the mean
    cross-entropy over the samples labelled there (0 where none is), added up; AdamW, clipping and
    the LR as the Trainer sets them; the per-level losses added up on the device."""

    def __init__(self, trainer: Trainer, masked_select: bool) -> None:
        self.trainer = trainer
        self.model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.0, weight_decay=0.0)
        self.parameters = list(self.model.parameters())
        self.masked_select = masked_select  # boolean indexing (a host read): the plainest reference
        self.window = torch.zeros(2)

    def losses(self, batch: dict[str, Any]) -> Tensor:
        labels, logits = batch["labels"], self.model(batch)
        if self.masked_select:
            levels = []
            for i, lg in enumerate(logits):
                known = labels[:, i] >= 0
                levels.append(F.cross_entropy(lg[known], labels[known, i]) if known.any() else lg.sum() * 0)
            return torch.stack(levels)
        targets = labels.clamp_min(-1)
        sums = torch.stack(
            [
                F.cross_entropy(lg, targets[:, i], ignore_index=-1, reduction="sum")
                for i, lg in enumerate(logits)
            ]
        )
        return sums / (labels >= 0).sum(0).clamp_min(1)

    def step(self, window: list[MicroBatch], k: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.trainer.plan.lr(k, 0)
        (batch,) = window
        losses = self.losses(batch.data)
        self.trainer.accelerator.backward(losses.sum())
        self.window += losses.detach()
        self.trainer.accelerator.clip_grad_norm_(self.parameters, self.trainer.config.TRAIN.CLIP_GRAD)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def weights_of(model: torch.nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_level_without_labels_adds_nothing_and_the_weights_follow_a_plain_loop(tmp_path: Path) -> None:
    config = load_config(DEFAULT_CONFIG, [])
    trainer = trainer_on(tmp_path, ShapeUnlabelled(build_dataset(config, "train")))
    hand = HandLoop(trainer, masked_select=True)
    start = weights_of(hand.model)
    windows = epoch_windows(trainer)
    for k, window in enumerate(windows):
        trainer.step.run(window, k, 1)
        hand.step(window, k)
    metrics = trainer.meter.flush(0, 0, {"default": 0.0})
    assert metrics["train/loss_shape"] == 0.0  # not NaN: no batch has a labelled sample there
    assert metrics["train/loss"] == metrics["train/loss_digit"] > 0
    assert metrics["train/loss_digit"] == pytest.approx(hand.window[1].item() / len(windows), rel=1e-5)
    ours = weights_of(trainer.accelerator.unwrap_model(trainer.model))
    for name, value in weights_of(hand.model).items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # A level without labels sends no gradient: its head is where it started, the rest learned.
    assert torch.equal(ours["heads.0.weight"], start["heads.0.weight"])
    assert not torch.equal(ours["heads.1.weight"], start["heads.1.weight"])


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_step_runs_no_more_tensor_ops_than_a_hand_written_loop(tmp_path: Path) -> None:
    trainer = trainer_on(tmp_path)
    hand = HandLoop(trainer, masked_select=False)
    windows = epoch_windows(trainer)
    for k in range(3):  # the optimizers' state exists from here on
        trainer.step.run(windows[k], k, 1)
        hand.step(windows[k], k)
    ours, theirs = Ops(), Ops()
    with ours:
        trainer.step.run(windows[3], 3, 1)
    with theirs:
        hand.step(windows[3], 3)
    assert 150 < theirs.count  # forward, backward, clipping and AdamW of a 4-layer MLP: counted
    assert ours.count <= theirs.count, (ours.count, theirs.count)
    # The same loss, bit for bit: the weights are equal after the same steps.
    ours_weights = weights_of(trainer.accelerator.unwrap_model(trainer.model))
    assert all(torch.equal(ours_weights[n], v) for n, v in weights_of(hand.model).items())


def test_the_optimizer_inside_accelerates_plain_wrapper_is_stepped_with_the_same_weights(
    tmp_path: Path,
) -> None:
    direct = trainer_on(tmp_path / "direct")
    assert direct.step.stepped is direct.optimizer.optimizer
    reset_accelerate()
    wrapped = trainer_on(tmp_path / "wrapped")
    wrapped.step.stepped = wrapped.optimizer  # as Accelerate's loop would step it
    for trainer in (direct, wrapped):
        for k, window in enumerate(epoch_windows(trainer)[:10]):
            trainer.step.run(window, k, 1)
    a = weights_of(direct.accelerator.unwrap_model(direct.model))
    b = weights_of(wrapped.accelerator.unwrap_model(wrapped.model))
    assert all(torch.equal(a[n], b[n]) for n in a)

    # Where the wrapper has work to do, it is kept: a loss scaler steps through it (fp16), and
    # DeepSpeed's wrapper (a subclass) steps inside backward.
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scaled = AcceleratedOptimizer(sgd, device_placement=False, scaler=torch.amp.GradScaler("cpu"))
    assert direct_optimizer(scaled, direct.accelerator) is None
    assert direct_optimizer(DeepSpeedOptimizerWrapper(sgd), direct.accelerator) is None
    assert direct_optimizer(sgd, direct.accelerator) is None  # not prepared by Accelerate


@pytest.mark.parametrize("drop_last", [False, True])
def test_window_arithmetic_matches_the_per_batch_definitions(drop_last: bool) -> None:
    for size in range(0, 60):
        for batch_size in (1, 3, 8):
            for world in (1, 2, 3):
                for rank in range(world):
                    full = full_batches(size, batch_size, world, rank)
                    for index in range(20):  # full exactly below the bound
                        assert (real_in_batch(size, batch_size, world, index, rank) >= batch_size) == (
                            index < full
                        )
                for first in range(8):
                    for n in (1, 2, 3):
                        window = [MicroBatch(p, None, None) for p in range(first, first + n)]
                        want = sum(
                            samples_in_global_batch(size, batch_size, world, p, drop_last)
                            for p in range(first, first + n)
                        )
                        assert samples_in_window(window, size, batch_size, world, drop_last) == want


def test_the_metric_window_adds_up_every_step_in_order_and_names_the_first_bad_one() -> None:
    """Steps are held as their own tensors and stacked every ``window`` steps (here 3, so a window
    of 7 steps is read from two stacks and a remainder): the sums are float32 running sums from the
    carried-over part, as a device-side running sum would give, and a NaN is named by its step."""
    from accelerate import Accelerator

    from linnaeus_accel.training.metrics.meter import NonFiniteLoss, TrainMeter

    meter = TrainMeter(Accelerator(cpu=True), ("a", "b"), window=3)
    meter.load_state_dict({"sums": [0.1, 0.7, 0.3], "steps": 2})  # a resumed window's first part
    gen = torch.Generator().manual_seed(0)
    steps = [torch.rand(2, generator=gen) * 10 ** float(i % 4) for i in range(7)]
    running = torch.tensor([0.1, 0.7, 0.3])
    for losses in steps:
        meter.add_step(losses.sum(), losses)
        running += torch.cat([losses.sum()[None], losses])
    metrics = meter.flush(0, 0, {})
    assert [metrics["train/loss"], metrics["train/loss_a"], metrics["train/loss_b"]] == [
        v / 9 for v in running.tolist()
    ]
    for i in range(7):
        if i == 4:
            meter.add_step(torch.tensor(float("nan")), torch.tensor([float("nan"), 0.0]))
        elif i == 5:
            meter.skip_step()
        else:
            meter.add_step(torch.tensor(1.0), torch.tensor([0.5, 0.5]))
    assert not meter.window_is_finite()
    with pytest.raises(NonFiniteLoss) as bad:
        meter.flush(0, 0, {})
    assert bad.value.steps_ago == 2  # steps 5 (NaN), 6 (skipped), 7: the NaN is two before the last
