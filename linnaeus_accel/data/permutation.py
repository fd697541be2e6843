"""Keyed permutations of ``[0, n)`` that need no memory: position ``p`` of an epoch's order is
computed on its own, for any ``n``.

A shuffled epoch over ``n`` samples is usually ``torch.randperm(n)``: ``8 n`` bytes of int64, and
``n`` Python ints once listed (about 36 bytes each). For 100 million token windows that is several
GB in every process, growing with the corpus. ``KeyedPermutation`` is instead a bijection computed
per position: a balanced Feistel network on the smallest even number of bits that holds ``n``,
keyed by ``(seed, epoch, stream)``, with cycle-walking (a value that lands at or past ``n`` is
permuted again until it falls inside; the domain is under ``4 n``, so a few rounds at most). It is
the same on every process and DataLoader worker, and a resumed run recomputes any position without
replaying the ones before it.

``take`` works on NumPy arrays of positions (uint64 arithmetic), so a sampler lists a chunk of an
epoch's order at a few nanoseconds per index.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .keyed_random import python_keyed_bits

_ROUNDS = 4  # four Feistel rounds: a pseudo-random permutation (Luby-Rackoff), not just a bijection
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

UInt64Array = np.ndarray[Any, np.dtype[np.uint64]]


def _mix(x: UInt64Array) -> UInt64Array:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps, as it should)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


class KeyedPermutation:
    """A pseudo-random order of ``range(size)``, a pure function of ``(seed, epoch, stream)``."""

    def __init__(self, size: int, seed: int, epoch: int, stream: int = 0) -> None:
        if size < 0:
            raise ValueError(f"a permutation needs a size >= 0, got {size}")
        self.size = size
        bits = max(2, (max(size, 2) - 1).bit_length())
        self.half = (bits + 1) // 2  # each Feistel half holds this many bits
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [
            np.uint64(python_keyed_bits(seed, epoch, round_index, stream=stream))
            for round_index in range(_ROUNDS)
        ]

    def _round_trip(self, x: UInt64Array) -> UInt64Array:
        half, mask = np.uint64(self.half), self.mask
        left, right = x >> half, x & mask
        with np.errstate(over="ignore"):
            for key in self.keys:
                left, right = right, left ^ (_mix((right * _GOLDEN) ^ key) & mask)
        return (left << half) | right

    def take(self, positions: UInt64Array | np.ndarray[Any, Any]) -> UInt64Array:
        """The values at ``positions`` (each in ``[0, size)``), as uint64."""
        out = self._round_trip(np.asarray(positions, dtype=np.uint64))
        size = np.uint64(self.size)
        outside = np.flatnonzero(out >= size)
        while outside.size:  # cycle-walking: at most a few rounds, the domain being < 4 * size
            out[outside] = self._round_trip(out[outside])
            outside = outside[out[outside] >= size]
        return out

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.size:
            raise IndexError(f"position {position} out of range for a permutation of {self.size}")
        return int(self.take(np.array([position], dtype=np.uint64))[0])

    def chunks(self, start: int = 0) -> Iterator[list[int]]:
        """The order from ``start`` on, as lists of Python ints (``growing_chunks``)."""
        for begin, end in growing_chunks(start, self.size):
            yield self.take(np.arange(begin, end, dtype=np.uint64)).tolist()


FIRST_CHUNK, LARGEST_CHUNK = 256, 8192


def growing_chunks(start: int, end: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` in spans of 256, 512, ... up to 8192 positions: an epoch's first batch
    waits for a small chunk (a full one is ~1 ms), and the rest spread each NumPy call's fixed
    cost over thousands of positions."""
    size = FIRST_CHUNK
    while start < end:
        yield start, min(start + size, end)
        start, size = start + size, min(LARGEST_CHUNK, 2 * size)
