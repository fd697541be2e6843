"""Reading a built-in dataset's ``OPTIONS``: every problem reported at once, each naming its key.

options = DatasetOptions("token_files", config.DATA.DATASET.OPTIONS, "DATA.DATASET.OPTIONS")
seq_len = options.integer("seq_len", default=1024, minimum=2)
paths = options.strings("paths", required=True)
options.finish()  # raises one ConfigError: every problem, and every key the dataset does not take
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..config import ConfigError

_MISSING = object()


class DatasetOptions:
    def __init__(self, dataset: str, options: Mapping[str, Any], key: str) -> None:
        self.dataset, self.options, self.key = dataset, dict(options), key
        self.taken: list[str] = []
        self.problems: list[tuple[str, str]] = []

    def _get(self, name: str, required: bool) -> Any:
        self.taken.append(name)
        value = self.options.get(name, _MISSING)
        if value is _MISSING and required:
            self.problem(name, "is required")
        return value

    def problem(self, name: str, message: str) -> None:
        self.problems.append((f"{self.key}.{name}", f"{self.dataset}: {message}"))

    def integer(self, name: str, default: int | None = None, minimum: int | None = None) -> Any:
        value = self._get(name, required=False)
        if value is _MISSING or value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            bound = f" of at least {minimum}" if minimum is not None else ""
            self.problem(name, f"must be an integer{bound}, got {value!r}")
            return default
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self._get(name, required=False)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, bool):
            self.problem(name, f"must be true or false, got {value!r}")
            return default
        return value

    def text(self, name: str, default: str | None = None, choices: Sequence[str] | None = None) -> Any:
        value = self._get(name, required=False)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, str) or (choices is not None and value not in choices):
            expected = f"one of {', '.join(choices)}" if choices is not None else "a string"
            self.problem(name, f"must be {expected}, got {value!r}")
            return default
        return value

    def strings(self, name: str, required: bool = False) -> list[str] | None:
        """A string or a list of strings (a single path may be written without a list)."""
        value = self._get(name, required)
        if value is _MISSING or value is None:
            return None
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
            self.problem(name, f"must be a non-empty string or list of strings, got {value!r}")
            return None
        return list(values)

    def raw(self, name: str, required: bool = False) -> Any:
        value = self._get(name, required)
        return None if value is _MISSING else value

    def finish(self) -> None:
        unknown = sorted(set(self.options) - set(self.taken))
        if unknown:
            self.problems.append(
                (
                    self.key,
                    f"{self.dataset} takes {', '.join(sorted(set(self.taken)))}; not {', '.join(unknown)}",
                )
            )
        if self.problems:
            raise ConfigError(self.problems)
