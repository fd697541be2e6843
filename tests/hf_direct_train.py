"""A user's training script that hands Hugging Face ``datasets`` straight to the ``Trainer``
(``tests/test_hf_datasets_trainer.py`` runs it, killed and rerun, on 1 and 2 processes).

    python tests/hf_direct_train.py DATA_DIR OUTPUT_DIR {map,stream} WORKERS

``DATA_DIR`` holds ``train-*.jsonl`` and ``val.jsonl``: one pre-tokenised window per line
(``input_ids``, 65 byte-level ids). ``map``: a ``datasets.Dataset`` with ``with_format("torch")``;
``stream``: a streaming ``datasets.IterableDataset`` (no ``__len__``, one shard per file).
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from typing import Any

import datasets
from accelerate.utils import set_seed

from linnaeus_accel import Trainer
from linnaeus_accel.config import validate_config
from linnaeus_accel.models import build_model


def with_labels(example: dict[str, Any]) -> dict[str, Any]:
    return {"labels": example["input_ids"]}


def load(files: list[str], streaming: bool) -> Any:
    data = datasets.load_dataset("json", data_files=files, split="train", streaming=streaming)
    return data.map(with_labels).with_format("torch")


def main(data_dir: str, output_dir: str, mode: str, workers: int) -> None:
    streaming = mode == "stream"
    train = load(sorted(glob.glob(os.path.join(data_dir, "train-*.jsonl"))), streaming)
    val = load([os.path.join(data_dir, "val.jsonl")], streaming)
    config = validate_config(
        {
            "EXPERIMENT": {"NAME": "run", "SEED": 0},
            "ENV": {"OUTPUT": {"BASE_DIR": output_dir}},
            "DATA": {"BATCH_SIZE": 4, "NUM_WORKERS": workers},
            "MODEL": {
                "TYPE": "hf_causal_lm",
                "OPTIONS": {
                    "model_type": "llama",
                    "vocab_size": 257,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "max_position_embeddings": 65,
                },
            },
            "TASK": {"NAME": "causal_lm"},
            "TRAIN": {"STEPS": 32, "CLIP_GRAD": 1.0},
            "LR_SCHEDULER": {"NAME": "cosine", "BASE_LR": 3e-3, "REFERENCE_BS": None, "WARMUP_STEPS": 4},
            "SCHEDULE": {
                "VALIDATION": {"INTERVAL_STEPS": 16, "MID_EPOCH": True},
                "CHECKPOINT": {"INTERVAL_STEPS": 7, "MID_EPOCH": True, "KEEP_LAST_N": 2},
                "METRICS": {"STEP_INTERVAL": 5},
            },
        }
    )
    set_seed(config.EXPERIMENT.SEED)  # the same initial weights on every process and every run
    summary = Trainer(config, build_model(config, None), train, val).fit()
    print(f"{summary['status']} at step {summary['global_step']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    # As linnaeus-accel's own entry point does under a launcher: gloo's threads, alive through
    # DDP's process group, can abort the interpreter's shutdown after a clean run.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
