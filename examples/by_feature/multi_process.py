"""Several processes: the same training function on 2 processes or on 1 trains the same run.

    python examples/by_feature/multi_process.py       # launches itself on 2 CPU processes, then runs on 1
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/by_feature/multi_process.py

Run directly, the script starts ``train`` on 2 CPU processes (gloo) with Accelerate's
``notebook_launcher``, as a notebook would, then on this one process; under ``accelerate launch``
(on GPUs without ``ACCELERATE_USE_CPU``) each process it starts runs ``train``.
``DATA.BATCH_SIZE`` is per process: 2 processes of 16 train the steps and schedule of 1 process of
32, and the script checks that both runs end with the same validation loss. Every process writes to
the same run directory, a new one under ``$EXAMPLES_OUT`` (default: the temp dir) that the main
process picks.
"""

import json
import math
import os
import socket
import tempfile
from pathlib import Path

from accelerate import Accelerator, notebook_launcher
from accelerate.utils import broadcast_object_list, set_seed

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_classification.yaml"


def new_directory() -> str:
    return tempfile.mkdtemp(prefix="multi_process_", dir=os.environ.get("EXAMPLES_OUT"))


def train(out: str | None = None) -> None:
    accelerator = Accelerator()  # the processes meet here; the Trainer uses it
    if out is None:  # under a launcher: the main process picks the directory for all
        out = broadcast_object_list([new_directory() if accelerator.is_main_process else None])[0]
    n = accelerator.num_processes
    opts = ["EXPERIMENT.NAME", f"processes_{n}", "ENV.OUTPUT.BASE_DIR", out, "DATA.BATCH_SIZE", str(32 // n)]
    config = load_config(CONFIG, [*opts, "TRAIN.EPOCHS", "2", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"])
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    set_seed(config.EXPERIMENT.SEED)  # the same initial weights on every process
    trainer = Trainer(config, build_model(config, train_data), train_data, val_data, accelerator=accelerator)
    summary = trainer.fit()
    batch = trainer.plan.effective_batch_size  # DATA.BATCH_SIZE x processes: 32 on 1 or 2
    assert summary["global_step"] == 2 * math.ceil(len(train_data) / batch), summary["global_step"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # started by accelerate launch (or torchrun)
        train()
    else:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # CPU processes, also on a GPU machine
        out = new_directory()
        notebook_launcher(train, args=(out,), num_processes=2, use_port=free_port())
        train(out)  # the same run on this one process
        summaries = [json.loads(Path(out, f"processes_{n}", "summary.json").read_text()) for n in (2, 1)]
        two, one = (s["last_validation"]["val/loss"] for s in summaries)
        assert math.isclose(two, one, rel_tol=1e-5), (two, one)
        print(f"2 processes x 16 and 1 x 32 end with val/loss {two:.6f} and {one:.6f} (in {out})")
