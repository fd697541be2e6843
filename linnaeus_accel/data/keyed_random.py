"""Random numbers keyed by what they are about, never by rank or by a process-local counter.

``keyed_uniform(seed, epoch, sample_index, stream)`` is a pure function (a splitmix64-style hash
computed with int64 tensor ops on the sample indices' device, so no host sync): a resumed run, or
one with another (world size, accumulation) factorisation, draws the same value for the same
sample (docs/semantics.md §4). ``stream`` separates independent uses (full mask, partial mask, combination, ...).
"""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def keyed_bits(seed: int, epoch: int, keys: torch.Tensor, stream: int) -> torch.Tensor:
    """64 pseudo-random bits (int64) per key."""
    x = keys.to(torch.int64)
    for part in (seed, epoch, stream):
        x = _mix(x * _GOLDEN + (part & 0x7FFFFFFFFFFFFFFF))
    return _mix(x)


def keyed_uniform(seed: int, epoch: int, keys: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform float32 in [0, 1) per key, from the top 24 bits of ``keyed_bits``."""
    bits = _shr(keyed_bits(seed, epoch, keys, stream), 40)
    return bits.to(torch.float32) * (1.0 / (1 << 24))


_M64 = (1 << 64) - 1


def python_keyed_bits(seed: int, epoch: int, key: int, stream: int) -> int:
    """``keyed_bits`` for one python int key, in pure python (as an unsigned 64-bit int): the same
    value, with no tensor, so a decision about a whole batch or epoch costs no device round trip."""

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * (_MIX1 & _M64)) & _M64
        x = ((x ^ (x >> 27)) * (_MIX2 & _M64)) & _M64
        return x ^ (x >> 31)

    x = key & _M64
    for part in (seed, epoch, stream):
        x = mix((x * (_GOLDEN & _M64) + (part & 0x7FFFFFFFFFFFFFFF)) & _M64)
    return mix(x)


def python_keyed_uniform(seed: int, epoch: int, key: int, stream: int) -> float:
    """``keyed_uniform`` for one python int key, in pure python."""
    return (python_keyed_bits(seed, epoch, key, stream) >> 40) / (1 << 24)
