"""Models by name (``MODEL.TYPE``).

Register your own from your training script::

    from linnaeus_accel.models import register_model

    @register_model("my_net")
    def build_my_net(config, dataset):     # dataset: the training dataset
        return MyNet(...)                  # forward(batch) -> list of logits, one per label level

A model takes the whole batch dict (``image``, ``meta``, ``labels``, ``index``) and returns one
logits tensor per label level, coarse to fine, so that the hierarchical loss and the validation
metrics can treat every model alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config

ModelBuilder = Callable[["Config", Any], "nn.Module"]

_MODELS: dict[str, ModelBuilder] = {}
_BUILTIN_MODULES = {"digits_mlp": "linnaeus_accel.models.digits"}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    def decorate(builder: ModelBuilder) -> ModelBuilder:
        _MODELS[name] = builder
        return builder

    return decorate


def build_model(config: Config, dataset: Any) -> nn.Module:
    name = config.MODEL.TYPE
    if name not in _MODELS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _MODELS:
        known = ", ".join(sorted(set(_MODELS) | set(_BUILTIN_MODULES)))
        raise ConfigError(
            [
                (
                    "MODEL.TYPE",
                    f"no model named {name!r}; known: {known} (register your own with @linnaeus_accel.models.register_model)",
                )
            ]
        )
    return _MODELS[name](config, dataset)
