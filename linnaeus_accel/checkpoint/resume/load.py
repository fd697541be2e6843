"""Loading a verified checkpoint's files into the run (every process), a previous layout's pickled
state included (``--unsafe-load-pickles``: ``find`` refuses them otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ...config import ConfigError
from ..state.content import CheckpointLoadError, legacy_pickles
from .reader import CheckpointReader


def load_state(
    accelerator: Accelerator, reader: CheckpointReader, path: Path, registered: list[str]
) -> dict[str, Any] | str:
    """The state of the checkpoint at ``path``, its tensors in place (model, optimizer, RNG); or why
    its files could not be loaded (the caller agrees with the other processes). ``registered``: the
    names of the registered parts that hold tensors, in the order they registered: a previous
    layout pickled their states as ``custom_checkpoint_<i>.pkl``, in that order."""
    pickles = legacy_pickles(path)
    names = _pickled_state_names(path, len(pickles), registered)
    collected = [_Collected() for _ in pickles]
    accelerator._custom_objects[:] = collected  # Accelerate loads them as it wrote them (weights_only=False)
    try:
        state = reader.load(path)
    except CheckpointLoadError as exc:
        return str(exc)
    finally:
        accelerator._custom_objects.clear()
    return {**state, **{name: c.state for name, c in zip(names, collected, strict=True)}}


def _pickled_state_names(path: Path, count: int, registered: list[str]) -> list[str]:
    """The names here of a previous layout's ``count`` pickled states."""
    if count and count != len(registered):
        raise ConfigError(
            [
                (
                    "CALLBACKS",
                    f"the checkpoint {path.name} holds {count} pickled state(s) (custom_checkpoint_*.pkl) and this "
                    f"run registers {len(registered)} ({', '.join(registered) or 'none'}): list the CALLBACKS the "
                    "checkpoint's run had",
                )
            ],
            source="resume",
        )
    return registered[:count]


class _Collected:
    """Takes what Accelerate loads from a previous layout's ``custom_checkpoint_<i>.pkl``."""

    def __init__(self) -> None:
        self.state: Any = None

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state
