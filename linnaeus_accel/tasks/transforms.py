"""Batch transforms driven by the schedule (docs/semantics.md §4): metadata masking and in-group mixup.

Every random draw is keyed by what it is about, ``(seed, epoch, sample index, stream)``, or for
the batch-level mixup decision by ``(seed, epoch, micro-batch key)``, never by rank or by a
process-local counter: a resumed run draws what the uninterrupted run drew, and a sample draws the
same values whatever batch, position or process it lands in. Nothing here reads a tensor value back
to the host, so the per-step path never synchronises with the device.

Order in the training loop: mixup first, then masking. Masking first would blend a zeroed
component with the partner's real values, which is neither masked nor clean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..data.keyed_random import keyed_bits, keyed_uniform, python_keyed_uniform

Meta = Mapping[str, torch.Tensor]

# Streams are global to the module, so the masker and mixup never share draws for one seed.
_FULL, _PARTIAL, _COMBINATION = 1, 2, 3
_MIX_BATCH, _MIX_ORDER, _GAMMA_X, _GAMMA_Y = 16, 17, 32, 64
_REPEAT_GROUP = -(
    2**62
)  # the mixup group of even-batch repeats: no label has it, so they pair only among themselves
_GAMMA_ROUNDS = 8  # Marsaglia-Tsang accepts >= 95% per round: 8 rounds fail with p < 4e-11


def _open_uniform(seed: int, epoch: int, keys: torch.Tensor, stream: int) -> torch.Tensor:
    # Shifted by half a bucket into (0, 1): log() and powers below never see 0.
    return keyed_uniform(seed, epoch, keys, stream) + 2.0**-25


def _broadcast(flag: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return flag.reshape(flag.shape[0], *([1] * (like.dim() - 1)))


class MetaMasker:
    """Zeroes metadata components, per sample (training) or for the whole batch (validation)."""

    def __init__(self, components: Sequence[str], seed: int) -> None:
        if len(set(components)) != len(components):
            raise ValueError(f"meta components must be distinct, got {list(components)}")
        self.components = tuple(components)
        self.seed = seed

    def _check_combination(self, combination: Sequence[str]) -> None:
        unknown = [c for c in combination if c not in self.components]
        if unknown:
            raise ValueError(
                f"unknown meta component(s) {unknown} in combination {list(combination)}; known: {list(self.components)}"
            )

    def _check_meta(self, meta: Meta) -> None:
        if set(meta) != set(self.components):
            raise ValueError(
                f"batch meta has components {sorted(meta)} but the masker was built for {sorted(self.components)}"
            )

    def train(
        self,
        meta: Meta,
        sample_index: torch.Tensor,
        epoch: int,
        full_prob: float,
        partial_prob: float,
        whitelist: Sequence[Sequence[str]],
        weights: Sequence[float],
    ) -> dict[str, torch.Tensor]:
        """Full masking with ``full_prob``; otherwise one WHITELIST combination (drawn by ``weights``)
        with ``partial_prob`` (0 outside the partial window)."""
        self._check_meta(meta)
        seed, idx = self.seed, sample_index
        full = keyed_uniform(seed, epoch, idx, _FULL) < full_prob
        masked = dict.fromkeys(self.components, full)
        if partial_prob > 0 and whitelist:
            if len(weights) != len(whitelist) or min(weights) < 0 or sum(weights) <= 0:
                raise ValueError(
                    f"need one non-negative weight per combination, got {weights} for {whitelist}"
                )
            for combination in whitelist:
                self._check_combination(combination)
            partial = (keyed_uniform(seed, epoch, idx, _PARTIAL) < partial_prob) & ~full
            # Inverse CDF over the weights: choice j where cum[j-1] <= u < cum[j].
            u = keyed_uniform(seed, epoch, idx, _COMBINATION) * sum(weights)
            choice = torch.zeros_like(idx, dtype=torch.int64)
            for cum in _cumsum(weights)[:-1]:
                choice = choice + (u >= cum).to(torch.int64)
            for j, combination in enumerate(whitelist):
                hit = partial & (choice == j)
                for c in combination:
                    masked[c] = masked[c] | hit
        return {c: x.masked_fill(_broadcast(masked[c], x), 0) for c, x in meta.items()}

    def mask_all(self, meta: Meta) -> dict[str, torch.Tensor]:
        self._check_meta(meta)
        return {c: torch.zeros_like(x) for c, x in meta.items()}

    def mask_components(self, meta: Meta, combination: Sequence[str]) -> dict[str, torch.Tensor]:
        self._check_meta(meta)
        self._check_combination(combination)
        return {c: torch.zeros_like(x) if c in combination else x for c, x in meta.items()}


def _cumsum(weights: Sequence[float]) -> list[float]:
    out: list[float] = []
    total = 0.0
    for w in weights:
        total += w
        out.append(total)
    return out


def _log_gamma_sample(alpha: float, seed: int, epoch: int, keys: torch.Tensor, stream: int) -> torch.Tensor:
    """log of a Gamma(alpha, 1) draw per key: Marsaglia-Tsang (2000) on keyed normals, run for a fixed
    number of rounds so control flow never depends on values; the first accepted proposal wins.
    alpha < 1 uses the boost Gamma(alpha) = Gamma(alpha + 1) * U^(1/alpha), applied in log space so
    tiny alphas do not underflow."""
    shape = alpha + 1.0 if alpha < 1.0 else alpha
    d = shape - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    result = torch.full(keys.shape, math.log(d), dtype=torch.float32, device=keys.device)  # fallback: ~median
    done = torch.zeros(keys.shape, dtype=torch.bool, device=keys.device)
    for r in range(_GAMMA_ROUNDS):
        s = stream + 3 * r
        u1, u2 = _open_uniform(seed, epoch, keys, s), _open_uniform(seed, epoch, keys, s + 1)
        x = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)  # Box-Muller
        v = 1.0 + c * x
        log_v = 3.0 * torch.log(v.clamp_min(1e-30))
        log_u = torch.log(_open_uniform(seed, epoch, keys, s + 2))
        accept = (v > 0) & (log_u < 0.5 * x * x + d - d * torch.exp(log_v) + d * log_v) & ~done
        result = torch.where(accept, math.log(d) + log_v, result)
        done = done | accept
    if alpha < 1.0:
        result = result + torch.log(_open_uniform(seed, epoch, keys, stream + 3 * _GAMMA_ROUNDS)) / alpha
    return result


class InGroupMixup:
    """Mixes each sample with a partner of the same label at ``group_level_index``."""

    def __init__(
        self, group_level_index: int, alpha: float, min_group_size: int, exclude_null: bool, seed: int
    ) -> None:
        if not alpha > 0:
            raise ValueError(f"mixup alpha must be positive, got {alpha}")
        if min_group_size < 1:
            raise ValueError(f"mixup min_group_size must be at least 1, got {min_group_size}")
        self.level = group_level_index
        self.alpha = alpha
        self.min_group_size = min_group_size
        self.exclude_null = exclude_null
        self.seed = seed

    def should_mix(self, epoch: int, micro_batch_key: int, prob: float) -> bool:
        """Whether this micro-batch is mixed: pure python, so every rank with the same key agrees."""
        return python_keyed_uniform(self.seed, epoch, micro_batch_key, _MIX_BATCH) < prob

    def lam(self, sample_index: torch.Tensor, epoch: int) -> torch.Tensor:
        """Beta(alpha, alpha) per sample, as X / (X + Y) for X, Y ~ Gamma(alpha), i.e. a sigmoid of
        the log difference (stable when both are tiny)."""
        log_x = _log_gamma_sample(self.alpha, self.seed, epoch, sample_index, _GAMMA_X)
        log_y = _log_gamma_sample(self.alpha, self.seed, epoch, sample_index, _GAMMA_Y)
        return torch.sigmoid(log_x - log_y)

    def pairs(
        self, labels: torch.Tensor, sample_index: torch.Tensor, epoch: int, real: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(partner, mixed)``: each sample's partner position in the batch and whether it is mixed.

        Samples are sorted by (group, keyed 64-bit draw); within each group's run each is paired
        with the next one, the last with the first. Sorting by draws rather than positions makes the
        pairing independent of the order the batch arrived in. ``real`` marks the samples that are
        not even-batch repeats: repeats form a group of their own and are never mixed, so a real
        sample gets the partner it would get in a batch without them."""
        if labels.dim() != 2 or not -labels.shape[1] <= self.level < labels.shape[1]:
            raise ValueError(f"labels of shape {tuple(labels.shape)} have no level column {self.level}")
        group = labels[:, self.level]
        if real is not None:
            group = group.masked_fill(~real, _REPEAT_GROUP)
        n = group.shape[0]
        pos = torch.arange(n, device=group.device)
        draw = keyed_bits(self.seed, epoch, sample_index, _MIX_ORDER)
        order = torch.sort(draw, stable=True).indices
        order = order[torch.sort(group[order], stable=True).indices]
        g = group[order]
        starts = torch.ones(n, dtype=torch.bool, device=g.device)
        starts[1:] = g[1:] != g[:-1]
        ends = torch.ones(n, dtype=torch.bool, device=g.device)
        ends[:-1] = starts[1:]
        first = torch.cummax(torch.where(starts, pos, 0), 0).values
        last = torch.cummin(torch.where(ends, pos, n).flip(0), 0).values.flip(0)
        mixed_sorted = (last - first + 1) >= self.min_group_size
        if self.exclude_null:
            mixed_sorted = mixed_sorted & (g >= 0)
        partner_sorted = order[torch.where(ends, first, pos + 1)]
        partner = torch.empty_like(order).scatter_(0, order, partner_sorted)
        mixed = torch.empty_like(mixed_sorted).scatter_(0, order, mixed_sorted)
        return partner, mixed if real is None else mixed & real

    def apply(
        self,
        batch: Mapping[str, Any],
        epoch: int,
        micro_batch_key: int,
        prob: float,
        real: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """A new batch: image and every metadata tensor mixed ``lam * x + (1 - lam) * x[partner]``
        when this micro-batch is drawn for mixing; labels and index unchanged."""
        out = dict(batch)
        if not self.should_mix(epoch, micro_batch_key, prob):
            return out
        index = batch["index"]
        partner, mixed = self.pairs(batch["labels"], index, epoch, real)
        lam = self.lam(index, epoch)

        def blend(x: torch.Tensor) -> torch.Tensor:
            w = _broadcast(lam, x).to(x.dtype)
            return torch.where(_broadcast(mixed, x), w * x + (1 - w) * x[partner], x)

        out["image"] = blend(batch["image"])
        out["meta"] = {c: blend(x) for c, x in batch["meta"].items()}
        return out
