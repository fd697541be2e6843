"""Callbacks: code of your own at the run's events, with state kept in every checkpoint.

    python examples/by_feature/callbacks.py

``ProgressTracker`` counts the steps it is called at and the validations that improved a metric,
and logs both (``metrics.jsonl`` and any tracker). Registered by name, it is listed under
``CALLBACKS`` in the config (a dict here; a YAML file takes the same keys) with its options and
interval, which ``plan`` shows; ``Trainer(..., callbacks=[ProgressTracker()])`` adds one without
the config. Its ``state_dict`` goes into every checkpoint, so a run killed and resumed counts what
an uninterrupted one counts. Each run of the script writes to a new directory under
``$EXAMPLES_OUT`` (default: the temp dir).
"""

import json
import os
import tempfile
from pathlib import Path

from accelerate.utils import set_seed

from linnaeus_accel import Callback, Trainer, load_config, register_callback
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_classification.yaml"
OUT = tempfile.mkdtemp(prefix="callbacks_", dir=os.environ.get("EXAMPLES_OUT"))


@register_callback("progress_tracker")
class ProgressTracker(Callback):
    def __init__(self, metric: str = "val/acc") -> None:  # its OPTIONS are checked against these
        self.metric, self.calls, self.best, self.improved = metric, 0, None, 0

    def on_step_end(self, run, step):  # at the steps of its interval, on every process
        self.calls += 1
        run.log({"tracker/calls": self.calls}, step)  # written by the main process only

    def on_validation_end(self, run, step, metrics):
        if self.best is None or metrics[self.metric] > self.best:
            self.best, self.improved = metrics[self.metric], self.improved + 1
        metrics["tracker/improved"] = self.improved  # joins this validation's record

    def state_dict(self):  # plain values
        return {"calls": self.calls, "best": self.best, "improved": self.improved}

    def load_state_dict(self, state):
        self.calls, self.best, self.improved = state["calls"], state["best"], state["improved"]


config = load_config(
    {
        "BASE": [str(CONFIG)],
        "EXPERIMENT": {"NAME": "callbacks"},
        "ENV": {"OUTPUT": {"BASE_DIR": OUT}},
        "TRAIN": {"EPOCHS": 3},
        "SCHEDULE": {"CHECKPOINT": {"INTERVAL_EPOCHS": 1}},
        "CALLBACKS": [{"NAME": "progress_tracker", "INTERVAL_STEPS": 20, "OPTIONS": {"metric": "val/acc"}}],
    }
)
train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
set_seed(config.EXPERIMENT.SEED)
Trainer(config, build_model(config, train_data), train_data, val_data).fit()

records = [json.loads(line) for line in Path(config.output_dir, "metrics.jsonl").read_text().splitlines()]
calls = {r["global_step"]: r["tracker/calls"] for r in records if "tracker/calls" in r}
assert calls == {20 * i: i for i in range(1, 7)}, calls  # steps 20, 40, ..., 120 of the run's 135
improved = [r["tracker/improved"] for r in records if "tracker/improved" in r]
assert len(improved) == 3, improved  # one per validation (every epoch)
print(f"tracker: called at steps {sorted(calls)}; improvements after each validation: {improved}")
