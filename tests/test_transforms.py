"""Metadata masking and in-group mixup (docs/semantics.md §4): rates, keying by sample, no host sync."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from linnaeus_accel.data.keyed_random import keyed_uniform
from linnaeus_accel.tasks.transforms import InGroupMixup, MetaMasker, python_keyed_uniform

COMPONENTS = ("A", "B", "C")
DIMS = {"A": 2, "B": 3, "C": 1}


def ones_meta(n: int) -> dict[str, torch.Tensor]:
    return {c: torch.ones(n, d) for c, d in DIMS.items()}


def masked_sets(meta: dict[str, torch.Tensor]) -> list[frozenset[str]]:
    """Per sample, the set of components that came back zeroed."""
    zero = {c: (x == 0).all(dim=1).tolist() for c, x in meta.items()}
    n = len(next(iter(zero.values())))
    return [frozenset(c for c in COMPONENTS if zero[c][i]) for i in range(n)]


ALL = frozenset(COMPONENTS)
NONE: frozenset[str] = frozenset()


# -- the pure-python twin of keyed_uniform -----------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "epoch", "stream"),
    [
        (0, 0, 0),  # all-zero parts
        (42, 3, 16),  # the mixup batch stream
        (-7, 1, 5),  # negative seeds are masked to 63 bits in both
        (2**62 + 11, 2**40, 99),  # large parts wrap the same way
    ],
)
def test_python_keyed_uniform_matches_tensor_version(seed: int, epoch: int, stream: int) -> None:
    keys = [0, 1, 2, 12345, 2**40 + 3, -5]
    tensor = keyed_uniform(seed, epoch, torch.tensor(keys), stream).tolist()
    assert [python_keyed_uniform(seed, epoch, k, stream) for k in keys] == tensor


# -- MetaMasker --------------------------------------------------------------------------------------

N = 20_000


def train_sets(
    full: float, partial: float, whitelist: Any = (("A",), ("B", "C")), weights: Any = (3.0, 1.0), **kw: Any
) -> list[frozenset[str]]:
    masker = MetaMasker(COMPONENTS, seed=kw.get("seed", 42))
    out = masker.train(ones_meta(N), torch.arange(N), kw.get("epoch", 1), full, partial, whitelist, weights)
    return masked_sets(out)


@pytest.mark.parametrize(
    ("full", "partial", "expected"),
    [
        (0.0, 0.0, {NONE: 1.0}),  # nothing masked
        (1.0, 0.0, {ALL: 1.0}),  # everything masked
        (1.0, 1.0, {ALL: 1.0}),  # partial applies only to samples not fully masked
        (0.3, 0.0, {ALL: 0.3, NONE: 0.7}),  # partial inactive: full rate only
        # (1 - 0.3) * 0.5 = 0.35 partially masked, split 3:1 between the combinations
        (0.3, 0.5, {ALL: 0.3, NONE: 0.35, frozenset("A"): 0.2625, frozenset("BC"): 0.0875}),
        (0.0, 1.0, {frozenset("A"): 0.75, frozenset("BC"): 0.25}),  # weights (3, 1) -> 75/25
    ],
)
def test_mask_rates(full: float, partial: float, expected: dict[frozenset[str], float]) -> None:
    counts = Counter(train_sets(full, partial))
    assert set(counts) == set(expected)  # no other pattern ever appears
    for pattern, rate in expected.items():
        assert counts[pattern] / N == pytest.approx(rate, abs=0.015), pattern


def test_zero_weight_combination_is_never_drawn() -> None:
    counts = Counter(train_sets(0.0, 1.0, (("A",), ("B",), ("C",)), (1.0, 0.0, 1.0)))
    assert set(counts) == {frozenset("A"), frozenset("C")}
    assert counts[frozenset("A")] / N == pytest.approx(0.5, abs=0.015)


def test_masking_zeroes_values_and_leaves_inputs_alone() -> None:
    meta = {c: torch.rand(64, d) + 0.5 for c, d in DIMS.items()}
    before = {c: x.clone() for c, x in meta.items()}
    out = MetaMasker(COMPONENTS, 0).train(meta, torch.arange(64), 0, 0.5, 1.0, (("A", "C"),), (1.0,))
    for c in COMPONENTS:
        assert torch.equal(meta[c], before[c])
        zeroed = (out[c] == 0).all(dim=1)
        # every row is either exactly the input or exactly zero
        assert torch.equal(out[c][~zeroed], before[c][~zeroed])
    # partial probability 1 with one combination: every sample loses A and C; B goes only with a full mask
    sets = masked_sets(out)
    assert set(sets) == {ALL, frozenset("AC")}


def test_same_sample_same_draw_whatever_the_batch() -> None:
    """What makes resume and other (world size, accumulation) factorisations draw the same values."""
    masker = MetaMasker(COMPONENTS, seed=7)
    index = torch.arange(1000, 1400)
    args = (3, 0.4, 0.6, (("A",), ("B", "C"), ("C",)), (1.0, 2.0, 1.0))
    whole = masked_sets(masker.train(ones_meta(400), index, *args))
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(1))
    halves = [perm[:150], perm[150:]]
    for part in halves:
        sets = masked_sets(masker.train(ones_meta(len(part)), index[part], *args))
        assert sets == [whole[i] for i in part.tolist()]


@pytest.mark.parametrize(
    "change",
    [
        {"epoch": 2},  # another epoch redraws
        {"seed": 43},  # another seed redraws
    ],
)
def test_other_epoch_or_seed_draws_differently(change: dict[str, int]) -> None:
    base = train_sets(0.5, 0.5)
    other = train_sets(0.5, 0.5, **change)
    agree = sum(a == b for a, b in zip(base, other, strict=True)) / N
    assert agree < 0.6  # independent draws agree about 0.5^2 + 0.25^2 + ... ~ 0.39 of the time


def test_validation_masks_zero_exactly_the_named_components() -> None:
    masker = MetaMasker(COMPONENTS, 0)
    meta = {c: torch.rand(5, d) + 0.1 for c, d in DIMS.items()}
    assert masked_sets(masker.mask_all(meta)) == [ALL] * 5
    for combination in [("A",), ("B", "C"), ("A", "B", "C")]:
        out = masker.mask_components(meta, combination)
        assert masked_sets(out) == [frozenset(combination)] * 5
        for c in set(COMPONENTS) - set(combination):
            assert torch.equal(out[c], meta[c])


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.mask_components(ones_meta(2), ("A", "D")),  # unknown component
        lambda m: m.mask_all({"A": torch.ones(2, 2)}),  # meta lacks components
        lambda m: m.train(ones_meta(2), torch.arange(2), 0, 0.0, 0.5, (("X",),), (1.0,)),  # whitelist
        lambda m: m.train(ones_meta(2), torch.arange(2), 0, 0.0, 0.5, (("A",), ("B",)), (1.0,)),  # weights
    ],
)
def test_bad_components_raise(call: Any) -> None:
    with pytest.raises(ValueError, match=r"component|weight"):
        call(MetaMasker(COMPONENTS, 0))


def test_duplicate_components_raise() -> None:
    with pytest.raises(ValueError, match="distinct"):
        MetaMasker(("A", "A"), 0)


# -- InGroupMixup ------------------------------------------------------------------------------------

# group label per sample: group 0 has 4 members, 1 has 3, 2 has 1, 3 has 2, null (-1) has 2
GROUPS = [0, 1, 0, 2, -1, 3, 0, 1, 3, -1, 0, 1]


def make_batch(groups: list[int] = GROUPS, offset: int = 100) -> dict[str, Any]:
    n = len(groups)
    gen = torch.Generator().manual_seed(3)
    g = torch.tensor(groups)
    return {
        "index": torch.arange(offset, offset + n),
        "image": torch.rand(n, 1, 8, 8, generator=gen),
        "meta": {c: torch.rand(n, d, generator=gen) for c, d in DIMS.items()},
        "labels": torch.stack([torch.where(g < 0, g, g // 2), g], dim=1),  # coarse, fine (level 1)
    }


def mixup(min_group_size: int = 3, exclude_null: bool = True, alpha: float = 1.0) -> InGroupMixup:
    return InGroupMixup(1, alpha, min_group_size, exclude_null, seed=42)


def changed(out: dict[str, Any], batch: dict[str, Any]) -> list[bool]:
    return (out["image"] != batch["image"]).flatten(1).any(1).tolist()  # type: ignore[no-any-return]


def test_prob_zero_leaves_the_batch_unchanged() -> None:
    batch = make_batch()
    out = mixup().apply(batch, epoch=1, micro_batch_key=0, prob=0.0)
    assert torch.equal(out["image"], batch["image"])
    for c in COMPONENTS:
        assert torch.equal(out["meta"][c], batch["meta"][c])
    assert torch.equal(out["labels"], batch["labels"])


@pytest.mark.parametrize(
    ("min_group_size", "exclude_null", "mixed_groups"),
    [
        (3, True, {0, 1}),  # groups of 4 and 3; 2 and 3 too small; nulls excluded
        (2, True, {0, 1, 3}),  # the pair joins
        (2, False, {0, 1, 3, -1}),  # nulls mix among themselves
        (5, True, set()),  # no group is large enough
    ],
)
def test_prob_one_mixes_within_large_enough_groups(
    min_group_size: int, exclude_null: bool, mixed_groups: set[int]
) -> None:
    batch = make_batch()
    snapshot = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    mix = mixup(min_group_size, exclude_null)
    out = mix.apply(batch, epoch=1, micro_batch_key=5, prob=1.0)
    assert changed(out, batch) == [g in mixed_groups for g in GROUPS]
    for key, value in snapshot.items():  # nothing modified in place
        assert torch.equal(batch[key], value)
    assert torch.equal(out["labels"], batch["labels"])
    assert torch.equal(out["index"], batch["index"])

    partner, mixed = mix.pairs(batch["labels"], batch["index"], 1)
    lam = mix.lam(batch["index"], 1)
    assert mixed.tolist() == [g in mixed_groups for g in GROUPS]
    assert torch.equal(batch["labels"][partner, 1], batch["labels"][:, 1])  # partners share the group
    assert bool(((lam >= 0) & (lam <= 1)).all())
    m = mixed.view(-1, 1)
    for new, old in [(out["image"].flatten(1), batch["image"].flatten(1))] + [
        (out["meta"][c], batch["meta"][c]) for c in COMPONENTS
    ]:
        expected = lam.view(-1, 1) * old + (1 - lam.view(-1, 1)) * old[partner]
        assert torch.allclose(torch.where(m, expected, old), new)

    again = mix.apply(batch, epoch=1, micro_batch_key=5, prob=1.0)
    assert torch.equal(again["image"], out["image"])  # deterministic


def test_partners_cycle_through_each_group() -> None:
    batch = make_batch()
    partner, _ = mixup().pairs(batch["labels"], batch["index"], 1)
    nxt: list[int] = partner.tolist()
    assert sorted(nxt) == list(range(len(GROUPS)))  # a permutation
    for i, g in enumerate(GROUPS):
        size = GROUPS.count(g)
        seen, j = {i}, nxt[i]
        while j != i:
            seen.add(j)
            j = nxt[j]
        assert len(seen) == size  # one cycle through the whole group
        assert (nxt[i] != i) == (size > 1)


def test_mixing_follows_the_sample_not_its_position() -> None:
    """A shuffled batch pairs the same samples and draws the same lambdas."""
    batch, mix = make_batch(), mixup(2)
    out = mix.apply(batch, 2, 9, 1.0)
    perm = torch.randperm(len(GROUPS), generator=torch.Generator().manual_seed(0))
    shuffled = {
        "index": batch["index"][perm],
        "image": batch["image"][perm],
        "meta": {c: x[perm] for c, x in batch["meta"].items()},
        "labels": batch["labels"][perm],
    }
    out_shuffled = mix.apply(shuffled, 2, 9, 1.0)
    assert torch.equal(out_shuffled["image"], out["image"][perm])
    for c in COMPONENTS:
        assert torch.equal(out_shuffled["meta"][c], out["meta"][c][perm])


@given(
    groups=st.lists(st.integers(min_value=-1, max_value=4), min_size=1, max_size=40),
    min_size=st.integers(min_value=1, max_value=5),
    exclude_null=st.booleans(),
    epoch=st.integers(min_value=0, max_value=50),
)
@settings(max_examples=60, deadline=None)
def test_pairing_invariants(groups: list[int], min_size: int, exclude_null: bool, epoch: int) -> None:
    batch = make_batch(groups)
    partner, mixed = InGroupMixup(1, 0.5, min_size, exclude_null, seed=1).pairs(
        batch["labels"], batch["index"], epoch
    )
    assert sorted(partner.tolist()) == list(range(len(groups)))
    assert [groups[j] for j in partner.tolist()] == groups
    counts = Counter(groups)
    assert mixed.tolist() == [counts[g] >= min_size and (g >= 0 or not exclude_null) for g in groups]


def test_batch_decision_is_keyed_and_follows_prob() -> None:
    mix = mixup()
    keys = range(5000)
    decisions = [mix.should_mix(3, k, 0.3) for k in keys]
    assert decisions == [mix.should_mix(3, k, 0.3) for k in keys]  # same key, same decision
    assert sum(decisions) / len(decisions) == pytest.approx(0.3, abs=0.02)
    assert decisions != [mix.should_mix(4, k, 0.3) for k in keys]  # another epoch redraws
    assert not any(mix.should_mix(3, k, 0.0) for k in keys)
    assert all(mix.should_mix(3, k, 1.0) for k in keys)


@pytest.mark.parametrize(
    "alpha",
    [
        1.0,  # Beta(1, 1) is uniform
        0.2,  # U-shaped: uses the alpha < 1 boost
        4.0,  # peaked at 0.5
    ],
)
def test_lambda_is_beta_distributed(alpha: float) -> None:
    lam = mixup(alpha=alpha).lam(torch.arange(N), epoch=0).double()
    assert bool(((lam >= 0) & (lam <= 1)).all())
    assert lam.mean().item() == pytest.approx(0.5, abs=0.01)
    assert lam.var().item() == pytest.approx(1 / (4 * (2 * alpha + 1)), rel=0.05)
    # Kolmogorov-Smirnov distance to the exact Beta CDF (scipy ships with scikit-learn); the 5%
    # critical value for 20k samples is 0.0096.
    stats = pytest.importorskip("scipy.stats")
    grid = torch.linspace(0.005, 0.995, 199, dtype=torch.float64)
    ours = (lam.view(-1, 1) <= grid).double().mean(0)
    exact = torch.from_numpy(stats.beta(alpha, alpha).cdf(grid.numpy()))
    assert (ours - exact).abs().max().item() < 0.01


def test_lambda_is_keyed_by_sample() -> None:
    mix = mixup()
    idx = torch.tensor([5, 17, 400, 9])
    assert torch.equal(mix.lam(idx, 1)[[2, 0]], mix.lam(torch.tensor([400, 5]), 1))
    assert not torch.equal(mix.lam(idx, 1), mix.lam(idx, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, "alpha"),  # Beta(0, 0) is not a distribution
        ({"min_group_size": 0}, "min_group_size"),
    ],
)
def test_bad_mixup_settings_raise(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "group_level_index": 1,
        "alpha": 1.0,
        "min_group_size": 2,
        "exclude_null": True,
        "seed": 0,
    }
    with pytest.raises(ValueError, match=match):
        InGroupMixup(**(args | kwargs))


def test_missing_label_level_raises() -> None:
    batch = make_batch()
    with pytest.raises(ValueError, match="level column 2"):
        InGroupMixup(2, 1.0, 2, True, 0).pairs(batch["labels"], batch["index"], 0)


# -- host synchronisation ----------------------------------------------------------------------------

# Ops that read a device value back to the host (.item(), bool(tensor)) or size an output by data.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2"}


class SyncDetector(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name in SYNC_OPS:
            self.calls.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@contextmanager
def no_sync() -> Iterator[SyncDetector]:
    with SyncDetector() as detector:
        yield detector
    assert detector.calls == []


def test_detector_sees_item() -> None:
    with SyncDetector() as detector:
        torch.ones(2).sum().item()
        bool(torch.ones(1) > 0)
    assert detector.calls == ["aten::_local_scalar_dense"] * 2


def test_transforms_never_sync_with_the_host() -> None:
    batch = make_batch()
    masker, mix = MetaMasker(COMPONENTS, 1), mixup(2, exclude_null=False, alpha=0.3)
    with no_sync():
        mixed = mix.apply(batch, 1, 0, 1.0)
        masker.train(mixed["meta"], mixed["index"], 1, 0.3, 0.5, (("A",), ("B", "C")), (1.0, 2.0))
        masker.mask_all(mixed["meta"])
        masker.mask_components(mixed["meta"], ("B",))


def test_runs_on_the_digits_batch_format() -> None:
    from torch.utils.data import DataLoader

    from linnaeus_accel.data.digits import DigitsDataset

    ds = DigitsDataset("train")
    batch = next(iter(DataLoader(ds, batch_size=64, shuffle=False)))
    mix = InGroupMixup(ds.levels.index("digit"), 1.0, 2, True, seed=42)
    masker = MetaMasker(ds.meta_components, seed=42)
    with no_sync():
        out = mix.apply(batch, 1, 0, 1.0)
        meta = masker.train(
            out["meta"], out["index"], 1, 0.5, 0.5, (("ROWS",), ("COLS", "MOMENTS")), (1.0, 1.0)
        )
    assert set(meta) == set(ds.meta_components)
    assert bool((out["image"] != batch["image"]).any())
    assert torch.equal(out["labels"], batch["labels"])


@pytest.mark.gpu
def test_cuda_matches_cpu_without_synchronising() -> None:
    batch = make_batch()
    cuda = {k: ({c: x.cuda() for c, x in v.items()} if k == "meta" else v.cuda()) for k, v in batch.items()}
    masker, mix = MetaMasker(COMPONENTS, 1), mixup(2)
    args = (1, 0.3, 0.5, (("A",), ("B", "C")), (1.0, 2.0))
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mix.apply(cuda, 1, 0, 1.0)
        meta = masker.train(out["meta"], out["index"], *args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = mix.apply(batch, 1, 0, 1.0)
    assert torch.allclose(out["image"].cpu(), expected["image"])
    for c, x in masker.train(expected["meta"], expected["index"], *args).items():
        assert torch.allclose(meta[c].cpu(), x)
