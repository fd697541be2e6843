"""A task of your own: what a batch holds, the loss and the validation metrics are yours.

    python examples/by_feature/your_own_task.py

``DigitValue`` reads each handwritten digit as a number and regresses it: a squared error per
sample, and the mean absolute error ``val/mae`` (lower is better) at validation. A task returns
summed losses and counts the units they run over (here real samples: rows that only pad the last
batch, ``real`` False, count nowhere), so every step's loss is the exact mean over its samples on
any number of processes. Registered by name, it is chosen by ``TASK.NAME``;
``Trainer(..., task=DigitValue())`` takes an instance instead. Checkpoints are ranked by
``val/mae``, lowest first, because the task says so. Each run of the script writes to a new
directory under ``$EXAMPLES_OUT`` (default: the temp dir).
"""

import os
import tempfile
from collections.abc import Mapping

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.tasks import Task, register_task

OUT = tempfile.mkdtemp(prefix="own_task_", dir=os.environ.get("EXAMPLES_OUT"))


@register_task("digit_value")
class DigitValue(Task):
    metric_directions: Mapping[str, str] = {"loss": "min", "mae": "min"}  # ranking, early stopping

    def prepare(self, batch, step, epoch, batch_index, real):  # per micro-batch, on the device
        x, y = batch
        return x, y.float(), torch.ones_like(y, dtype=torch.float) if real is None else real.float()

    def units(self, batch):  # per loss component (one here)
        return batch[2].sum().long().reshape(1)

    def loss_sums(self, model, batch):
        x, y, weight = batch
        return ((model(x).squeeze(-1) - y) ** 2 * weight).sum().reshape(1)

    def validation_step(self, model, batch, real, vpass):  # sums, added up over batches and processes
        x, y, weight = self.prepare(batch, 0, 0, 0, real)
        error = model(x).squeeze(-1) - y
        return torch.stack([(error**2 * weight).sum(), (error.abs() * weight).sum(), weight.sum()]).double()

    def validation_metrics(self, sums, vpass):
        return {f"{vpass.prefix}/loss": sums[0] / sums[2], f"{vpass.prefix}/mae": sums[1] / sums[2]}


digits = load_digits()  # ships with scikit-learn: nothing is downloaded
x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
config = load_config(
    {
        "EXPERIMENT": {"NAME": "digit_value", "SEED": 0},
        "ENV": {"OUTPUT": {"BASE_DIR": OUT}},
        "TASK": {"NAME": "digit_value"},
        "DATA": {"BATCH_SIZE": 32},
        "TRAIN": {"EPOCHS": 5, "EARLY_STOP": {"METRIC": "val/mae"}},  # also the checkpoints' ranking
        "LR_SCHEDULER": {"NAME": "cosine", "BASE_LR": 1e-2, "REFERENCE_BS": None, "WARMUP_FRACTION": 0.1},
        "SCHEDULE": {"VALIDATION": {"INTERVAL_EPOCHS": 1}, "CHECKPOINT": {"INTERVAL_EPOCHS": 1}},
    }
)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
summary = Trainer(config, model, TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])).fit()

best = summary["best_metric"]
assert best["name"] == "val/mae", best
assert best["value"] < 1.5, best  # guessing the mean digit: 2.46
print(f"best val/mae {best['value']:.3f} at step {best['step']} (guessing the mean digit: 2.46)")
