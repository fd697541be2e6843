"""Builders by name, extensible from a user's own script with a decorator.

Built-in entries live in modules imported only when first asked for, so that commands that do not
need them (``plan --dataset-size``) stay fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .config import ConfigError

B = TypeVar("B", bound=Callable[..., object])
_BY_KIND: dict[str, Registry[Any]] = {}  # each registry by what it holds: lower layers ask by name


def is_registered(what: str, name: str) -> bool:
    """Whether a builder of ``what`` ("optimizer", "model", ...) is registered as ``name`` in this
    process, its built-in modules included (for ``plan``, which builds nothing)."""
    registry = _BY_KIND.get(what)
    return registry is not None and registry.knows(name)


class Registry(Generic[B]):
    def __init__(self, what: str, config_key: str, decorator: str, builtin_modules: dict[str, str]) -> None:
        self.what = what  # "dataset", "model"
        self.config_key = config_key  # the key that names an entry, for errors
        self.decorator = decorator  # how users register, for errors
        self._builtin_modules = builtin_modules
        self._builders: dict[str, B] = {}
        _BY_KIND[what] = self

    def register(self, name: str) -> Callable[[B], B]:
        def decorate(builder: B) -> B:
            self._builders[name] = builder
            return builder

        return decorate

    def get(self, name: str) -> B:
        if name not in self._builders and name in self._builtin_modules:
            importlib.import_module(self._builtin_modules[name])
        if name not in self._builders:
            known = ", ".join(sorted(set(self._builders) | set(self._builtin_modules)))
            raise ConfigError(
                [
                    (
                        self.config_key,
                        f"no {self.what} named {name!r}; known: {known} (register your own with @{self.decorator})",
                    )
                ]
            )
        return self._builders[name]

    def knows(self, name: str) -> bool:
        return name in self._builders or name in self._builtin_modules

    def name_of(self, builder: object) -> str | None:
        """The name ``builder`` is registered under, if it is."""
        return next((name for name, b in self._builders.items() if b is builder), None)
