"""Building blocks shared by every config section.

Sections are frozen pydantic models with ``extra="forbid"`` so a misspelt key is an error that
names it. Rules that involve several fields of one section are collected by a validator into one
``config_rules`` error carrying every problem, each with the keys it concerns; the loader turns
them into fully qualified dotted keys (see ``loading.format_problems``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    PrivateAttr,
    model_validator,
)
from pydantic_core import PydanticCustomError

RULES_ERROR_TYPE = "config_rules"

TIME_UNITS = ("STEPS", "FRACTION", "EPOCHS")


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


class Section(BaseModel):
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
        raise_if_problems([p for p in model.problems() if p.counts_pruned or not silent.intersection(p.keys)])
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


def set_keys(model: BaseModel, stem: str, units: Iterable[str] = TIME_UNITS) -> list[str]:
    """Names of the ``<stem>_<unit>`` fields of ``model`` that are set (not None)."""
    pruned = model._pruned if isinstance(model, Section) else frozenset()
    names = [f"{stem}_{u}" for u in units]
    return [n for n in names if getattr(model, n, None) is not None or n in pruned]


def one_unit_problems(
    model: BaseModel, stem: str, *, units: Iterable[str] = TIME_UNITS, required_because: str | None = None
) -> list[Problem]:
    """The "exactly one unit per timed parameter" rule (SPEC §2) for ``<stem>_{STEPS,...}``.

    With ``required_because`` the parameter must be given; the text says why.
    """
    units = tuple(units)
    given = set_keys(model, stem, units)
    choices = ", ".join(f"{stem}_{u}" for u in units)
    if len(given) > 1:
        refs = " and ".join(f"{{{i}}}" for i in range(len(given)))
        return [
            Problem(
                tuple(given), f"{refs} are set together: keep exactly one of {choices}", counts_pruned=True
            )
        ]
    if not given and required_because:
        return [
            Problem((f"{stem}_{units[0]}",), f"{{0}} (or one of {choices}) is required {required_because}")
        ]
    return []


def merge_problems(*groups: Iterable[Problem]) -> list[Problem]:
    return [p for group in groups for p in group]


def prefixed(prefix: str, problems: Iterable[Problem]) -> list[Problem]:
    """Problems of a nested model, re-keyed relative to its parent."""
    return [Problem(tuple(f"{prefix}.{k}" for k in p.keys), p.message) for p in problems]


def canonical_metric_name(name: str) -> str:
    """'val_loss' -> 'val/loss' (linnaeus' spelling); names that already contain '/' are kept."""
    if "/" not in name and name.startswith("val_"):
        return "val/" + name[len("val_") :]
    return name
