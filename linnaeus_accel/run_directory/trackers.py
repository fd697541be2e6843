"""Experiment trackers through Accelerate's tracker API: which ones (EXPERIMENT.TRACKERS and
EXPERIMENT.WANDB.ENABLED), refused at start when their package is missing, started at the run's
global step with the resolved config; the step axis of every tracker is the global step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker, TensorBoardTracker, get_available_trackers

from ..config import ConfigError
from ..config.run import DEFAULT_PROJECT, ExperimentConfig
from ..json_files import flatten

# How to install each tracker's package: the extra of this package where there is one.
TRACKER_INSTALL = {
    "wandb": "pip install 'linnaeus-accel[wandb]'",
    "tensorboard": "pip install 'linnaeus-accel[tensorboard]'",
    "comet_ml": "pip install comet-ml",
    "aim": "pip install 'aim<4'",  # Accelerate's tracker takes aim 3 only
    "mlflow": "pip install mlflow",
    "clearml": "pip install clearml",
    "dvclive": "pip install dvclive",
    "swanlab": "pip install swanlab",
    "trackio": "pip install trackio",
}
TENSORBOARD_DIR = "tensorboard"


class RunTensorBoard(TensorBoardTracker):  # type: ignore[misc]  # accelerate has no type hints
    """Accelerate's TensorBoard tracker writing to ``<run dir>/tensorboard`` whatever the project name
    (Accelerate's default is ``<logging dir>/<project>``). Started at a resumed step, it tells
    TensorBoard's readers to discard what the killed run logged after that step (``purge_step``),
    as metrics.jsonl drops it."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(TENSORBOARD_DIR, str(run_dir))

    def start_at(self, step: int) -> None:
        self.init_kwargs["purge_step"] = step + 1


def log_with(experiment: ExperimentConfig, output_dir: Path) -> list[str | GeneralTracker] | None:
    """``Accelerator(log_with=...)`` for EXPERIMENT.TRACKERS (and WANDB.ENABLED), TensorBoard writing
    to the run directory ``output_dir``; None without any (Accelerate warns about an empty list). A
    tracker whose package is missing is a ConfigError here, before anything is written: Accelerate
    would drop it silently."""
    available = {str(t) for t in get_available_trackers()}
    problems = []
    for name in experiment.trackers:
        if name not in available:
            key = "EXPERIMENT.TRACKERS" if name in experiment.TRACKERS else "EXPERIMENT.WANDB.ENABLED"
            problems.append(
                (
                    key,
                    f"logs to {name}, whose package is not installed: {TRACKER_INSTALL[name]}, or remove it",
                )
            )
    if problems:
        raise ConfigError(problems)
    return [RunTensorBoard(output_dir) if n == "tensorboard" else n for n in experiment.trackers] or None


def check_log_with(accelerator: Accelerator, experiment: ExperimentConfig) -> None:
    """An Accelerator given to the Trainer must log to the configured trackers: it keeps its own."""
    names = {t.name if isinstance(t, GeneralTracker) else str(t) for t in accelerator.log_with}
    missing = [n for n in experiment.trackers if n not in names]
    if missing:
        raise ConfigError(
            [
                (
                    "EXPERIMENT.TRACKERS",
                    f"lists {', '.join(missing)} but the Accelerator given does not log to "
                    f"{'it' if len(missing) == 1 else 'them'}: build it with log_with=linnaeus_accel."
                    "run_directory.trackers.log_with(config.EXPERIMENT, config.output_dir), or leave it to the "
                    "Trainer",
                )
            ]
        )


def init_trackers(
    accelerator: Accelerator,
    experiment: ExperimentConfig,
    output_dir: Path,
    resolved: dict[str, Any],
    resumed_run_id: str | None,
    step: int,
) -> None:
    """Start the trackers at global step ``step`` (0, or the step resumed from) and give each the
    resolved config ``resolved`` (``Config.model_dump(mode="json")``: nested for W&B, flat
    ``SECTION.KEY`` scalars for the others). A resumed run continues its W&B run; TensorBoard appends
    to ``<output_dir>/tensorboard``."""
    if not accelerator.log_with:
        return
    run: dict[str, Any] = {
        "name": experiment.NAME,
        "dir": str(output_dir),
        "tags": list(dict.fromkeys([*experiment.TAGS, *experiment.WANDB.TAGS])) or None,
        "notes": experiment.NOTES or None,
        "entity": experiment.WANDB.ENTITY,
    }
    if resumed_run_id:
        run.update(id=resumed_run_id, resume="allow")
    for tracker in accelerator.log_with:
        if isinstance(tracker, RunTensorBoard):
            tracker.start_at(step)
    accelerator.init_trackers(experiment.WANDB.PROJECT or DEFAULT_PROJECT, init_kwargs={"wandb": run})
    flat = _flat_config(resolved)
    for tracker in accelerator.trackers:
        tracker.store_init_configuration(resolved if tracker.name == "wandb" else flat)


def _flat_config(tree: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """``{"TRAIN.EPOCHS": 20, ...}``: what every tracker takes as hyperparameters (lists and null as JSON text)."""
    return {
        key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
        for key, value in flatten(tree).items()
    }
