"""What a run that goes wrong needs, registered as a user's training script would
(tests/test_rollback.py; ``tests/rollback_script.py`` is that script):

- the dataset ``poisoned_digits``: the digits of ``digits`` with the pixels of the samples listed in
  ``DATA.DATASET.OPTIONS.nan_at`` made NaN, so the window that trains on one has a NaN loss;
- the callback ``blow_up``: after each optimizer step listed in ``OPTIONS.steps`` it multiplies
  every weight by ``OPTIONS.factor`` (what a huge LR for a few steps does), so the loss spikes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.data.digits import DigitsDataset
from linnaeus_accel.data.registry import register_dataset

# Two epochs of 12 steps of 128 digits in their own order (no shuffle): sample 773 (NaN pixels) is
# in step 7's batch of each epoch (steps 7 and 19). Metric records every 2 steps, checkpoints every 4
# (mid-epoch), the newest one kept (retention must keep the one a rollback needs); one more step's
# data skipped past each bad window.
NAN_RUN = [
    "TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "128", "DATA.SHUFFLE", "false",
    "SCHEDULE.METRICS.STEP_INTERVAL", "2",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null", "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "4",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "1", "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0",
    "SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED", "false",
    "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false",
    "DATA.DATASET.NAME", "poisoned_digits", "DATA.DATASET.OPTIONS", "{nan_at: [773]}",
    "TRAIN.NONFINITE", "rollback", "TRAIN.ROLLBACK.SKIP_STEPS", "1",
]  # fmt: skip


class PoisonedDigits(DigitsDataset):
    def __init__(self, split: Any, val_fraction: float, nan_at: list[int]) -> None:
        super().__init__(split, val_fraction)
        for i in nan_at if split == "train" else []:
            self.images[i] = float("nan")


@register_dataset("poisoned_digits")
def build_poisoned(config: Any, split: Any) -> Dataset[Any]:
    nan_at = list(config.DATA.DATASET.OPTIONS.get("nan_at", []))
    return PoisonedDigits(split, config.DATA.DATASET.VAL_FRACTION, nan_at)


@register_callback("blow_up")
class BlowUp(Callback):
    def __init__(self, steps: list[int], factor: float = 30.0) -> None:
        self.steps, self.factor = set(steps), factor

    def on_step_end(self, run: Any, step: int) -> None:
        if step in self.steps:
            with torch.no_grad():
                for p in run.model.parameters():
                    p.mul_(self.factor)


SCRIPT = Path(__file__).resolve().parents[1] / "rollback_script.py"
# ``python -c RUN_SCRIPT train ...``, for ``TrainRun(...).run(python_code=RUN_SCRIPT)``.
RUN_SCRIPT = f"import runpy; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
