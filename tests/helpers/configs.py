"""The configs the tests train: the repository's paths, the shipped configs, the option lists
several test modules share, and configs built in a line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from linnaeus_accel.config import Config

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"  # the digits classifier: offline, seconds a run
CFG = str(DEFAULT_CONFIG)  # the same, as a command-line argument
LM_CFG = str(REPO / "configs" / "lm_tiny.yaml")

# configs/lm_tiny.yaml with a model small enough for a test: 8 sequences of 129 tokens per process,
# 205 steps per epoch on two processes (410 on one), validation at each boundary, mid-epoch
# checkpoints every 20 steps.
SMALL_LM = [
    "DATA.BATCH_SIZE", "8",
    "MODEL.OPTIONS.hidden_size", "32",
    "MODEL.OPTIONS.intermediate_size", "64",
    "MODEL.OPTIONS.num_hidden_layers", "1",
    "MODEL.OPTIONS.num_attention_heads", "2",
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "20",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2",
    "SCHEDULE.METRICS.STEP_INTERVAL", "5",
]  # fmt: skip


def make_config(
    *,
    batch_size: int = 32,
    accumulation: int = 1,
    drop_last: bool = False,
    epochs: int | None = None,
    steps: float | None = None,
    target_tokens: int | None = None,
    lr: dict[str, Any] | None = None,
    schedule: dict[str, Any] | None = None,
    **data: Any,
) -> Config:
    """A config of the sections that decide the schedule (every other key the default): the batch,
    the run's length (at most one of ``epochs``, ``steps`` and ``target_tokens``; none: the default
    epochs), the LR schedule, SCHEDULE, and any other DATA keys as keywords."""
    from linnaeus_accel.config import validate_config  # not at import: conftest imports this module

    length = {"EPOCHS": epochs, "STEPS": steps, "TARGET_TOKENS": target_tokens}
    return validate_config(
        {
            "DATA": {"BATCH_SIZE": batch_size, "DROP_LAST": drop_last, **data},
            "TRAIN": {
                "ACCUMULATION_STEPS": accumulation,
                **{k: v for k, v in length.items() if v is not None},
            },
            "LR_SCHEDULER": lr or {},
            "SCHEDULE": schedule or {},
        }
    )


def mixture_config(tmp_path: Path, *sources: dict[str, Any], steps: int = 10) -> Path:
    """configs/pretrain.yaml (a tiny LM over a mixture of token files) with these sources, written
    to ``tmp_path``; the run's output goes to ``tmp_path / "runs"``."""
    tiny_lm = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = {
        "BASE": [str(REPO / "configs" / "pretrain.yaml")],
        "ENV": {"OUTPUT": {"BASE_DIR": str(tmp_path / "runs")}},
        "DATA": {"BATCH_SIZE": 4, "DATASET": {"OPTIONS": {"sources": list(sources)}}},
        "MODEL": {"OPTIONS": {**tiny_lm, "max_position_embeddings": 9}},
        "TRAIN": {"STEPS": steps},
        "SCHEDULE": {
            "VALIDATION": {"INTERVAL_STEPS": None, "MID_EPOCH": False},
            "CHECKPOINT": {"INTERVAL_STEPS": None, "MID_EPOCH": False},
        },
    }
    path = tmp_path / "mixture.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return path
