"""Reading a config: YAML files (with ``BASE`` inheritance), ``--opts`` overrides, validation.

Every problem of a config is reported in one :class:`ConfigError`, each line naming its dotted key.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, BaseModel, ValidationError

from .base import PRUNED, RULES_ERROR_TYPE, Problem
from .provenance import collision_hint, sources
from .root import Config


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 (PyYAML) reads ``1e-3`` as a string; learning rates are written that way, so
    numbers with an exponent and no dot are floats here, as in YAML 1.2."""


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader: no arbitrary objects


class ConfigError(Exception):
    """A config that cannot be used; ``problems`` holds (dotted key, message) pairs."""

    def __init__(self, problems: Sequence[tuple[str, str]], source: str = "config") -> None:
        self.problems = list(problems)
        lines = [
            f"  {msg}" if not key or msg.startswith(key) else f"  {key}: {msg}" for key, msg in self.problems
        ]
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"invalid {source} ({len(self.problems)} {noun}):\n" + "\n".join(lines))


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Load a YAML config; ``BASE: [paths]`` (relative to the file) are merged underneath it."""
    path = Path(path).expanduser().resolve()
    if path in _seen:
        raise ConfigError([("BASE", f"{path} includes itself through BASE")], source=str(path))
    try:
        with path.open(encoding="utf-8") as f:
            data = parse_yaml(f.read())
    except OSError as exc:
        raise ConfigError([("", f"cannot read {path}: {exc.strerror}")], source="--cfg") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [("", f"{path} is not UTF-8 text (byte {exc.start}): save the config as UTF-8")], source="--cfg"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", f"{path} is not valid YAML: {exc}")], source="--cfg") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError([("", f"{path} must hold a mapping of UPPERCASE sections")], source="--cfg")
    data = data or {}
    merged: dict[str, Any] = {}
    for base in _base_paths(data.pop("BASE", None), path):
        merged = deep_merge(merged, read_yaml(path.parent / base, (*_seen, path)))
    merged = deep_merge(merged, data)
    if not merged:
        # Every default on its own is never a real run: most likely the wrong file, or one whose
        # content was lost.
        raise ConfigError(
            [
                (
                    "",
                    f"{path} sets nothing (it is empty, holds only comments or an empty BASE): give at "
                    "least one section, e.g. BASE: [default.yaml] and the keys that differ",
                )
            ],
            source="--cfg",
        )
    return merged


def _base_paths(bases: Any, source: str | Path) -> list[str]:
    """The files a ``BASE`` names: one path or a list of them (null, "" or [] for none)."""
    if bases is None or bases == "":
        return []
    items = [bases] if isinstance(bases, (str, Path)) else bases
    if not isinstance(items, list) or not all(isinstance(b, (str, Path)) for b in items):
        raise ConfigError(
            [
                (
                    "BASE",
                    f"must be a file path or a list of them, relative to the config (got {bases!r}), "
                    "e.g. BASE: [default.yaml]",
                )
            ],
            source=str(source),
        )
    return [str(b) for b in items if str(b)]


# A section's OPTIONS belong to the builder its NAME (TYPE) names: another one starts afresh.
_NAMING_KEYS = ("NAME", "TYPE")


def _renamed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``new`` names another builder than ``old`` does (then ``old``'s OPTIONS do not apply)."""
    return any(k in new and k in old and new[k] != old[k] for k in _NAMING_KEYS)


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``, mappings merged key by key; but OPTIONS are not merged across a
    change of NAME (TYPE): a mixture given over a token_files base must not inherit its ``paths``."""
    out = copy.deepcopy(dict(base))
    renamed = _renamed(out, override)
    if renamed:
        out.pop("OPTIONS", None)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_opts(data: dict[str, Any], opts: Sequence[str]) -> dict[str, Any]:
    """linnaeus' ``--opts KEY VALUE ...``: dotted keys, each VALUE read as YAML, exactly as the same
    value after ``KEY:`` in a file. So ``null`` is YAML null, as in a file: no scaling for
    ``LR_SCHEDULER.REFERENCE_BS``, no clipping for ``TRAIN.CLIP_GRAD``, an unset unit for ``*_STEPS``.

    There is deliberately no "back to the default" spelling: it would give null a second meaning
    (linnaeus' did, so ``REFERENCE_BS null`` could not turn scaling off from the command line), and
    every default is in docs/config.md, so writing it out says the same thing explicitly. A mapping
    value merges into the section, as a file given after the config would; naming another dataset
    or model (``DATA.DATASET.NAME``, ``MODEL.TYPE``) drops the OPTIONS of the one named before.
    """
    if len(opts) % 2:
        glued = next((o for o in opts if "=" in o and o.split("=", 1)[0].isupper()), None)
        hint = (
            f": write {glued.split('=', 1)[0]} {glued.split('=', 1)[1]} (KEY and VALUE separated by a space, not =)"
            if glued is not None
            else ""
        )
        raise ConfigError(
            [("", f"--opts takes KEY VALUE pairs; {opts[-1]!r} has no value{hint}")], source="--opts"
        )
    out = copy.deepcopy(data)
    for key, raw in zip(opts[::2], opts[1::2], strict=True):
        try:
            value = parse_yaml(raw)
        except yaml.YAMLError:
            value = raw
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    [(key, f"{part} is not a section, so it has no key {leaf}")], source="--opts"
                )
            node = child
        old = node.get(leaf)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            value = deep_merge(old, value)
        elif leaf in _NAMING_KEYS and leaf in node and node[leaf] != value:
            node.pop("OPTIONS", None)  # the options of the builder named before
        node[leaf] = value
    return out


def load_config(cfg: str | Path | Mapping[str, Any] | None = None, opts: Sequence[str] = ()) -> Config:
    """A validated config from a YAML file or from a dict of the same sections (its ``BASE``
    files relative to the working directory), then ``opts`` overrides (``KEY VALUE`` pairs)."""
    if cfg is None:
        data: dict[str, Any] = {}
    elif isinstance(cfg, Mapping):
        data = copy.deepcopy(dict(cfg))
        merged: dict[str, Any] = {}
        for base in _base_paths(data.pop("BASE", None), "config"):
            merged = deep_merge(merged, read_yaml(base))
        data = deep_merge(merged, data)
    else:
        data = read_yaml(cfg)
    try:
        return validate_config(apply_opts(data, opts))
    except ConfigError as exc:
        raise _with_sources(exc, cfg, opts) from None


def _with_sources(
    exc: ConfigError, cfg: str | Path | Mapping[str, Any] | None, opts: Sequence[str]
) -> ConfigError:
    """``exc`` with, for each pair of keys that may not be set together, the file that set each one
    when one was inherited through BASE, and how to unset it."""
    if not any(", " in key and "set together" in msg for key, msg in exc.problems):
        return exc
    origin = sources(cfg, opts)
    top = (
        "the config given"
        if isinstance(cfg, Mapping)
        else str(Path(cfg).expanduser().resolve())
        if cfg
        else ""
    )
    problems = [
        (
            key,
            msg + collision_hint(key.split(", "), origin, top)
            if ", " in key and "set together" in msg
            else msg,
        )
        for key, msg in exc.problems
    ]
    return ConfigError(problems, source="config")


def validate_config(data: Mapping[str, Any]) -> Config:
    """Validate, reporting every problem at once.

    pydantic stops checking a section's cross-field rules (and the cross-section rules) as soon as
    one of its fields is invalid. So after each pass the offending values are replaced by a marker
    (``PRUNED``: the field takes its default but still counts as given) and the config is
    validated again, until nothing new turns up.
    """
    pruned = copy.deepcopy(dict(data))
    problems: dict[tuple[str, str], None] = {}
    for _ in range(_MAX_PASSES):
        try:
            config = Config.model_validate(pruned)
        except ValidationError as exc:
            found = _pydantic_problems(exc, pruned)
        else:
            if not problems:
                return config
            break
        progress = False
        for key, message, delete, prune in found:
            problems.setdefault((key, message), None)
            changed = _apply(pruned, delete, delete=True) or _apply(pruned, prune, delete=False)
            progress |= changed
        if not progress:
            break
    raise ConfigError(sorted(problems))


_MAX_PASSES = 10


def _apply(data: dict[str, Any], paths: list[tuple[str, ...]], delete: bool) -> bool:
    changed = False
    for path in paths:  # every path, no short-circuit
        changed |= _set_path(data, path, delete)
    return changed


def _set_path(data: dict[str, Any], path: tuple[str, ...], delete: bool) -> bool:
    """Mark ``path`` as pruned (or delete an unknown key); False when nothing changed.

    An invalid list item prunes the whole list: items have no defaults to fall back on.
    """
    node: Any = data
    owner: dict[str, Any] | None = None
    owner_key = ""
    for part in path[:-1]:
        if isinstance(node, dict):
            owner, owner_key = node, part
            node = node.setdefault(part, {}) if not delete else node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            break
    leaf = path[-1] if path else ""
    if isinstance(node, dict) and path:
        if delete:
            return node.pop(leaf, PRUNED) is not PRUNED
        if node.get(leaf, None) is PRUNED:
            return False
        node[leaf] = PRUNED
        return True
    if owner is not None and not delete and owner.get(owner_key) is not PRUNED:
        owner[owner_key] = PRUNED
        return True
    return False


# (dotted key, message, paths to delete before the next pass, paths to mark PRUNED if deleting
# changed nothing)
Found = tuple[str, str, list[tuple[str, ...]], list[tuple[str, ...]]]


def _pydantic_problems(exc: ValidationError, data: Mapping[str, Any]) -> list[Found]:
    out: list[Found] = []
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"])
        key = ".".join(loc)
        if err["type"] == RULES_ERROR_TYPE:
            problems: list[Problem] = err["ctx"]["problems"]
            for p in problems:
                keys = tuple(f"{key}.{k}" if key else k for k in p.keys)
                paths = [tuple(k.split(".")) for k in keys]
                # The one-unit rule stops firing once its extra keys are gone (or, when a required
                # unit is missing, once it is marked given); other rules go quiet on PRUNED keys.
                delete, prune = (paths, paths[:1]) if p.counts_pruned else ([], paths)
                out.append((", ".join(keys), p.render(key)[1], delete, prune))
        elif err["type"] == "extra_forbidden":
            out.append((key, _unknown_key_message(err["loc"], data), [loc], []))
        elif err["input"] is None and loc and not err["msg"].startswith("Value error, "):
            out.append((key, _null_message(err["loc"]), [], [loc]))
        elif err["type"] == "model_type" and loc:
            out.append((key, f"must be a mapping of keys, got {err['input']!r}", [], [loc]))
        else:
            # Our own validators' messages already say what was given; pydantic's do not.
            ours = err["msg"].startswith("Value error, ")
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg if ours else f"{msg} (got {err['input']!r})"
            fraction = isinstance(err["input"], float) and not float(err["input"]).is_integer()
            out.append((key, msg + _WHOLE_UNITS.get(key, "") if fraction else msg, [], [loc]))
    return out


# A fraction where whole units are counted: how to say it.
_WHOLE_UNITS = {
    "TRAIN.EPOCHS": ": a run of part of an epoch is counted in steps: set TRAIN.STEPS (and TRAIN.EPOCHS: null)",
}
# Keys users bring from other trainers, and where the same thing is said here.
_ELSEWHERE = {
    "TRAIN.LEARNING_RATE": "LR_SCHEDULER.BASE_LR (the peak learning rate)",
    "TRAIN.LR": "LR_SCHEDULER.BASE_LR (the peak learning rate)",
    "TRAIN.BASE_LR": "LR_SCHEDULER.BASE_LR (the peak learning rate)",
    "OPTIMIZER.LR": "LR_SCHEDULER.BASE_LR (the peak learning rate)",
    "OPTIMIZER.LEARNING_RATE": "LR_SCHEDULER.BASE_LR (the peak learning rate)",
    "TRAIN.WARMUP_STEPS": "LR_SCHEDULER.WARMUP_STEPS",
    "TRAIN.WEIGHT_DECAY": "OPTIMIZER.WEIGHT_DECAY",
    "TRAIN.BATCH_SIZE": "DATA.BATCH_SIZE (per process)",
    "TRAIN.SEED": "EXPERIMENT.SEED",
    "TRAIN.MAX_STEPS": "TRAIN.STEPS (the run's length) or TRAIN.EARLY_STOP.MAX_STEPS (a cut-off)",
    "TRAIN.GRADIENT_ACCUMULATION_STEPS": "TRAIN.ACCUMULATION_STEPS",
}


def _null_message(loc: tuple[int | str, ...]) -> str:
    """Why ``KEY: null`` is refused where null has no meaning, and what to write instead."""
    model = _model_at(loc[:-1])
    name = _field_name(model, str(loc[-1])) if model is not None else None
    if model is None or name is None:
        return "cannot be null here: give a value"
    field = model.model_fields[name]
    if _model_of(field.annotation) is not None and not str(field.annotation).startswith("list"):
        return "cannot be null: it is a section; give its keys, or leave it out for its defaults"
    default = yaml.safe_dump(field.get_default(call_default_factory=True), default_flow_style=True)
    default = default.strip().removesuffix("...").strip()
    return (
        f"cannot be null (this key has no off or automatic setting): give a value; its default is {default}"
    )


def _model_at(loc: tuple[int | str, ...]) -> Any:
    """The section model at ``loc`` (a path of keys and list indices from the root), or None."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int) or str(part).isdigit():
            continue  # a list item: the element model was already taken from list[...]
        name = _field_name(model, str(part))
        model = _model_of(model.model_fields[name].annotation) if name else None
        if model is None:
            return None
    return model


def _unknown_key_message(loc: tuple[int | str, ...], data: Mapping[str, Any]) -> str:
    dotted = ".".join(str(part) for part in loc)
    if dotted in _ELSEWHERE:
        return f"unknown key: this is {_ELSEWHERE[dotted]} here"
    model = _model_at(loc[:-1])
    if model is None:
        return "unknown key"
    leaf = str(loc[-1])
    name = _field_name(model, leaf)
    if name is not None:
        # An alternative spelling of a field whose main spelling is also given.
        return f"{leaf} and {name} are two spellings of the same key: keep only {name}"
    known = list(model.model_fields)
    guess = difflib.get_close_matches(leaf, known, n=1)
    hint = f"; did you mean {guess[0]}?" if guess else f"; known keys: {', '.join(known)}"
    return f"unknown key{hint}"


def _field_name(model: Any, key: str) -> str | None:
    """The field that ``key`` names, by its name or one of its accepted spellings."""
    fields = model.model_fields
    if key in fields:
        return key
    for name, field in fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices) and key in alias.choices:
            return str(name)
    return None


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside an annotation such as ``X``, ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None
