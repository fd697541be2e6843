"""``TRAIN.LOSS_SPIKE`` and ``TRAIN.ROLLBACK``: what a run does when its loss spikes or turns NaN
(``training/recovery.py`` acts on them; docs/guides/checkpoints.md, "Rolling back")."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .base import PositiveFloat, PositiveInt, Problem, Section


class LossSpikeConfig(Section):
    """A loss spike: at a metric record (SCHEDULE.METRICS.STEP_INTERVAL), the window's mean training
    loss above FACTOR x the mean of the previous WINDOW records, CONSECUTIVE records in a row."""

    ACTION: Literal["off", "stop", "rollback"] = Field(
        "off",
        description="off: spikes are not looked for; stop: the run fails at the spike (the last good "
        "checkpoint stays the resume point); rollback: back to the newest checkpoint before the spike, "
        "its data skipped (TRAIN.ROLLBACK). Read at metric records only: no host sync on other steps.",
    )
    FACTOR: PositiveFloat = Field(
        2.0,
        description="A record spikes when its loss exceeds FACTOR x the running mean of the WINDOW "
        "records before it (for losses that stay positive, as cross-entropy does).",
    )
    WINDOW: PositiveInt = Field(
        10,
        description="Records in the running mean; the rule is armed once that many records were "
        "seen (records of a spike are not added until it ends).",
    )
    CONSECUTIVE: PositiveInt = Field(
        1,
        description="Records in a row that must spike before ACTION is taken: more ignores a lone "
        "noisy record, and a rollback then goes back before the first of them.",
    )

    @field_validator("ACTION", mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        # YAML reads a bare `off` as false: that is what the user wrote.
        return "off" if value is False else value

    def problems(self) -> list[Problem]:
        if self.FACTOR <= 1.0:
            return [
                Problem(
                    ("FACTOR",),
                    f"{{0}} is {self.FACTOR:g}: a loss at or below its own mean is no spike; use a factor "
                    "above 1 (2.0 is a common choice)",
                )
            ]
        return []


class RollbackConfig(Section):
    """What a rollback (TRAIN.NONFINITE: rollback, TRAIN.LOSS_SPIKE.ACTION: rollback) does: reload
    the newest committed checkpoint from before the window that went wrong (model, optimizer, RNG,
    GradNorm and callbacks' state), skip the data from there through the window plus SKIP_STEPS
    further optimizer steps' worth, and go on. The run keeps its plan: it still ends at the same
    step, every schedule follows the global step as before, and the steps rolled back or skipped
    make no update (docs/semantics.md §8)."""

    SKIP_STEPS: int = Field(
        0,
        ge=0,
        description="Optimizer steps' worth of data skipped after the bad window, beyond it (PaLM skipped "
        "200-500 batches around each spike; 0: only the data from the checkpoint through the window).",
    )
    MAX: PositiveInt = Field(
        3,
        description="Rollbacks allowed in a run; one more fails the run with the reason (the last good "
        "checkpoint stays the resume point).",
    )
