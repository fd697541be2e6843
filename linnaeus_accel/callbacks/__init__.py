"""Code of your own run during training: subclass ``Callback``, override the events you need.

    from linnaeus_accel import Callback, Trainer

    class CountSteps(Callback):
        interval = {"INTERVAL_STEPS": 100}       # on_step_end at steps 100, 200, ... (the config's units)

        def __init__(self):
            self.calls = 0

        def on_step_end(self, run, step):         # run: a RunContext (what a callback sees)
            self.calls += 1

        def state_dict(self):                     # in every checkpoint: after kill -9 and a rerun,
            return {"calls": self.calls}          # the count is what an uninterrupted run's is

        def load_state_dict(self, state):
            self.calls = state["calls"]

    Trainer(config, model, data, callbacks=[CountSteps()]).fit()

From a config, register it (``@register_callback("count_steps")``) and list it under ``CALLBACKS``
with its ``OPTIONS`` (keyword arguments of the class, checked against its ``Options`` model when
it has one) and ``INTERVAL_*``.

Built in: ``ema``, ``lm_samples`` and ``profile`` (their modules in ``linnaeus_accel.callbacks``).

Every event gets the run's ``RunContext`` (``callbacks.context``): its config, plan, progress,
model and Accelerator, and what a callback may do: ``log``, ``say``, ``register_state``,
``validate`` a model, ``save_final`` weights. (A callback written for the Trainer it was handed
before keeps working: see ``context``.)

Which process runs which event (the same on 1 or N processes):
- ``on_setup``, ``on_fit_start``, ``on_step_end``, ``on_validation_end``, ``on_fit_end`` run on **every** process,
  at the same step, with the same arguments: a callback may use collectives (gathering weights,
  all-reduce). Side effects that must happen once (files, prints) go through
  ``run.is_main_process``, or ``run.log(metrics, step)`` and ``run.say(text)``, which
  write on the main process only.
- ``on_checkpoint`` runs on the **main process only**, once the checkpoint is committed (with ASYNC
  checkpoints, at the first step end after the background commit).
- ``state_dict()`` is taken on the main process and must be plain JSON data; every process loads it.
  Tensors go with the run's state through ``on_setup`` (above).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from ..config import ConfigError
from ..config.callbacks import CallbackConfig
from ..registry import Registry
from .context import RunActions, RunContext

__all__ = [
    "CALLBACKS",
    "Callback",
    "RunActions",
    "RunContext",
    "build_callbacks",
    "callback_entries",
    "callback_name",
    "register_callback",
]


class Callback:
    """Base class of callbacks: every method is optional (see the module's docstring)."""

    # When on_step_end runs, in the config's units: {"INTERVAL_STEPS": N} | {"INTERVAL_FRACTION": f}
    # | {"INTERVAL_EPOCHS": N}; empty: after every optimizer step. A config's INTERVAL_* replaces it.
    interval: Mapping[str, Any] = {}
    # The pydantic model of its OPTIONS (config only): unknown keys and wrong types are errors
    # naming CALLBACKS.<i>.OPTIONS.<key>, and the generated reference documents the fields.
    Options: ClassVar[type[BaseModel] | None] = None

    def on_setup(self, run: RunContext) -> None:
        """Every process, at the end of the Trainer's construction: the model and optimizer are
        prepared, no checkpoint is loaded yet. Register state that holds tensors here
        (``run.register_state(name, obj)``: saved as safetensors and JSON, never pickled), as
        ``ema`` does; ``state_dict`` below takes the same values, without tensors."""

    def on_fit_start(self, run: RunContext) -> None:
        """Every process, once the run is set up (and resumed), before its first step."""

    def on_step_end(self, run: RunContext, step: int) -> None:
        """Every process, after optimizer step ``step`` (the global step just completed), at the
        steps of ``interval``."""

    def on_validation_end(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        """Every process, after the validation passes at ``step`` (``metrics``: all of them), before
        they are logged: entries a callback adds (``val_ema/loss``) go into the same record, the
        console line and the checkpoint ranking."""

    def on_checkpoint(self, run: RunContext, step: int, path: Path) -> None:
        """Main process only: the checkpoint of ``step`` at ``path`` is committed."""

    def on_fit_end(self, run: RunContext, summary: dict[str, Any]) -> None:
        """Every process, when the run ends (completed, stopped early or preempted; not on failure)."""

    @property
    def finished(self) -> bool:
        """True once the callback wants no more ``on_step_end`` calls in this run (``profile``
        after its range): the loop stops asking."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (from the newest checkpoint, on resume)."""


CALLBACKS: Registry[type[Callback]] = Registry(
    "callback",
    "CALLBACKS.<i>.NAME",
    "linnaeus_accel.register_callback",
    {  # built-in callbacks, imported when first named
        "ema": "linnaeus_accel.callbacks.ema",
        "lm_samples": "linnaeus_accel.callbacks.lm_samples",
        "profile": "linnaeus_accel.callbacks.profile",
    },
)
register_callback = CALLBACKS.register


def build_callbacks(entries: Sequence[CallbackConfig]) -> list[Callback]:
    """The callbacks of the ``CALLBACKS`` entries, in order; one ``ConfigError`` with every problem."""
    built: list[Callback] = []
    problems: list[tuple[str, str]] = []
    for i, entry in enumerate(entries):
        key = f"CALLBACKS.{i}"
        try:
            cls = CALLBACKS.get(entry.NAME)
        except ConfigError as exc:
            problems += [(f"{key}.NAME", message) for _, message in exc.problems]
            continue
        options, option_problems = _options(cls, entry.OPTIONS, f"{key}.OPTIONS")
        if option_problems:
            problems += option_problems
            continue
        try:
            callback = cls(**options)
        except (TypeError, ValueError) as exc:
            problems.append((f"{key}.OPTIONS", f"{entry.NAME}: {exc}"))
            continue
        given = {k: v for k, v in entry.model_dump().items() if k.startswith("INTERVAL_") and v is not None}
        if given:
            callback.interval = given
        built.append(callback)
    if problems:
        raise ConfigError(problems)
    return built


def _options(
    cls: type[Callback], options: dict[str, Any], key: str
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    if cls.Options is not None:
        try:
            return cls.Options.model_validate(options).model_dump(by_alias=True), []
        except ValidationError as exc:
            return {}, [
                (".".join([key, *map(str, err["loc"])]), err["msg"]) for err in exc.errors(include_url=False)
            ]
    accepted = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            takes = ", ".join(accepted) or "none"
            return {}, [
                (f"{key}.{name}", f"{cls.__name__} takes no option {name!r} (it takes: {takes})")
                for name in unknown
            ]
    return options, []


def callback_entries(callbacks: Sequence[Callback], names: Sequence[str]) -> list[CallbackConfig]:
    """``CALLBACKS`` entries that say when each callback's on_step_end runs (for the plan)."""
    entries = []
    for callback, name in zip(callbacks, names, strict=True):
        try:
            entries.append(CallbackConfig.model_validate({"NAME": name, **dict(callback.interval)}))
        except (ValidationError, ConfigError) as exc:
            raise ConfigError([(f"{type(callback).__name__}.interval", str(exc))]) from None
    return entries


def callback_name(callback: Callback) -> str:
    """The name a callback is listed under: its registered name, else its class name."""
    return CALLBACKS.name_of(type(callback)) or type(callback).__name__
