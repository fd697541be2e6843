"""Building blocks shared by every config section.

Sections are frozen pydantic models with ``extra="forbid"`` so a misspelt key is an error that
names it. Rules that involve several fields of one section are collected by a validator into one
``config_rules`` error carrying every problem, each with the keys it concerns; the loader turns
them into fully qualified dotted keys (see ``loading.format_problems``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, cast, overload

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    model_validator,
)
from pydantic._internal._model_construction import ModelMetaclass
from pydantic_core import PydanticCustomError

from .duration import UNITS, Duration, Unit

RULES_ERROR_TYPE = "config_rules"


@dataclass(frozen=True)
class Problem:
    """One broken rule: the keys involved (relative to the section) and what to do about it.

    ``message`` may refer to the keys as ``{0}``, ``{1}``, ... so that the final text names them
    with their full dotted path.
    """

    keys: tuple[str, ...]
    message: str
    # The one-unit rule counts a pruned key as given; other rules are silent about pruned keys,
    # whose stand-in defaults are not what the user wrote.
    counts_pruned: bool = False

    def render(self, prefix: str = "") -> tuple[str, str]:
        full = [f"{prefix}.{k}" if prefix else k for k in self.keys]
        return ", ".join(full), self.message.format(*full)


def raise_if_problems(problems: Sequence[Problem]) -> None:
    if problems:
        summary = "; ".join(p.render()[1] for p in problems)
        raise PydanticCustomError(RULES_ERROR_TYPE, summary, {"problems": list(problems)})


class _Pruned:
    """Stands in for a value the loader already reported as invalid (see ``loading``): the field
    takes its default, but still counts as given for the one-unit rule, so that the next pass
    reports the section's other problems without inventing new ones."""

    def __repr__(self) -> str:
        return "<pruned>"


PRUNED = _Pruned()


class Timed:
    """One timed parameter, declared once in a section's body::

        WARMUP: ClassVar[Timed] = timed(steps="...", fraction="...", epochs="...")

    declares the keys ``WARMUP_STEPS``, ``WARMUP_FRACTION`` and ``WARMUP_EPOCHS`` there, in the
    order the units are given (the order error messages name them in), each with its description;
    every section checks that at most one of them is set. ``section.WARMUP`` is the
    :class:`Duration` of the one that is set, or None; ``SectionClass.WARMUP`` this declaration.
    """

    def __init__(self, units: Mapping[Unit, tuple[str, Any, str]], stem: str = "") -> None:
        self.units = dict(units)  # unit -> (key suffix, annotation, description), in the order given
        self.stem = stem
        self.keys = {unit: f"{stem}_{suffix}" for unit, (suffix, _, _) in self.units.items()}

    def values(self, section: BaseModel) -> dict[Unit, float]:
        """The units that are set in ``section``, with their values."""
        return {u: value for u, key in self.keys.items() if (value := getattr(section, key)) is not None}

    @overload
    def __get__(self, section: None, owner: type) -> Timed: ...
    @overload
    def __get__(self, section: BaseModel, owner: type) -> Duration | None: ...
    def __get__(self, section: BaseModel | None, owner: type) -> Timed | Duration | None:
        if section is None:
            return self
        # A validated section has at most one unit set.
        return next((Duration(value, unit) for unit, value in self.values(section).items()), None)

    def given(self, section: BaseModel) -> list[str]:
        """The keys set in ``section``; a pruned key (already reported invalid) counts as given."""
        pruned = section._pruned if isinstance(section, Section) else frozenset()
        return [k for k in self.keys.values() if getattr(section, k) is not None or k in pruned]

    def problems(self, section: BaseModel) -> list[Problem]:
        """The "exactly one unit per timed parameter" rule (docs/semantics.md, section 2)."""
        given, choices = self.given(section), ", ".join(self.keys.values())
        if len(given) < 2:
            return []
        refs = " and ".join(f"{{{i}}}" for i in range(len(given)))
        message = f"{refs} are set together: keep exactly one of {choices}"
        return [Problem(tuple(given), message, counts_pruned=True)]

    def required(self, section: BaseModel, because: str) -> list[Problem]:
        """The parameter must be given (``because`` says when and why)."""
        if self.given(section):
            return []
        first, choices = next(iter(self.keys.values())), ", ".join(self.keys.values())
        return [Problem((first,), f"{{0}} (or one of {choices}) is required {because}")]


@functools.cache
def timed_parameters(model: type[BaseModel]) -> dict[str, Timed]:
    """The timed parameters of a section class, its bases' first, by stem."""
    found = (item for klass in reversed(model.__mro__) for item in vars(klass).items())
    return {name: value for name, value in found if isinstance(value, Timed)}


class _SectionMeta(ModelMetaclass):
    """Expands each ``Timed`` declaration of a section's body into its unit fields, where it is
    written, before pydantic collects the fields: their order is the reference's and the dumps'."""

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> type:
        expanded: dict[str, Any] = {}
        for field, annotation in namespace.get("__annotations__", {}).items():
            expanded[field] = annotation
            if isinstance(spec := namespace.get(field), Timed):
                namespace[field] = spec = Timed(spec.units, stem=field)
                for unit, (_, unit_annotation, description) in spec.units.items():
                    expanded[spec.keys[unit]] = unit_annotation | None
                    namespace[spec.keys[unit]] = Field(None, description=description)
        namespace["__annotations__"] = expanded
        return super().__new__(mcs, name, bases, namespace, **kwargs)


class Section(BaseModel, metaclass=_SectionMeta):
    """Base of every config section: unknown keys are errors, values are immutable once loaded.

    Rules that involve several fields live in ``problems()``; all of a section's problems are
    raised together as one ``config_rules`` error.
    """

    # strict: YAML already gives real types, so `true` for a count or "5" for a number is a mistake.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)
    _pruned: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="wrap")
    @classmethod
    def _check_rules(cls, data: Any, handler: ModelWrapValidatorHandler[Section]) -> Section:
        pruned: frozenset[str] = frozenset()
        if isinstance(data, dict) and any(v is PRUNED for v in data.values()):
            pruned = frozenset(k for k, v in data.items() if v is PRUNED)
            data = {k: v for k, v in data.items() if v is not PRUNED}
        model = handler(data)
        model._pruned = pruned
        silent = model.pruned_paths()
        problems = [p for spec in timed_parameters(type(model)).values() for p in spec.problems(model)]
        problems += model.problems()
        raise_if_problems([p for p in problems if p.counts_pruned or not silent.intersection(p.keys)])
        return model

    def pruned_paths(self) -> set[str]:
        """Dotted keys (relative to this section) that stand for values already reported."""
        out = set(self._pruned)
        for name in type(self).model_fields:
            value = getattr(self, name)
            children = value if isinstance(value, list) else [value]
            for i, child in enumerate(children):
                if isinstance(child, Section):
                    where = f"{name}.{i}" if isinstance(value, list) else name
                    out |= {f"{where}.{k}" for k in child.pruned_paths()}
        return out

    def problems(self) -> list[Problem]:
        """Cross-field rules of this section; each problem names its keys and the fix."""
        return []


_F = TypeVar("_F", bound=Callable[..., Any])

# What each value check accepts, in words: the "type" column of the generated reference
# (docs/config.md, see ``reference``).
RULE_NAMES: dict[Callable[..., Any], str] = {}


def accepts(words: str) -> Callable[[_F], _F]:
    """Records what the decorated value check accepts, for the generated reference."""

    def record(check: _F) -> _F:
        RULE_NAMES[check] = words
        return check

    return record


@accepts("number in [0, 1]")
def _check_fraction(value: float) -> float:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a fraction of training between 0 and 1 (got {value})")
    return value


@accepts("probability in [0, 1]")
def _check_probability(value: float) -> float:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a probability between 0 and 1 (got {value})")
    return value


@accepts("number >= 0")
def _check_non_negative(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"must be a finite number >= 0 (got {value})")
    return value


@accepts("number > 0")
def _check_positive(value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a finite number > 0 (got {value})")
    return value


@accepts("number in (0, 1]")
def _check_decay_rate(value: float) -> float:
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ValueError(
            f"must be in (0, 1]: the step schedule multiplies the LR by it every period (got {value})"
        )
    return value


@accepts("integer >= 1")
def _check_positive_int(value: int) -> int:
    if value < 1:
        raise ValueError(f"must be an integer >= 1 (got {value})")
    return value


@accepts("integer >= 1")
def _check_interval(value: int) -> int:
    if value < 1:
        raise ValueError(f"must be an integer >= 1 (got {value}); leave it unset (null) to disable")
    return value


@accepts("integer >= 0")
def _check_non_negative_int(value: int) -> int:
    if value < 0:
        raise ValueError(f"must be an integer >= 0 (got {value})")
    return value


def at_most(limit: int, why: str) -> AfterValidator:
    """An upper bound for a count where a larger value can only be a mistake (a typo, a value in
    the wrong unit); ``why`` tells the user what the bound protects."""

    @accepts(f"at most {limit:,}")
    def check(value: int) -> int:
        if value > limit:
            raise ValueError(f"must be at most {limit:,} (got {value:,}): {why}")
        return value

    return AfterValidator(check)


Fraction = Annotated[float, AfterValidator(_check_fraction)]
Probability = Annotated[float, AfterValidator(_check_probability)]
NonNegativeFloat = Annotated[float, AfterValidator(_check_non_negative)]
PositiveFloat = Annotated[float, AfterValidator(_check_positive)]
DecayRate = Annotated[float, AfterValidator(_check_decay_rate)]
PositiveInt = Annotated[int, AfterValidator(_check_positive_int)]
NonNegativeInt = Annotated[int, AfterValidator(_check_non_negative_int)]
# An optional count of steps or epochs, where "off" is spelled null, not 0.
StepsOrOff = Annotated[int, AfterValidator(_check_interval)]


def _timed(types: tuple[Any, Any, Any], descriptions: dict[str, str], steps_suffix: str = "STEPS") -> Timed:
    """The keys of the units ``descriptions`` names (steps, fraction, epochs), in its order."""
    suffixes = (steps_suffix, "FRACTION", "EPOCHS")
    kinds: dict[str, tuple[str, Any]] = dict(zip(UNITS, zip(suffixes, types, strict=True), strict=True))
    return Timed({cast(Unit, unit): (*kinds[unit], text) for unit, text in descriptions.items()})


def timed(**descriptions: str) -> Timed:
    """A duration or position (>= 0): steps, a fraction of the run, or (fractional) epochs."""
    return _timed((NonNegativeInt, Fraction, NonNegativeFloat), descriptions)


def period(**descriptions: str) -> Timed:
    """A period (> 0), such as the step schedule's decay period."""
    return _timed((PositiveInt, Fraction, PositiveFloat), descriptions)


def interval(*, steps_suffix: str = "STEPS", **descriptions: str) -> Timed:
    """An event's interval: whole steps or epochs (null, not 0, is off), or a fraction (0: never)."""
    return _timed((StepsOrOff, Fraction, StepsOrOff), descriptions, steps_suffix)


def canonical_metric_name(name: str) -> str:
    """'val_loss' -> 'val/loss' (linnaeus' spelling); names that already contain '/' are kept."""
    if "/" not in name and name.startswith("val_"):
        return "val/" + name[len("val_") :]
    return name
