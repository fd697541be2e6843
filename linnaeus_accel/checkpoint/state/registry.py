"""Every stateful part of a run registers here under a name; a checkpoint saves what the registry
holds and a resume hands each part its own entry back. The trainer lists nothing by hand.

Two kinds of state: the run's (``per_rank=False``: progress, early stopping, GradNorm, callbacks,
and what callbacks and users register with ``Trainer.register_state``, under ``registered.<name>``),
taken on the main process into ``trainer_state.json``, its tensors (an EMA of the weights) into a
safetensors file beside it (``tensor_state``); and each process's own (``per_rank=True``: its metric
window, its data position), one JSON file per rank, converted to another layout by
``elastic.own_rank_state``. Nothing is pickled.

Loading is tolerant: a name the checkpoint lacks (a part added since, e.g. a checkpoint written
before callbacks existed) leaves that part as built; a ``null`` entry (a part that was off) too.
The names are the keys checkpoints have always used, so older checkpoints resume unchanged.

Each part may say its state's format (a pydantic model: ``schema=``, else the part's
``STATE_SCHEMA``); a part registered under a key of the checkpoint files' tables
(``schemas.RUN_PARTS``, ``schemas.RANK_PARTS``) must have that key's format, which is what a
checkpoint is verified against before anything loads. Registered parts are free-form.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from ...config import ConfigError
from . import tensor_state
from .schemas import RANK_PARTS, RUN_PARTS

REGISTERED = "registered."  # the names of what Trainer.register_state registers
_USER_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True)
class _Part:
    name: str
    save: Callable[[], Any]
    load: Callable[[Any], Any]
    per_rank: bool
    schema: type[BaseModel] | None


class StateRegistry:
    def __init__(self) -> None:
        self._parts: list[_Part] = []

    def register(
        self,
        name: str,
        part: Stateful | None = None,
        *,
        save: Callable[[], Any] | None = None,
        load: Callable[[Any], Any] | None = None,
        per_rank: bool = False,
        schema: type[BaseModel] | None = None,
    ) -> None:
        """``part``'s ``state_dict``/``load_state_dict`` under ``name``; or ``save``/``load`` where
        a part needs more than that (a value saved only mid-epoch, a load that informs others).
        ``schema``: the state's format; default: the ``STATE_SCHEMA`` of ``part`` (or of the object
        ``save`` is a method of), else the format of ``name`` in the checkpoint files."""
        if any(p.name == name and p.per_rank == per_rank for p in self._parts):
            raise ValueError(f"state {name!r} is registered twice")
        save = save or (part.state_dict if part is not None else None)
        load = load or (part.load_state_dict if part is not None else None)
        if save is None or load is None:
            raise ValueError(f"state {name!r} needs a part, or save and load")
        known = (RANK_PARTS if per_rank else RUN_PARTS).get(name)
        owner = part if part is not None else getattr(save, "__self__", None)
        schema = schema or getattr(owner, "STATE_SCHEMA", None) or known
        if known is not None and schema is not None and schema is not known:
            raise ValueError(
                f"state {name!r} has the format {schema.__name__} but checkpoints verify it as {known.__name__}"
            )
        self._parts.append(_Part(name, save, load, per_rank, schema))

    def names(self, per_rank: bool) -> list[str]:
        """The registered names, in the order they registered."""
        return [p.name for p in self._parts if p.per_rank == per_rank]

    def schemas(self, per_rank: bool) -> dict[str, type[BaseModel] | None]:
        """Each registered part's format (None: free-form), by name."""
        return {p.name: p.schema for p in self._parts if p.per_rank == per_rank}

    def state(self, per_rank: bool) -> dict[str, Any]:
        return {p.name: p.save() for p in self._parts if p.per_rank == per_rank}

    def load(self, state: Mapping[str, Any], per_rank: bool) -> list[str]:
        """Each part's entry of ``state``; what the parts say about it (a load that returns a list
        of lines, as the callbacks' does: one new since the checkpoint starts fresh)."""
        notes: list[str] = []
        for part in self._parts:
            if part.per_rank == per_rank and state.get(part.name) is not None:
                said = part.load(state[part.name])
                notes += said if isinstance(said, list) else []
        return notes

    # -- what users and callbacks register (``Trainer.register_state``) ---------------------------
    def register_user(self, name: str, part: Stateful) -> None:
        """``part`` under ``registered.<name>`` (a checked name, registered once)."""
        if not _USER_NAME.fullmatch(name):
            raise ValueError(f"register_state: {name!r} is not a name: use letters, digits, '_', '-' and '.'")
        if REGISTERED + name in self.names(per_rank=False):
            raise ValueError(f"register_state: {name!r} is registered already")
        self.register(REGISTERED + name, part)

    def user_names(self) -> list[str]:
        """What ``register_user`` holds, in the order it was registered."""
        return [n.removeprefix(REGISTERED) for n in self.names(per_rank=False) if n.startswith(REGISTERED)]

    def check_savable(self) -> None:
        """Before the first step, not at the first checkpoint: every part's state must be what a
        checkpoint can hold, or the steps before that checkpoint would be lost (``ConfigError``)."""
        if (bad := tensor_state.unsavable(self.state(per_rank=False))) is not None:
            name, why = bad
            key = "CALLBACKS" if name == "callbacks" else f"register_state({name.removeprefix(REGISTERED)!r})"
            raise ConfigError([(key, f"its state_dict() cannot be saved in a checkpoint: {why}")])
