"""Builders by name, extensible from a user's own script with a decorator.

Built-in entries live in modules imported only when first asked for, so that commands that do not
need them (``plan --dataset-size``) stay fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

from .config import ConfigError

B = TypeVar("B", bound=Callable[..., object])


class Registry(Generic[B]):
    def __init__(self, what: str, config_key: str, decorator: str, builtin_modules: dict[str, str]) -> None:
        self.what = what  # "dataset", "model"
        self.config_key = config_key  # the key that names an entry, for errors
        self.decorator = decorator  # how users register, for errors
        self._builtin_modules = builtin_modules
        self._builders: dict[str, B] = {}

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

    def name_of(self, builder: object) -> str | None:
        """The name ``builder`` is registered under, if it is."""
        return next((name for name, b in self._builders.items() if b is builder), None)
