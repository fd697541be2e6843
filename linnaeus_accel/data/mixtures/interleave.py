"""A deterministic weighted interleave: which source each position of a sequence comes from.

Sources are the leaves of a balanced binary tree, in their listed order. A node whose left subtree
holds share ``a = p / q`` of the node's weight sends its ``j``-th position left when
``floor((j + 1) a) > floor(j a)``: Bresenham's rule, so the left positions among ``[0, j)`` number
exactly ``floor(j a)``. A position sent left is the left child's position ``floor(j a)``, one sent
right the right child's ``j - floor(j a)``. Descending from the root with a position gives
``(source, draw)``: its source and how many of that source's positions come before it.

Window bound. The count of source ``s`` among positions ``[0, n)`` is ``C_s(n)``, found by the same
descent: at each node on the way ``c -> floor(a c)`` (left) or ``c -> c - floor(a c)`` (right).
Each step is the exact share plus an error ``e``, ``-1 < e <= 0`` (left) or ``0 <= e < 1`` (right).
Unrolled, ``C_s(n) = w_s n + E(n)`` where, whatever ``n``, ``E(n)`` lies in one half-open interval
of length ``B_s``: the sum over the path's edges of the product of the shares below that edge (the
last edge counts 1, each earlier one less). A window ``[m, m + n)`` holds ``C_s(m + n) - C_s(m)``
positions of ``s``, the difference of two points of that interval, so::

    |count of s in any n consecutive positions - w_s n| < B_s <= depth of s <= ceil(log2 sources)

``window_bounds`` holds each ``B_s`` (0 for a lone source: it fills every position). Weights 0.98/0.01/0.01
give bounds 1, 1.5, 1.5 (the first source is never a whole sample off its share, in any window);
five equal weights give at most 11/6.

Arithmetic is exact: weights are read as written (``Fraction(str(w))``, so 0.1 is 1/10, not the
nearest double), and ``locate`` uses int64 only where ``(largest position + 1) * p`` fits for every
node, else Python ints (same results, slower: weights written with long decimals make ``p`` large).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

IntArray = np.ndarray[Any, np.dtype[Any]]  # int64, or object (Python ints) where int64 would overflow

_INT64_LIMIT = 2**63  # products j * p at or above this are done in Python ints


def parse_weight(weight: float | Fraction | str) -> Fraction:
    """A positive, finite weight as the exact fraction it was written as."""
    try:
        value = Fraction(str(weight))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"a weight must be a positive number, got {weight!r}") from None
    if value <= 0:
        raise ValueError(f"a weight must be positive, got {weight!r}")
    return value


class Interleave:
    """Positions ``0, 1, 2, ...`` dealt to sources by weight (see the module docstring)."""

    def __init__(self, weights: Sequence[float | Fraction | str]) -> None:
        parsed = [parse_weight(w) for w in weights]
        if not parsed:
            raise ValueError("an interleave needs at least one source")
        total = sum(parsed, Fraction(0))
        self.shares = tuple(w / total for w in parsed)
        sources = len(parsed)
        # Nodes 0 .. sources-1 are the leaves, node s being source s, so the node a descent ends at
        # is its source. A leaf's share 0 sends every position right, to itself, unchanged: the
        # vectorised descent runs ``depth`` steps for every position, with no test for leaves.
        self._share = [Fraction(0)] * sources
        self._left, self._right = list(range(sources)), list(range(sources))
        self._paths: list[list[tuple[Fraction, bool]]] = [[] for _ in range(sources)]
        self._root = self._split(parsed, 0, sources)
        self.depth = max(len(path) for path in self._paths)
        self.window_bounds = tuple(_window_bound(path) for path in self._paths)
        self._left_of = np.array(self._left, dtype=np.intp)
        self._right_of = np.array(self._right, dtype=np.intp)
        self._p = np.array([a.numerator for a in self._share], dtype=object)
        self._q = np.array([a.denominator for a in self._share], dtype=object)
        self._max_p = max(a.numerator for a in self._share)
        self._pq64: tuple[IntArray, IntArray] | None = None  # the shares as int64, when all fit
        if max(a.denominator for a in self._share) < _INT64_LIMIT:
            self._pq64 = (self._p.astype(np.int64), self._q.astype(np.int64))

    def _split(self, weights: Sequence[Fraction], lo: int, hi: int) -> int:
        """The node over sources ``[lo, hi)``, built with its subtrees; returns its id."""
        if hi - lo == 1:
            return lo
        mid = (lo + hi) // 2
        left, right = self._split(weights, lo, mid), self._split(weights, mid, hi)
        share = sum(weights[lo:mid], Fraction(0)) / sum(weights[lo:hi], Fraction(0))
        for source in range(lo, hi):
            self._paths[source].insert(0, (share, source < mid))
        self._share.append(share)
        self._left.append(left)
        self._right.append(right)
        return len(self._share) - 1

    def count(self, source: int, n: int) -> int:
        """Positions of ``source`` among ``[0, n)``: O(depth), exact for any ``n``."""
        for share, left in self._paths[source]:
            before = n * share.numerator // share.denominator
            n = before if left else n - before
        return n

    def counts(self, n: int) -> list[int]:
        """``count`` of every source, in order (they sum to ``n``)."""
        return [self.count(source, n) for source in range(len(self.shares))]

    def locate(self, positions: IntArray | Sequence[int]) -> tuple[IntArray, IntArray]:
        """``(sources, draws)`` of an array of positions (each >= 0): the source of each, and how
        many positions of that source come before it. Draws are int64 when the arithmetic fits
        (see the module docstring), else an object array of Python ints."""
        j = np.asarray(positions)
        if j.size == 0:
            return np.zeros(j.shape, dtype=np.intp), np.zeros(j.shape, dtype=np.int64)
        if int(j.min()) < 0:
            raise ValueError(f"positions must be >= 0, got {int(j.min())}")
        if self._pq64 is not None and (int(j.max()) + 1) * self._max_p < _INT64_LIMIT:
            j, (p, q) = j.astype(np.int64), self._pq64
        else:
            j, p, q = j.astype(object), self._p, self._q
        node = np.full(j.shape, self._root, dtype=np.intp)
        for _ in range(self.depth):
            node_p, node_q = p[node], q[node]
            product = j * node_p
            before = product // node_q  # the node's left positions before j: floor(j a)
            # floor((j + 1) a) > floor(j a): the remainder of j p / q plus p reaches q.
            left = product - before * node_q >= node_q - node_p
            j = np.where(left, before, j - before)
            node = np.where(left, self._left_of[node], self._right_of[node])
        return node, j


def _window_bound(path: Sequence[tuple[Fraction, bool]]) -> Fraction:
    """``B_s`` of the module docstring for the path ``(left share, went left)`` from root to leaf."""
    bound, below = Fraction(0), Fraction(1)
    for share, left in reversed(path):
        bound += below
        below *= share if left else 1 - share
    return bound
