"""Small datasets several test modules train on."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset


class Sequences(Dataset[dict[str, Tensor]]):
    """Sequences of 2 to 19 tokens (ids 1..15; 0 pads)."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 20, (n,), generator=gen)
        self.items = [torch.randint(1, 16, (int(length),), generator=gen) for length in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.items[i]}
