"""Preemption and exact resume: a run stopped by SIGTERM mid-epoch and run again ends as if never stopped.

    python examples/by_feature/resume_and_preemption.py

On SIGTERM or SIGUSR1 (SLURM, spot instances) a run finishes the optimizer step in progress,
checkpoints it and returns ``status: preempted``. The same code run again resumes from that
checkpoint (``TRAIN.AUTO_RESUME``, the default) at the exact step, data position and random state:
the hierarchical digits run of configs/default.yaml, masking and mixup included, ends with the
weights of a run never stopped, byte for byte (the script checks). Here a callback signals its own
process after step 60 (inside epoch 2); ``kill -TERM`` from outside, or ``kill -9`` at any moment
(then the newest checkpoint is the resume point), works the same way.
Each run of the script writes to a new directory under ``$EXAMPLES_OUT`` (default: the temp dir).
"""

import os
import signal
import tempfile
from pathlib import Path

from accelerate.utils import set_seed

from linnaeus_accel import Callback, Trainer, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
OUT = tempfile.mkdtemp(prefix="resume_", dir=os.environ.get("EXAMPLES_OUT"))


class SigtermAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, run, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends before it takes the machine


def train(name: str, callbacks=()) -> dict:
    """The default digits run, 3 epochs, into OUT/name; its summary."""
    config = load_config(CONFIG, ["EXPERIMENT.NAME", name, "ENV.OUTPUT.BASE_DIR", OUT, "TRAIN.EPOCHS", "3"])
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    set_seed(config.EXPERIMENT.SEED)  # the same initial weights in every run
    model = build_model(config, train_data)
    return Trainer(config, model, train_data, val_data, callbacks=callbacks).fit()


uninterrupted = train("uninterrupted")
stopped = train("preempted", [SigtermAt(60)])
assert stopped["status"] == "preempted", stopped["status"]
assert stopped["global_step"] == 60, stopped["global_step"]
resumed = train("preempted")  # the same code again: it resumes from step 60's checkpoint
assert resumed["global_step"] == uninterrupted["global_step"], resumed["global_step"]

final = [
    Path(OUT, name, "final", "model.safetensors").read_bytes() for name in ("uninterrupted", "preempted")
]
assert final[0] == final[1], "the resumed run must end with the uninterrupted run's weights"
print(f"preempted at step 60, resumed, and ended byte-identical to the uninterrupted run (in {OUT})")
