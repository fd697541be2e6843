"""Where a token window starts: ``OPTIONS.windows`` of ``token_files``, ``python_docs`` and
``hf_dataset`` (map-style), and of ``PackedTokens``.

- ``aligned`` (the default): window ``k`` starts at token ``k * (seq_len - 1)`` (of its file), so an
  epoch makes every token after a file's first a target exactly once; the sampler shuffles the
  windows' order by ``(seed, epoch)``.
- ``random``: nanoGPT's sampling, offsets drawn uniformly **with replacement** from every start at
  which ``seq_len`` tokens fit (within one file, and within the file's part of the split; a file's
  last tokens that fill no aligned window can be drawn too). An epoch draws as many windows as
  ``aligned`` cuts (``len()`` is unchanged, so an epoch is the same number of tokens and every
  ``*_EPOCHS`` key means what it meant).

Random windows stay exact. Draw ``g`` of the run, ``g = epoch x len + position`` (the sample's place
in the run's global order, which Accelerate deals out to processes batch by batch), starts at an
offset that is a pure function of ``(seed, g)`` (``keyed_random``, stream ``TRAIN_STREAM``): the
dataset's sampler (``DrawSampler``) yields ``g`` itself and ``__getitem__(g)`` maps it to the
window, so no state lives in a process or a DataLoader worker. A resumed run, any processes x
accumulation factorisation with the same global batch, and any number of workers read the same
windows at every optimizer step. ``DATA.SHUFFLE`` changes nothing: every draw is already uniform.

Validation stays ``aligned`` (every held-out window once, comparable across runs) unless
``val_windows: random`` asks otherwise: then each validation pass reads the same ``len()`` random
windows (the pass is epoch 0 of its own stream, ``VAL_STREAM``), so passes stay comparable.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..keyed_random import python_keyed_bits
from ..options import DatasetOptions
from ..registry import Split
from ..sampling import EpochOrderSampler, EpochSeededSampler

if TYPE_CHECKING:
    from .corpus import FileWindows

WINDOWS = ("aligned", "random")
TRAIN_STREAM = 0x7769_6E00  # keyed-draw stream of training windows' offsets ("win\0")
VAL_STREAM = TRAIN_STREAM + 1  # validation's (val_windows: random), apart from training's draws


@dataclass(frozen=True)
class WindowDraws:
    """How a dataset places its windows: ``mode`` (``aligned`` or ``random``); a random window's
    offset is keyed by ``seed`` (``EXPERIMENT.SEED``) and ``stream`` (training's or validation's)."""

    mode: str = "aligned"
    seed: int = 0
    stream: int = TRAIN_STREAM

    def __post_init__(self) -> None:
        if self.mode not in WINDOWS:
            raise ValueError(f"windows must be one of {', '.join(WINDOWS)}, got {self.mode!r}")

    @property
    def random(self) -> bool:
        return self.mode == "random"


ALIGNED = WindowDraws()


class RandomOffsets:
    """Uniform window starts over ``spans``: ``(first start, number of starts)`` of each part
    (a file, or a file's part of the split), every start equally likely whatever its part."""

    def __init__(self, spans: Sequence[tuple[int, int]], draws: WindowDraws) -> None:
        self.firsts = [first for first, _ in spans]
        self._ends = np.cumsum([count for _, count in spans], dtype=np.int64).tolist()
        self._starts = [0, *self._ends[:-1]]
        self.total = self._ends[-1] if self._ends else 0
        self.seed, self.stream = draws.seed, draws.stream

    def locate(self, draw: int) -> tuple[int, int]:
        """``(part, token offset)`` of draw ``draw`` (any int >= 0: the run's draw number)."""
        if draw < 0 or self.total == 0:
            raise IndexError(f"draw {draw} out of range: draws are numbered from 0 over {self.total} starts")
        # The top bits of 64 scaled to the starts: no modulo bias worth the name (total << 2**64).
        u = (python_keyed_bits(self.seed, 0, draw, self.stream) * self.total) >> 64
        part = bisect.bisect_right(self._ends, u)
        return part, self.firsts[part] + u - self._starts[part]


def file_spans(parts: Sequence[FileWindows], seq_len: int) -> list[tuple[int, int]]:
    """``part_span`` of each of ``TokenFiles``' parts."""
    return [
        part_span(
            p.first, p.count, seq_len, p.file.layout.num_tokens, p.first + p.count == p.file.windows(seq_len)
        )
        for p in parts
    ]


def part_span(first: int, count: int, seq_len: int, num_tokens: int, last_part: bool) -> tuple[int, int]:
    """``(first start, number of starts)`` of random windows in aligned windows ``first ..
    first + count - 1`` of a file of ``num_tokens``: the tokens those windows cover, and when they
    are the file's last (``last_part``), the tokens after them that fill no aligned window."""
    step = seq_len - 1
    if count <= 0:
        return first * step, 0
    last = num_tokens - seq_len if last_part else (first + count - 1) * step
    return first * step, last - first * step + 1


class DrawSampler(EpochOrderSampler):
    """Random windows' epoch order: the run's draw numbers ``epoch x size + position``, in order
    (each is an independent uniform offset already, so there is nothing to shuffle)."""

    def _order(self, start: int) -> Iterator[int]:
        base = self.epoch * self.size
        return iter(range(base + start, base + self.size))

    def indices_at(self, positions: Sequence[int]) -> list[int]:
        """The draw numbers at ``positions`` of the current epoch (random access)."""
        return [self.epoch * self.size + p for p in positions]


def window_sampler(dataset: Sized, draws: WindowDraws, seed: int, shuffle: bool) -> EpochOrderSampler:
    """The sampler of a windowed dataset (its ``epoch_sampler``): ``DrawSampler`` for random
    windows, else the usual ``EpochSeededSampler``."""
    if draws.random:
        return DrawSampler(len(dataset), seed)
    return EpochSeededSampler(dataset, seed, shuffle=shuffle)


def window_option(options: DatasetOptions, split: Split, seed: int) -> WindowDraws:
    """``windows`` (training, default aligned) and ``val_windows`` (validation, default aligned)
    of a dataset's OPTIONS: the draws of ``split``, keyed by ``seed`` (``EXPERIMENT.SEED``)."""
    windows = options.text("windows", "aligned", WINDOWS)
    val_windows = options.text("val_windows", "aligned", WINDOWS)
    if split == "val":
        return WindowDraws(val_windows, seed, VAL_STREAM)
    return WindowDraws(windows, seed, TRAIN_STREAM)
