"""How long a run is (docs/semantics.md §1, §7): ``T`` from ``TRAIN.EPOCHS``, ``TRAIN.STEPS`` or
``TRAIN.TARGET_TOKENS``, the epochs it spans (None when a stream's epochs have no known length),
and the target tokens it trains on; every way a config and its data cannot give a run of that
length is a ``ConfigError`` naming the key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from pydantic import BaseModel

from ..config import ConfigError
from ..config.base import timed_parameters
from ..config.callbacks import CallbackConfig
from ..config.lr import LRSchedulerConfig
from ..config.schedule import ScheduleConfig
from ..config.sections import DataConfig, TrainConfig
from .steps import ceil_div, optimizer_steps_per_epoch


class RunLength(NamedTuple):
    total_steps: int
    epochs: int | None  # None: epochs of unknown length
    tokens_per_step: int | None  # target tokens of a full global step, when samples have a fixed count
    total_tokens: int | None  # target tokens of the whole run, when known exactly


def run_length(
    train: TrainConfig,
    data: DataConfig,
    batches_per_epoch: int | None,
    world_size: int,
    dataset_size: int | None,
    tokens_per_sample: int | None,
) -> RunLength:
    """docs/semantics.md §1, §7: T from TRAIN.EPOCHS (T = steps per epoch x EPOCHS), TRAIN.STEPS (T = STEPS)
    or TRAIN.TARGET_TOKENS (T = ceil(TARGET_TOKENS / tokens per step)); the last two end where T
    falls, possibly inside an epoch."""
    accum = train.accumulation
    ope = None if batches_per_epoch is None else optimizer_steps_per_epoch(batches_per_epoch, accum)
    per_step = None
    if tokens_per_sample is not None:
        per_step = data.BATCH_SIZE * world_size * accum * tokens_per_sample
    if train.TARGET_TOKENS is not None:
        total, per_step = _steps_for_target_tokens(
            train, data, batches_per_epoch, world_size, dataset_size, tokens_per_sample
        )
        return RunLength(total, _epochs_for(total, ope), per_step, total * per_step)
    if train.STEPS is not None:
        total = train.STEPS
        epochs = _epochs_for(total, ope)
        tokens = None
        if per_step is not None and epochs is not None and batches_per_epoch is not None:
            epoch_tokens = _epoch_tokens(data, batches_per_epoch, world_size, dataset_size, tokens_per_sample)
            if epoch_tokens is not None:
                assert ope is not None
                # The last epoch's steps before its end hold full batches only (a padded batch or a
                # short window is an epoch's last step).
                last = total - (epochs - 1) * ope
                tokens = (epochs - 1) * epoch_tokens + (epoch_tokens if last == ope else last * per_step)
        return RunLength(total, epochs, per_step, tokens)
    epochs = train.epochs
    # An EPOCHS run of a stream without __len__ was refused by the caller (epoch_unit_keys).
    assert epochs is not None
    assert ope is not None
    assert batches_per_epoch is not None
    epoch_tokens = _epoch_tokens(data, batches_per_epoch, world_size, dataset_size, tokens_per_sample)
    return RunLength(ope * epochs, epochs, per_step, None if epoch_tokens is None else epoch_tokens * epochs)


def _epochs_for(total: int, steps_per_epoch: int | None) -> int | None:
    return None if steps_per_epoch is None else ceil_div(total, steps_per_epoch)  # the last may be partial


def epoch_unit_keys(
    train: TrainConfig,
    schedule: ScheduleConfig,
    lr_scheduler: LRSchedulerConfig,
    callbacks: Sequence[CallbackConfig],
) -> list[str]:
    """Every key that gives a time in epochs (``TRAIN.EPOCHS`` when the run's length is in epochs):
    what a stream without ``__len__`` cannot resolve."""
    keys = ["TRAIN.EPOCHS"] if train.epochs is not None else []

    def walk(model: BaseModel, prefix: str) -> None:
        timed = timed_parameters(type(model)).values()
        in_epochs = {spec.keys["epochs"] for spec in timed if "epochs" in spec.values(model)}
        for name in type(model).model_fields:
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")
            elif name in in_epochs:
                keys.append(f"{prefix}{name}")
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, BaseModel):
                        walk(item, f"{prefix}{name}.{i}.")

    walk(schedule, "SCHEDULE.")
    walk(lr_scheduler, "LR_SCHEDULER.")
    for i, entry in enumerate(callbacks):
        walk(entry, f"CALLBACKS.{i}.")
    return keys


def _steps_for_target_tokens(
    train: TrainConfig,
    data: DataConfig,
    batches_per_epoch: int | None,
    world_size: int,
    dataset_size: int | None,
    tokens_per_sample: int | None,
) -> tuple[int, int]:
    """docs/semantics.md §1: (T, tokens per step) of a TARGET_TOKENS run, T = ceil(TARGET_TOKENS / tokens per
    step). That is exact only when every global step holds the same number of target tokens; every
    way this data and config break that is reported at once."""
    key = "TRAIN.TARGET_TOKENS"
    problems: list[tuple[str, str]] = []
    if tokens_per_sample is None:
        problems.append(
            (
                key,
                "needs a training dataset that declares `tokens_per_sample` (every sample holds the same "
                "number of target tokens: packed fixed-length sequences, e.g. linnaeus_accel.data.PackedTokens); "
                "this one does not, so use TRAIN.EPOCHS or TRAIN.STEPS instead (`linnaeus-accel plan` takes "
                "the count as --tokens-per-sample N)",
            )
        )
    elif tokens_per_sample < 1:
        problems.append(
            (key, f"the training dataset declares tokens_per_sample = {tokens_per_sample}; it must be >= 1")
        )
    batch, accum = data.BATCH_SIZE, train.accumulation
    global_batch = batch * world_size
    procs = f"{world_size} process{'es' if world_size > 1 else ''}"
    if batches_per_epoch is None:
        if not data.DROP_LAST:
            problems.append(
                (
                    key,
                    "needs every global step to hold the same number of samples, but a stream without "
                    "__len__ ends each pass with a part-filled step: set DATA.DROP_LAST: true (each pass "
                    "then ends at its last full optimizer step), or use TRAIN.STEPS",
                )
            )
    elif not data.DROP_LAST:
        if dataset_size is None:
            problems.append(
                (
                    key,
                    "needs the training dataset size to check that every global step holds the same number "
                    "of samples: give the dataset size (`plan --dataset-size N`), or set DATA.DROP_LAST: true",
                )
            )
        elif dataset_size % global_batch:
            problems.append(
                (
                    key,
                    f"needs every global step to hold the same number of samples, but {dataset_size} samples "
                    f"in batches of {batch} x {procs} leave a last global batch of {dataset_size % global_batch} "
                    f"of {global_batch}: set DATA.DROP_LAST: true (or use a dataset size that is a multiple of {global_batch})",
                )
            )
    if batches_per_epoch is not None and batches_per_epoch % accum:
        problems.append(
            (
                key,
                f"needs every optimizer step to accumulate the same number of batches, but "
                f"{batches_per_epoch} batches per process per epoch with TRAIN.ACCUMULATION_STEPS {accum} "
                f"leave a last window of {batches_per_epoch % accum} (a smaller step): set "
                f"TRAIN.ACCUMULATION_STEPS to one dividing the {batches_per_epoch} batches per process "
                f"({_nearest_divisors(batches_per_epoch, accum)})",
            )
        )
    if problems or tokens_per_sample is None or train.TARGET_TOKENS is None:
        raise ConfigError(problems, source="plan")
    per_step = data.BATCH_SIZE * world_size * accum * tokens_per_sample
    return ceil_div(train.TARGET_TOKENS, per_step), per_step


def _nearest_divisors(n: int, near: int) -> str:
    """The divisors of ``n`` next to ``near``, for the error text: 'e.g. 3 or 5'."""
    divisors = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted({*divisors, *(n // d for d in divisors)})
    below = max(d for d in divisors if d < near)  # 1 always divides
    above = [d for d in divisors if d > near]
    return f"e.g. {below}" + (f" or {above[0]}" if above else "")


def _epoch_tokens(
    data: DataConfig,
    batches_per_epoch: int,
    world_size: int,
    dataset_size: int | None,
    tokens_per_sample: int | None,
) -> int | None:
    """Target tokens of one epoch of an EPOCHS run, each sample counted once (a padded last batch
    repeats samples that are not counted again); None when unknown."""
    if tokens_per_sample is None:
        return None
    if data.DROP_LAST:
        return batches_per_epoch * data.BATCH_SIZE * world_size * tokens_per_sample
    return None if dataset_size is None else dataset_size * tokens_per_sample
