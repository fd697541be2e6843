"""``RunContext``: what a callback sees of the run and may do in it, handed to every event instead
of the Trainer (Composer's ``State`` is the idea): a callback reads the run (its config, plan,
progress, model, Accelerator) and acts through a few verbs (log, say, register state, validate a
model, write weights next to ``final/``), and cannot reach into the loop's parts.

A callback written for the events' former argument, the ``Trainer``, keeps working: the attributes
it used are here under the same names (``model``, ``optimizer``, ``config``, ``plan``, ``accelerator``,
``is_main_process``, ``log``, ``say``, ``register_state``, ``registered_names``, ``progress``),
and any other attribute of the Trainer is still reached, with a ``DeprecationWarning`` saying what
to use instead: that fallback goes in the next release.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch import nn

    from ..config import Config
    from ..progress import TrainingProgress
    from ..schedule import ResolvedPlan


@dataclass(frozen=True)
class RunActions:
    """What a ``RunContext`` does, given by the run that builds it."""

    log: Callable[[dict[str, Any], int], None]
    say: Callable[[str], None]
    register_state: Callable[[str, Any], None]
    registered_names: Callable[[], list[str]]
    # The run's standard validation pass on a model (metrics with ``prefix``); None: no validation data.
    validate: Callable[[nn.Module, str], dict[str, float]] | None
    # Writes a model's weights as final/ does, to final/<name>/.
    save_final: Callable[[nn.Module, str], Path]


@dataclass(frozen=True)
class RunContext:
    """See the module docstring. Every process gets one; the verbs with side effects (``log``,
    ``say``) act on the main process only, so a callback needs no branch on the rank for them."""

    config: Config
    plan: ResolvedPlan
    accelerator: Accelerator
    model: nn.Module  # as prepared (wrapped by DDP or compiled): ``accelerator.unwrap_model`` for yours
    optimizer: torch.optim.Optimizer  # as prepared; its groups' ``lr`` is set by the schedule each step
    progress: TrainingProgress  # where the run is; read it, the loop writes it
    callbacks: Sequence[Any]  # the run's callbacks (``Callback``s), in the order they are called
    train_dataset: Any
    tokenizer: Any  # the run's tokenizer (shipped in final/), or None
    actions: RunActions = field(repr=False)
    trainer: Any = field(default=None, repr=False, compare=False)  # for the deprecated fallback

    @property
    def is_main_process(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def global_step(self) -> int:
        """Optimizer steps completed."""
        return self.progress.global_step

    @property
    def output_dir(self) -> Path:
        return self.config.output_dir

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``metrics`` at ``step`` to metrics.jsonl and the trackers (main process only)."""
        self.actions.log(metrics, step)

    def say(self, text: str) -> None:
        """Print a line above the progress bar (main process only)."""
        self.actions.say(text)

    def register_state(self, name: str, part: Any) -> None:
        """Save ``part.state_dict()`` (tensors and plain values) in every checkpoint under ``name``
        and hand it back to ``part.load_state_dict`` on resume; in ``on_setup`` (see
        ``Trainer.register_state``)."""
        self.actions.register_state(name, part)

    def registered_names(self) -> list[str]:
        return self.actions.registered_names()

    def validate(self, model: nn.Module, prefix: str) -> dict[str, float] | None:
        """The run's standard validation pass on ``model`` (every process takes part), its metrics
        named ``<prefix>/<metric>``; None when the run has no validation data."""
        if self.actions.validate is None:
            return None
        return self.actions.validate(model, prefix)

    def save_final(self, model: nn.Module, name: str) -> Path:
        """Write ``model``'s weights as ``final/`` holds the run's, to ``final/<name>/`` (collective)."""
        return self.actions.save_final(model, name)

    def __getattr__(self, name: str) -> Any:
        trainer = self.__dict__.get("trainer")
        if trainer is None or name.startswith("__"):
            raise AttributeError(f"RunContext has no attribute {name!r}")
        value = getattr(trainer, name)  # an AttributeError names the Trainer's attribute
        warnings.warn(
            f"a callback read {name!r} of the Trainer: callbacks are handed a RunContext (the run's config, plan, "
            "progress, model, optimizer and accelerator, and log, say, register_state, validate, save_final); reaching the "
            "Trainer through it goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
