"""What the plan's reports (the summary, ``plan --json``, the schedule plot) show beyond the
``ResolvedPlan``: the few settings that ``resolve_plan`` does not turn into steps, read from the
config once, where it is at hand (``report_settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...config import Config
from ...config.optimizer import OptimizerConfig
from ...config.schedule import ScheduleConfig
from ...config.sections import TrainConfig


@dataclass(frozen=True)
class ReportSettings:
    experiment: str  # EXPERIMENT.NAME
    output_dir: Path  # <ENV.OUTPUT.BASE_DIR>/<EXPERIMENT.NAME>
    trackers: tuple[str, ...]  # EXPERIMENT.trackers
    reference_bs: int | None  # LR_SCHEDULER.REFERENCE_BS: the LR scale's divisor (None: no scaling)
    base_lr: float  # LR_SCHEDULER.BASE_LR: with OPTIMIZER.NAME muon, the AdamW side's peak before scaling
    optimizer: OptimizerConfig  # what `plan` describes when no optimizer is given to the Trainer
    train: TrainConfig  # loss spikes, rollbacks, early stopping
    schedule: ScheduleConfig  # the validation budget, the checkpoints kept, the logging intervals asked for
    val_batch_size: int  # DATA.BATCH_SIZE_VAL, by default DATA.BATCH_SIZE
    document_masking: bool  # TASK.DOCUMENT_MASKING
    loss_chunk_tokens: int  # TASK.LOSS_CHUNK_TOKENS (0: off)


def report_settings(config: Config) -> ReportSettings:
    return ReportSettings(
        experiment=config.EXPERIMENT.NAME,
        output_dir=config.output_dir,
        trackers=config.EXPERIMENT.trackers,
        reference_bs=config.LR_SCHEDULER.REFERENCE_BS,
        base_lr=config.LR_SCHEDULER.BASE_LR,
        optimizer=config.OPTIMIZER,
        train=config.TRAIN,
        schedule=config.SCHEDULE,
        val_batch_size=config.DATA.BATCH_SIZE_VAL or config.DATA.BATCH_SIZE,
        document_masking=config.TASK.DOCUMENT_MASKING,
        loss_chunk_tokens=config.TASK.LOSS_CHUNK_TOKENS,
    )
