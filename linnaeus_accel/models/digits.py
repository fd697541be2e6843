"""``digits_mlp``: a two-branch MLP for the built-in digits data, one head per label level.

The pixels and the metadata components go through separate branches that are concatenated, so
masking metadata (a zeroed component) changes what the heads see, as it does in linnaeus.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config, ConfigError
from .registry import register_model


class DigitsMLP(nn.Module):
    def __init__(
        self,
        image_size: int,
        meta_dims: dict[str, int],
        num_classes: list[int],
        hidden: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.meta_names = list(meta_dims)
        self.image = nn.Sequential(
            nn.Flatten(), nn.Linear(image_size, hidden), nn.GELU(), nn.Dropout(dropout)
        )
        self.meta = nn.Sequential(
            nn.Linear(sum(meta_dims.values()), hidden // 2), nn.GELU(), nn.Dropout(dropout)
        )
        self.trunk = nn.Sequential(nn.Linear(hidden + hidden // 2, hidden), nn.GELU(), nn.Dropout(dropout))
        self.heads = nn.ModuleList(nn.Linear(hidden, n) for n in num_classes)

    def shared_parameters(self) -> list[nn.Parameter]:
        """The last layer every head reads from: what GradNorm balances the tasks' gradients on."""
        return list(self.trunk.parameters())

    def forward(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        meta = torch.cat([batch["meta"][name] for name in self.meta_names], dim=1)
        features = self.trunk(torch.cat([self.image(batch["image"]), self.meta(meta)], dim=1))
        return [head(features) for head in self.heads]


@register_model("digits_mlp")
def build_digits_mlp(config: Config, dataset: Any) -> DigitsMLP:
    options = dict(config.MODEL.OPTIONS)
    unknown = set(options) - {"hidden", "dropout"}
    if unknown:
        raise ConfigError(
            [("MODEL.OPTIONS", f"digits_mlp takes hidden and dropout, not {', '.join(sorted(unknown))}")]
        )
    sample = dataset[0]
    return DigitsMLP(
        image_size=sample["image"].numel(),
        meta_dims={name: t.numel() for name, t in sample["meta"].items()},
        num_classes=[dataset.num_classes[level] for level in dataset.levels],
        hidden=int(options.get("hidden", 128)),
        dropout=float(options.get("dropout", 0.0)),
    )
