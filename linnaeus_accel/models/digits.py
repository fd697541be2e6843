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


KEY = "MODEL.OPTIONS"
# Widths past these only cost memory on 8x8 digits (the MLP's trunk alone is 1.5 x hidden**2 weights:
# 400 M at 16384); a larger value is a typo or a value meant for another model.
# hidden >= 2: the metadata branch is hidden // 2 wide.
MAX_HIDDEN = 16384
MAX_CHANNELS = 4096


def _width(value: Any, low: int, high: int) -> tuple[int, str | None]:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return 0, f"must be an integer from {low} to {high} (got {value!r})"
    return value, None


def _dropout(value: Any) -> tuple[float, str | None]:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        return 0.0, f"must be a probability in [0, 1) (got {value!r})"
    return float(value), None


def _check_options(
    model: str, options: dict[str, Any], width: str, default: int, bounds: tuple[int, int]
) -> tuple[int, float]:
    """(width, dropout) from MODEL.OPTIONS; every bad option at once, each named by its full key."""
    problems: list[tuple[str, str]] = []
    unknown = sorted(set(options) - {width, "dropout"})
    if unknown:
        problems.append((KEY, f"{model} takes {width} and dropout, not {', '.join(map(str, unknown))}"))
    size, problem = _width(options.get(width, default), *bounds)
    if problem:
        problems.append((f"{KEY}.{width}", problem))
    dropout, problem = _dropout(options.get("dropout", 0.0))
    if problem:
        problems.append((f"{KEY}.dropout", problem))
    if problems:
        raise ConfigError(problems)
    return size, dropout


@register_model("digits_mlp")
def build_digits_mlp(config: Config, dataset: Any) -> DigitsMLP:
    hidden, dropout = _check_options("digits_mlp", dict(config.MODEL.OPTIONS), "hidden", 128, (2, MAX_HIDDEN))
    sample = dataset[0]
    return DigitsMLP(
        image_size=sample["image"].numel(),
        meta_dims={name: t.numel() for name, t in sample["meta"].items()},
        num_classes=[dataset.num_classes[level] for level in dataset.levels],
        hidden=hidden,
        dropout=dropout,
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


@register_model("digits_convnet")
def build_digits_convnet(config: Config, dataset: Any) -> DigitsConvNet:
    options = dict(config.MODEL.OPTIONS)
    channels, dropout = _check_options("digits_convnet", options, "channels", 32, (1, MAX_CHANNELS))
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
