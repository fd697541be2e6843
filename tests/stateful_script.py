"""``python tests/stateful_script.py train ...``: linnaeus-accel's CLI with two callbacks of a user's
own that keep tensor state (tests/test_checkpoint_safety.py):

- ``tensor_sum`` registers it with ``trainer.register_state`` (a tensor, a tuple, an int key);
- ``accelerate_registered`` uses Accelerate's ``register_for_checkpointing``, as the README once
  advised: the trainer saves such objects as its own state (safetensors and JSON) instead of
  Accelerate's pickles.

At the end of the run each writes what it holds to ``<run dir>/state_<name>.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.cli import main


class Sums:
    def __init__(self) -> None:
        self.total = torch.zeros(3, dtype=torch.float64)
        self.calls: dict[int, tuple[int, str]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "calls": dict(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert isinstance(state["calls"], dict)
        assert all(isinstance(k, int) for k in state["calls"])
        assert all(isinstance(v, tuple) for v in state["calls"].values())
        self.total = state["total"].clone()
        self.calls = dict(state["calls"])


class _Summing(Callback):
    name = ""

    def __init__(self) -> None:
        self.sums = Sums()

    def on_step_end(self, trainer: Any, step: int) -> None:
        weights = next(trainer.model.parameters()).detach().double().flatten()[:3].cpu()
        self.sums.total += weights
        self.sums.calls[step] = (step, f"step {step}")

    def on_fit_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        if trainer.is_main_process:
            out = trainer.config.output_dir / f"state_{self.name}.json"
            out.write_text(json.dumps({"total": self.sums.total.tolist(), "calls": sorted(self.sums.calls)}))


@register_callback("tensor_sum")
class TensorSum(_Summing):
    name = "tensor_sum"

    def on_setup(self, trainer: Any) -> None:
        trainer.register_state("sums", self.sums)


@register_callback("accelerate_registered")
class AccelerateRegistered(_Summing):
    name = "accelerate_registered"

    def on_setup(self, trainer: Any) -> None:
        trainer.accelerator.register_for_checkpointing(self.sums)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
