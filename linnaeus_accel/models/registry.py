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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..registry import Registry

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config

ModelBuilder = Callable[["Config", Any], "nn.Module"]

MODELS: Registry[ModelBuilder] = Registry(
    "model",
    "MODEL.TYPE",
    "linnaeus_accel.models.register_model",
    {
        "digits_mlp": "linnaeus_accel.models.digits",
        "digits_convnet": "linnaeus_accel.models.digits",
        "hf_causal_lm": "linnaeus_accel.models.hf",
        "hf_sequence_classification": "linnaeus_accel.models.hf",
        "hf_vision": "linnaeus_accel.models.vision",
    },
)
register_model = MODELS.register


def build_model(config: Config, dataset: Any) -> nn.Module:
    return MODELS.get(config.MODEL.TYPE)(config, dataset)
