"""Schedules as pure functions of the global optimizer step, resolved once from the config."""

from .boundaries import Interval
from .early_stopping import EarlyStopping
from .lr import LRCurve
from .ops import OpsSchedule
from .plan import resolve_plan
from .ramps import PartialMasking, Ramp
from .resolved import ResolvedPlan
from .sanity import sanity_warnings
from .steps import batches_per_process, optimizer_steps_per_epoch, steps_from_epochs, steps_from_fraction
from .stops import StopDecision, StopReason

__all__ = [
    "EarlyStopping",
    "Interval",
    "LRCurve",
    "OpsSchedule",
    "PartialMasking",
    "Ramp",
    "ResolvedPlan",
    "StopDecision",
    "StopReason",
    "batches_per_process",
    "optimizer_steps_per_epoch",
    "resolve_plan",
    "sanity_warnings",
    "steps_from_epochs",
    "steps_from_fraction",
]
