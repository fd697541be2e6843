"""Models for the built-in digits data.

``digits_mlp``: a two-branch MLP for ``digits``, one head per label level. The pixels and the
metadata components go through separate branches that are concatenated, so masking metadata (a
zeroed component) changes what the heads see, as it does in linnaeus.

``digits_convnet``: a small CNN for ``digits_images``: ``forward(images [B, 1, 8, 8])`` returns
``[B, num_classes]`` logits.
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


class DigitsConvNet(nn.Module):
    def __init__(self, num_classes: int, channels: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.GELU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.features(x))
        return logits


def _convnet_options(options: dict[str, Any]) -> tuple[int, float]:
    problems: list[tuple[str, str]] = []
    unknown = set(options) - {"channels", "dropout"}
    if unknown:
        problems.append(
            ("MODEL.OPTIONS", f"digits_convnet takes channels and dropout, not {', '.join(sorted(unknown))}")
        )
    channels = options.get("channels", 32)
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        problems.append(("MODEL.OPTIONS", f"channels must be a positive integer, got {channels!r}"))
    dropout = options.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
        problems.append(("MODEL.OPTIONS", f"dropout must be a number in [0, 1), got {dropout!r}"))
    if problems:
        raise ConfigError(problems)
    return channels, float(dropout)


@register_model("digits_convnet")
def build_digits_convnet(config: Config, dataset: Any) -> DigitsConvNet:
    channels, dropout = _convnet_options(dict(config.MODEL.OPTIONS))
    num_classes = getattr(dataset, "num_classes", None)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int):
        raise ConfigError(
            [
                (
                    "MODEL.TYPE",
                    "digits_convnet needs a single-label image dataset whose num_classes is an int "
                    f"(got {num_classes!r}): use DATA.DATASET.NAME digits_images",
                )
            ]
        )
    return DigitsConvNet(num_classes, channels=channels, dropout=dropout)
