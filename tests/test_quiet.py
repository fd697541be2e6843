"""Accelerate's "Removed shared tensor {'lm_head.weight'} while saving ..." at every save of a tied
model is kept off the console (``process.quiet``), and nothing else is."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers.configs import REPO
from helpers.in_process import reset_accelerate, run_cli

NOTICE = "Removed shared tensor"
# configs/lm_tiny.yaml (tie_word_embeddings: true) made tiny: 4 steps, a checkpoint at step 2 and the
# final one at step 4, no validation.
TINY_TIED = [
    "DATA.BATCH_SIZE", "4",
    "MODEL.OPTIONS.hidden_size", "16",
    "MODEL.OPTIONS.intermediate_size", "32",
    "MODEL.OPTIONS.num_hidden_layers", "1",
    "MODEL.OPTIONS.num_attention_heads", "2",
    "TRAIN.TARGET_TOKENS", "null",
    "TRAIN.STEPS", "4",
    "SCHEDULE.VALIDATION.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "2",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2",
]  # fmt: skip


def test_a_tied_model_saves_its_checkpoints_without_the_shared_tensor_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)  # what the console shows (pytest's handler stands in for it)
    reset_accelerate()
    try:
        rc, out, err = run_cli(
            "train", "--cfg", str(REPO / "configs" / "lm_tiny.yaml"), "--opts",
            "ENV.OUTPUT.BASE_DIR", str(tmp_path), *TINY_TIED,
        )  # fmt: skip
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    run = tmp_path / "lm_tiny"
    assert (run / "checkpoints" / "step_00000002").is_dir()  # saved, tied: the notice's occasion
    assert (run / "final").is_dir()
    assert NOTICE not in out + err + caplog.text


def test_the_filter_drops_that_notice_alone() -> None:
    from accelerate.logging import get_logger
    from accelerate.state import PartialState

    from linnaeus_accel.process.quiet import SharedTensorNotice, quiet_library_notices

    quiet_library_notices()
    quiet_library_notices()  # idempotent
    emitting = logging.getLogger("accelerate.utils.other")
    assert sum(isinstance(f, SharedTensorNotice) for f in emitting.filters) == 1

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    emitting.addHandler(handler)
    PartialState()  # accelerate's logger needs its state
    try:
        logger = get_logger("accelerate.utils.other")
        logger.warning(
            "Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but check by verifying "
            "that you don't receive any warning while reloading"
        )
        logger.warning("Removed shared tensor {'x'} while saving, and something else went wrong")
        logging.getLogger("elsewhere").addHandler(handler)
        logging.getLogger("elsewhere").warning(
            "Removed shared tensor {'w'} while saving. This should be OK, but check by verifying that you "
            "don't receive any warning while reloading"
        )
    finally:
        emitting.removeHandler(handler)
        logging.getLogger("elsewhere").removeHandler(handler)
    assert [m.removeprefix("[RANK 0] ") for m in seen] == [
        "Removed shared tensor {'x'} while saving, and something else went wrong",
        "Removed shared tensor {'w'} while saving. This should be OK, but check by verifying that you don't "
        "receive any warning while reloading",
    ]
