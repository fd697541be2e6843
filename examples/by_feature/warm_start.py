"""Warm start: a new run that starts from another run's final weights (``MODEL.INIT_FROM``).

    python examples/by_feature/warm_start.py

The first run trains the digits convnet of configs/digits_classification.yaml for 2 epochs. The
second is a new run, in a directory of its own, whose model is built as its config says and then
loaded with the first run's ``final/`` weights before the first step; its optimizer, LR schedule
and data order start afresh (a resume would continue them instead). ``MODEL.INIT_FROM`` also takes
a checkpoint directory, a ``save_pretrained`` directory or a ``.safetensors`` file, and
``MODEL.INIT_IGNORE: [head.*]`` would keep a new head as built. The script checks that the second
run starts where the first ended: its first validation beats the first run's.
Each run of the script writes to a new directory under ``$EXAMPLES_OUT`` (default: the temp dir).
"""

import json
import os
import tempfile
from pathlib import Path

from accelerate.utils import set_seed

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_classification.yaml"
OUT = tempfile.mkdtemp(prefix="warm_start_", dir=os.environ.get("EXAMPLES_OUT"))


def train(name: str, *opts: str) -> list[float]:
    """A 2-epoch run into OUT/name; its validation accuracies, one per epoch."""
    opts = ("EXPERIMENT.NAME", name, "ENV.OUTPUT.BASE_DIR", OUT, "TRAIN.EPOCHS", "2", *opts)
    config = load_config(CONFIG, [*opts, "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"])
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    set_seed(config.EXPERIMENT.SEED)
    Trainer(config, build_model(config, train_data), train_data, val_data).fit()
    records = Path(config.output_dir, "metrics.jsonl").read_text().splitlines()
    return [r["val/acc"] for r in map(json.loads, records) if "val/acc" in r]


first = train("first")
second = train("second", "MODEL.INIT_FROM", str(Path(OUT, "first", "final")), "LR_SCHEDULER.BASE_LR", "0.002")
assert second[0] > first[0], (first, second)  # it starts where the first run ended

loaded = json.loads(Path(OUT, "second", "assets", "run_info.json").read_text())["model"]["init_from"]
print(
    f"the second run loaded {loaded['tensors_loaded']} tensors from {loaded['path']} (digest {loaded['weights_xxh3']})"
)
print(f"val/acc by epoch: first run {first}, warm-started run {second}")
