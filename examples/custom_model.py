"""Train your own model with linnaeus-accel's schedules: register it by name, then run the CLI.

    python examples/custom_model.py --cfg configs/default.yaml
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/custom_model.py \\
        --cfg configs/default.yaml

The script trains the model registered below (``MODEL.TYPE tiny_linear``) into its own run
directory, ``<ENV.OUTPUT.BASE_DIR>/custom_model``, so that it neither finds nor touches the default
run's ``digits_default``. Both are defaults placed before your ``--opts``, so yours win, e.g.
``--opts TRAIN.EPOCHS 5 EXPERIMENT.NAME my_try``.

The same decorator pattern registers a dataset (``linnaeus_accel.data.register_dataset``): a map-style
dataset whose items are dicts with ``index``, ``image``, ``meta`` and ``labels``, and which declares
``levels``, ``num_classes`` and ``meta_components`` so that configs are checked against it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from linnaeus_accel.cli import main
from linnaeus_accel.config import Config
from linnaeus_accel.models import register_model


class TinyLinear(nn.Module):
    """One linear layer on pixels and metadata, one head per label level."""

    def __init__(self, in_features: int, num_classes: list[int]) -> None:
        super().__init__()
        self.shared = nn.Linear(in_features, 64)
        self.heads = nn.ModuleList(nn.Linear(64, n) for n in num_classes)

    def forward(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        meta = [batch["meta"][name] for name in sorted(batch["meta"])]
        x = torch.cat([batch["image"].flatten(1), *meta], dim=1)
        features = torch.relu(self.shared(x))
        return [head(features) for head in self.heads]


@register_model("tiny_linear")
def build_tiny_linear(config: Config, dataset: Any) -> TinyLinear:
    sample = dataset[0]
    in_features = sample["image"].numel() + sum(t.numel() for t in sample["meta"].values())
    return TinyLinear(in_features, [dataset.num_classes[level] for level in dataset.levels])


# This example's own run directory and model; the user's --opts come after them and win.
EXAMPLE_OPTS = ["EXPERIMENT.NAME", "custom_model", "MODEL.TYPE", "tiny_linear"]


def train_arguments(argv: list[str]) -> list[str]:
    """``linnaeus-accel train`` arguments: ``argv`` with this example's defaults first in ``--opts``
    (argparse keeps only the last ``--opts``, so they are put inside the user's, not beside it)."""
    if "--opts" not in argv:
        return ["train", *argv, "--opts", *EXAMPLE_OPTS]
    at = len(argv) - 1 - argv[::-1].index("--opts")
    return ["train", *argv[: at + 1], *EXAMPLE_OPTS, *argv[at + 1 :]]


if __name__ == "__main__":
    sys.exit(main(train_arguments(sys.argv[1:])))
