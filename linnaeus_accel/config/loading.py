"""Reading a config: YAML files (with ``BASE`` inheritance), ``--opts`` overrides, validation.

Every problem of a config is reported in one :class:`ConfigError`, each line naming its dotted key.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .base import RULES_ERROR_TYPE, Problem
from .root import Config


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
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError([("", f"cannot read {path}: {exc.strerror}")], source="--cfg") from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", f"{path} is not valid YAML: {exc}")], source="--cfg") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"{path} must hold a mapping of UPPERCASE sections")], source="--cfg")
    bases = data.pop("BASE", None) or []
    if isinstance(bases, str):
        bases = [bases]
    merged: dict[str, Any] = {}
    for base in bases:
        if base:
            merged = deep_merge(merged, read_yaml(path.parent / base, (*_seen, path)))
    return deep_merge(merged, data)


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_opts(data: dict[str, Any], opts: Sequence[str]) -> dict[str, Any]:
    """linnaeus' ``--opts KEY VALUE ...``: dotted keys, YAML scalar values, ``null`` unsets a key."""
    if len(opts) % 2:
        raise ConfigError([("", f"--opts takes KEY VALUE pairs; {opts[-1]!r} has no value")], source="--opts")
    out = copy.deepcopy(data)
    for key, raw in zip(opts[::2], opts[1::2], strict=True):
        try:
            value = yaml.safe_load(raw)
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
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


def load_config(cfg: str | Path | None = None, opts: Sequence[str] = ()) -> Config:
    data = read_yaml(cfg) if cfg is not None else {}
    return validate_config(apply_opts(data, opts))


def validate_config(data: Mapping[str, Any]) -> Config:
    """Validate, reporting every problem at once.

    pydantic stops checking a section's cross-field rules (and the cross-section rules) as soon as
    one of its fields is invalid. So after each pass the offending keys are pruned back to their
    defaults and the config is validated again, until nothing new turns up; problems about keys
    already reported are not repeated.
    """
    pruned = copy.deepcopy(dict(data))
    problems: list[tuple[str, str]] = []
    reported: set[str] = set()
    for _ in range(_MAX_PASSES):
        try:
            config = Config.model_validate(pruned)
        except ValidationError as exc:
            found = _pydantic_problems(exc)
        else:
            if not problems:
                return config
            break
        progress = False
        new_keys: set[str] = set()
        for keys, message, prune, fallback in found:
            if not reported.intersection(keys):
                problems.append((", ".join(keys), message))
                new_keys.update(keys)
            deleted = [_delete(pruned, path) for path in prune]
            if not any(deleted) and fallback:
                deleted.append(_delete(pruned, fallback))
            progress |= any(deleted)
        reported |= new_keys
        if not progress:
            break
    raise ConfigError(sorted(set(problems)))


_MAX_PASSES = 8


def _delete(data: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = data
    for part in path[:-1]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    if isinstance(node, dict) and path and path[-1] in node:
        del node[path[-1]]
        return True
    if isinstance(node, list) and path and path[-1].isdigit() and int(path[-1]) < len(node):
        node[int(path[-1])] = {}
        return True
    return False


# (keys it concerns, message, paths to prune so that the next pass can check the rest, and what to
# prune instead when none of those exist, e.g. a required key that is missing)
Found = tuple[tuple[str, ...], str, list[tuple[str, ...]], tuple[str, ...]]


def _pydantic_problems(exc: ValidationError) -> list[Found]:
    out: list[Found] = []
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"])
        key = ".".join(loc)
        if err["type"] == RULES_ERROR_TYPE:
            problems: list[Problem] = err["ctx"]["problems"]
            for p in problems:
                keys = tuple(f"{key}.{k}" if key else k for k in p.keys)
                paths = [tuple(k.split(".")) for k in keys]
                out.append((keys, p.render(key)[1], paths, loc))
        elif err["type"] == "extra_forbidden":
            out.append(((key,), _unknown_key_message(err["loc"]), [loc], ()))
        elif err["type"] == "model_type" and loc:
            out.append(((key,), f"must be a mapping of keys, got {err['input']!r}", [loc], ()))
        else:
            # Our own validators' messages already say what was given; pydantic's do not.
            ours = err["msg"].startswith("Value error, ")
            msg = err["msg"].removeprefix("Value error, ")
            out.append(((key,), msg if ours else f"{msg} (got {err['input']!r})", [loc], ()))
    return out


def _unknown_key_message(loc: tuple[int | str, ...]) -> str:
    model: Any = Config
    for part in loc[:-1]:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            model = None
            break
        model = _model_of(fields[part].annotation)
    known = list(getattr(model, "model_fields", {}) or [])
    guess = difflib.get_close_matches(str(loc[-1]), known, n=1)
    hint = f"; did you mean {guess[0]}?" if guess else (f"; known keys: {', '.join(known)}" if known else "")
    return f"unknown key{hint}"


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
