"""``python tests/callback_script.py train ...``: linnaeus-accel's CLI with a callback of the user's
own registered (``counter``), as a user's training script would (tests/test_callbacks.py).

``counter`` records every event it sees in its state; at the end of the run the main process writes
``callback_<label>.json`` (its state, and how many times the run started) into the run directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.cli import main


@register_callback("counter")
class Counter(Callback):
    def __init__(self, label: str = "counter") -> None:
        self.label = label
        self.state: dict[str, list[int]] = {"steps": [], "validations": [], "checkpoints": []}
        self.starts = 0

    def on_fit_start(self, trainer: Any) -> None:
        self.starts += 1

    def on_step_end(self, trainer: Any, step: int) -> None:
        self.state["steps"].append(step)

    def on_validation_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        assert "val/loss" in metrics
        self.state["validations"].append(step)

    def on_checkpoint(self, trainer: Any, step: int, path: Path) -> None:
        assert trainer.is_main_process
        assert (path / "COMMITTED.json").is_file()
        self.state["checkpoints"].append(step)

    def on_fit_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        if trainer.is_main_process:
            out = trainer.config.output_dir / f"callback_{self.label}.json"
            out.write_text(json.dumps({**self.state, "starts": self.starts, "status": summary["status"]}))

    def state_dict(self) -> dict[str, Any]:
        return {k: list(v) for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {k: list(v) for k, v in state.items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
