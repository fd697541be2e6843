"""``ResolvedPlan``: every schedule parameter of a run in integer global steps, as ``resolve_plan``
(``plan``) computed it once. Everything downstream (the training loop, ``OpsSchedule``, the reports
of ``plan``) reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .boundaries import Interval
from .callback_steps import CallbackTiming
from .lr import LRCurve
from .ramps import PartialMasking, Ramp

# Steps are ints, but the LR curve and the ramps divide them as floats, exact up to 2**53.
MAX_TOTAL_STEPS = 2**53


@dataclass(frozen=True)
class DataSource:
    """One source of a mixed training dataset, per epoch: what ``plan`` shows (from the dataset's
    ``describe()``; see ``data.mixtures.mixture``)."""

    label: str
    weight: float  # normalised share of the samples
    size: int  # samples the source holds
    samples_per_epoch: int  # samples drawn from it in one epoch of the mixture
    tokens_per_epoch: int | None  # their target tokens, when each sample holds a known number

    @classmethod
    def from_description(cls, row: Any) -> DataSource:
        return cls(
            str(row["label"]),
            float(row["weight"]),
            int(row["size"]),
            int(row["draws_per_epoch"]),
            None if row.get("tokens_per_epoch") is None else int(row["tokens_per_epoch"]),
        )


@dataclass(frozen=True)
class ResolvedPlan:
    world_size: int
    batch_size: int
    accumulation: int
    batches_per_epoch: int | None  # None: a stream without __len__ (epochs end where it ends)
    optimizer_steps_per_epoch: int | None
    epochs: int | None  # None when the epochs' length is unknown
    total_steps: int
    effective_batch_size: int
    lr_scale: float
    lr_curves: tuple[LRCurve, ...]  # [0] is the default group (unmatched parameters)
    group_patterns: tuple[tuple[str, ...], ...]  # MATCH patterns of lr_curves[1:]
    validation: Interval | None
    mask_meta_validation: Interval | None
    partial_mask_meta_validation: Interval | None
    partial_validation_whitelist: tuple[tuple[str, ...], ...]
    exhaustive_combinations: tuple[tuple[str, ...], ...]  # empty when disabled
    checkpoint: Interval | None
    mid_epoch_checkpoints: bool
    mid_epoch_validation: bool
    meta_mask: Ramp
    partial_mask: PartialMasking
    mixup: Ramp
    mixup_group_level: str | None
    metrics_interval: int  # training metrics read from the device (the window's host sync)
    console_interval: int  # a multiple of metrics_interval
    tracker_interval: int  # a multiple of metrics_interval
    lr_interval: int  # any step: the LR needs no device read
    gradnorm_enabled: bool
    gradnorm_warmup_steps: int
    gradnorm_interval: int
    max_steps: int | None
    dataset_size: int | None = None
    target_tokens: int | None = None  # TRAIN.TARGET_TOKENS; None for an EPOCHS or STEPS run
    length_key: str = "TRAIN.EPOCHS"  # the key that set total_steps
    sources: tuple[DataSource, ...] = ()  # a mixture's sources (empty for one dataset)
    callbacks: tuple[CallbackTiming, ...] = ()  # CALLBACKS, in order: when each one's on_step_end runs
    tokens_per_step: int | None = None  # target tokens in one global step, when samples have a fixed count
    total_tokens: int | None = None  # target tokens the whole run trains on (each sample counted once)
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def warmup_steps(self) -> int:
        return self.lr_curves[0].warmup_steps

    def lr(self, step: int, group: int = 0) -> float:
        return self.lr_curves[group](step)

    @property
    def known_epochs(self) -> bool:
        """Whether epochs have a known number of steps (false for a stream without ``__len__``)."""
        return self.optimizer_steps_per_epoch is not None

    def boundary_step(self, epoch: int) -> int:
        """Global step count once ``epoch`` epochs are complete. A STEPS or TARGET_TOKENS run ends
        at ``total_steps``, possibly inside its last epoch: that step is the last (final) boundary."""
        if self.optimizer_steps_per_epoch is None:
            raise ValueError("epochs of a stream without __len__ have no known boundary steps")
        return min(epoch * self.optimizer_steps_per_epoch, self.total_steps)

    @property
    def last_epoch_steps(self) -> int:
        """Optimizer steps the last epoch runs (``optimizer_steps_per_epoch`` unless it is partial)."""
        assert self.epochs is not None
        return self.total_steps - self.boundary_step(self.epochs - 1)
