"""The ``mixture`` dataset: the weighted interleave's window bound, which samples each source gives
across epochs, the sampler's order however it is read, and the builder's config errors."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from helpers.configs import REPO, mixture_config
from helpers.in_process import reset_accelerate, run_cli
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

import linnaeus_accel.data.mixtures.interleave as interleave_module
from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.data import build_dataset, register_dataset
from linnaeus_accel.data.mixtures.interleave import Interleave
from linnaeus_accel.data.mixtures.mixture import Mixture, MixtureSource
from linnaeus_accel.data.mixtures.sources import parse_sources
from linnaeus_accel.data.options import DatasetOptions
from linnaeus_accel.data.registry import Split
from linnaeus_accel.data.sampling import epoch_sampler

WEIGHT_SETS: list[list[Any]] = [
    [1, 1],
    [0.7, 0.3],
    [0.98, 0.01, 0.01],
    [1, 1, 1],
    [1, 1, 1, 1, 1],
    [0.5, 0.2, 0.15, 0.1, 0.05],
    [3, 0.25, 7, 1, 2, 0.5, 11],
]


def brute_force(weights: Sequence[Any], positions: Sequence[int]) -> list[int]:
    """The interleave's sources of ``positions``, one at a time in Fractions, by the rule as stated:
    at a node with left share ``a``, position ``j`` goes left iff floor((j+1) a) > floor(j a)."""
    shares = [Fraction(str(w)) for w in weights]

    def source(lo: int, hi: int, j: int) -> int:
        if hi - lo == 1:
            return lo
        mid = (lo + hi) // 2
        a = sum(shares[lo:mid], Fraction(0)) / sum(shares[lo:hi], Fraction(0))
        before = math.floor(j * a)
        if math.floor((j + 1) * a) > before:
            return source(lo, mid, before)
        return source(mid, hi, j - before)

    return [source(0, len(shares), j) for j in positions]


def prefix_counts(sources: np.ndarray[Any, Any], count: int) -> np.ndarray[Any, Any]:
    """``out[s, n]``: positions of source ``s`` among the first ``n``."""
    hits = sources[None, :] == np.arange(count)[:, None]
    return np.concatenate([np.zeros((count, 1), dtype=np.int64), np.cumsum(hits, axis=1)], axis=1)


# -- the interleave -----------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_every_window_is_within_the_bound_of_its_share(weights: list[Any]) -> None:
    interleave = Interleave(weights)
    sources, _ = interleave.locate(np.arange(5000))
    prefix = prefix_counts(sources, len(weights))
    for s, (share, bound) in enumerate(zip(interleave.shares, interleave.window_bounds, strict=True)):
        # The documented chain: B_s <= depth <= ceil(log2 sources).
        assert bound <= interleave.depth <= math.ceil(math.log2(len(weights)))
        for n in (1, 2, 3, 5, 8, 13, 64, 100, 999, 2500, 5000):
            counts = prefix[s, n:] - prefix[s, :-n]  # every window of n consecutive positions
            # |count - share n| < bound, in exact integers: share = p / q, bound = e / f.
            error = np.abs(counts * share.denominator - share.numerator * n)
            assert (error * bound.denominator < bound.numerator * share.denominator).all(), (s, n)


def test_the_bounds_are_the_documented_ones() -> None:
    assert Interleave([0.98, 0.01, 0.01]).window_bounds == (Fraction(1), Fraction(3, 2), Fraction(3, 2))
    assert max(Interleave([1] * 5).window_bounds) == Fraction(11, 6)
    single = Interleave([2.5])
    assert single.window_bounds == (Fraction(0),)
    assert single.locate(np.arange(4))[1].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_locate_and_count_agree_with_counting_position_by_position(weights: list[Any]) -> None:
    interleave = Interleave(weights)
    n = 1500
    sources, draws = interleave.locate(np.arange(n))
    assert sources.tolist() == brute_force(weights, range(n))
    prefix = prefix_counts(sources, len(weights))
    assert draws.tolist() == [prefix[s, j] for j, s in enumerate(sources.tolist())]
    for m in (0, 1, 2, 77, 1000, n):
        assert interleave.counts(m) == prefix[:, m].tolist()
    # Positions read out of order, one at a time, or repeated give the same answers.
    picked = np.array([1499, 0, 733, 733, 5])
    assert interleave.locate(picked)[0].tolist() == sources[picked].tolist()
    assert interleave.locate(picked)[1].tolist() == draws[picked].tolist()


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_python_int_fallback_agrees_with_int64(monkeypatch: pytest.MonkeyPatch, weights: list[Any]) -> None:
    interleave = Interleave(weights)
    positions = np.arange(10**12, 10**12 + 3000)
    fast = interleave.locate(positions)
    assert fast[1].dtype == np.int64
    monkeypatch.setattr(interleave_module, "_INT64_LIMIT", 0)  # every product "overflows"
    exact = interleave.locate(positions)
    assert exact[1].dtype == object
    assert exact[0].tolist() == fast[0].tolist()
    assert exact[1].tolist() == fast[1].tolist()


def test_long_decimal_weights_fall_back_to_python_ints_exactly() -> None:
    # The root's left share is 617283945617/7117283945617: from position ~1.5e7 on, j * p overflows int64.
    weights = [0.1234567891234, 0.3, 1]
    interleave = Interleave(weights)
    positions = np.arange(10**8, 10**8 + 300)
    sources, draws = interleave.locate(positions)
    assert draws.dtype == object
    assert sources.tolist() == brute_force(weights, positions.tolist())
    beyond_int64 = np.array([2**70 + k for k in range(300)], dtype=object)
    for start in (positions, beyond_int64):
        sources, draws = interleave.locate(start)
        for j, s, d in zip(start.tolist(), sources.tolist(), draws.tolist(), strict=True):
            assert interleave.count(s, j) == d  # the draw is the source's positions before j
            assert interleave.count(s, j + 1) == d + 1  # and j is one of them


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), True, "x"])
def test_bad_weights_are_refused(weight: Any) -> None:
    with pytest.raises(ValueError, match="weight"):
        Interleave([1, weight])


# -- the mixture ----------------------------------------------------------------------------------------


class Items:
    """``n`` samples ``(label, k)``, with optional declared attributes."""

    def __init__(self, label: str, n: int, **declared: Any) -> None:
        self.label, self.n = label, n
        self.__dict__.update(declared)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> tuple[str, int]:
        if not 0 <= k < self.n:
            raise IndexError(k)
        return self.label, k


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def mixture(sizes: Sequence[int], weights: Sequence[float], samples_per_epoch: int | None = None) -> Mixture:
    sources = [
        MixtureSource(f"s{i}", Items(f"s{i}", n), w)
        for i, (n, w) in enumerate(zip(sizes, weights, strict=True))
    ]
    return Mixture(sources, samples_per_epoch)


def read_epoch(m: Mixture, epoch: int, seed: int = 0, shuffle: bool = True) -> list[tuple[str, int]]:
    sampler = epoch_sampler(m, seed, shuffle)
    sampler.set_epoch(epoch)
    return [m[k] for k in sampler]


def test_a_mixture_is_its_sources_concatenated_read_in_mixed_order() -> None:
    m = mixture([5, 13, 40], [0.5, 0.3, 0.2])
    assert len(m) == 58
    assert [m[k] for k in range(58)] == [(f"s{i}", k) for i, n in enumerate([5, 13, 40]) for k in range(n)]
    with pytest.raises(IndexError):
        m[58]
    assert m.draws_per_epoch() == {"s0": 29, "s1": 17, "s2": 12}
    assert sum(m.draws_per_epoch().values()) == len(m)
    assert len(mixture([5, 13], [1, 1], samples_per_epoch=1000)) == 1000
    assert read_epoch(m, 0) != read_epoch(m, 1) != read_epoch(m, 1, seed=1)
    assert read_epoch(m, 2) == read_epoch(m, 2)  # a pure function of (seed, epoch)


def test_seen_by_source_counts_what_was_read_across_epochs() -> None:
    m = mixture([5, 13, 40], [0.5, 0.3, 0.2], samples_per_epoch=37)
    read = [label for epoch in range(4) for label, _ in read_epoch(m, epoch)]
    for epochs_done in range(4):
        for position in range(len(m) + 1):
            so_far = read[: epochs_done * len(m) + position]
            expected = {label: so_far.count(label) for label in ("s0", "s1", "s2")}
            assert m.seen_by_source(epochs_done, position) == expected


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_source_is_drawn_in_whole_cycles_continued_across_epochs(shuffle: bool) -> None:
    # s0 (7 samples) is drawn 30 times an epoch: 4 and a bit cycles; s1 (500) a fraction of one.
    m = mixture([7, 500], [0.6, 0.4], samples_per_epoch=50)
    read = [item for epoch in range(5) for item in read_epoch(m, epoch, shuffle=shuffle)]
    for label, size in (("s0", 7), ("s1", 500)):
        drawn = [k for source, k in read if source == label]
        cycles = [drawn[i : i + size] for i in range(0, len(drawn), size)]
        if shuffle:
            assert all(sorted(c) == list(range(size)) for c in cycles[:-1])
            assert len(set(cycles[-1])) == len(cycles[-1])  # the unfinished cycle repeats nothing
            assert len({tuple(c) for c in cycles[:-1]}) == len(cycles) - 1  # each cycle its own order
        else:
            assert drawn == [i % size for i in range(len(drawn))]


def test_the_sampler_order_is_the_same_whole_resumed_and_chunked() -> None:
    m = mixture([20_000, 3_000, 9], [0.6, 0.3, 0.1])  # 23009 positions: three chunks
    sampler = m.epoch_sampler(seed=4, shuffle=True)
    sampler.set_epoch(2)
    whole = list(sampler)
    assert whole == m.indices(2, np.arange(len(m)), seed=4, shuffle=True).tolist()
    for position, first_round in ((0, 0), (10, 8), (8190, 64), (8192, 16), (20_001, 100)):
        sampler.resume_at(position, first_round)
        assert list(sampler) == whole[:first_round] + whole[position:]
    assert list(sampler) == whole  # the resume point is used once


@pytest.mark.parametrize("world_size", [1, 2])
def test_processes_split_the_same_order(world_size: int) -> None:
    m = mixture([30, 11, 4], [0.5, 0.25, 0.25], samples_per_epoch=53)
    expected = read_epoch(m, epoch=3)
    per_rank = []
    for rank in range(world_size):
        sampler = epoch_sampler(m, 0, shuffle=True)
        sampler.set_epoch(3)
        shard = BatchSamplerShard(BatchSampler(sampler, 4, drop_last=False), world_size, rank)
        per_rank.append(list(DataLoader(m, batch_sampler=shard, collate_fn=list)))
    global_order = [item for j in range(len(per_rank[0])) for rank in per_rank for item in rank[j]]
    # The last round's padding repeats the epoch's first samples, after every real one.
    assert global_order[: len(m)] == expected
    assert global_order[len(m) :] == expected[: len(global_order) - len(m)]


def test_declared_attributes_are_the_common_ones() -> None:
    def of(**declared: Any) -> list[Items]:
        return [Items("a", 3, **declared), Items("b", 4, **declared)]

    def mix(a: Items, b: Items) -> Mixture:
        return Mixture([MixtureSource("a", a, 1), MixtureSource("b", b, 1)])

    same = mix(*of(vocab_size=300, eos_id=2, tokens_per_sample=8))
    assert (same.vocab_size, same.eos_id, same.tokens_per_sample) == (300, 2, 8)
    partly = mix(Items("a", 3, vocab_size=300, tokens_per_sample=8), Items("b", 4, tokens_per_sample=7))
    assert (partly.vocab_size, partly.eos_id, partly.tokens_per_sample) == (None, None, None)
    with pytest.raises(ValueError, match=r"'a' and 'b' declare different vocab_size \(300 and 301\)"):
        mix(Items("a", 3, vocab_size=300), Items("b", 4, vocab_size=301))
    rows = mix(Items("a", 3, tokens_per_sample=8), Items("b", 4)).describe()
    assert rows == [
        {
            "label": "a",
            "weight": 0.5,
            "size": 3,
            "draws_per_epoch": 3,
            "tokens_per_epoch": 24,
            "source_epochs_per_epoch": 1.0,
        },
        {
            "label": "b",
            "weight": 0.5,
            "size": 4,
            "draws_per_epoch": 4,
            "tokens_per_epoch": None,
            "source_epochs_per_epoch": 1.0,
        },
    ]


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([], "at least one source"),
        ([MixtureSource("a", Items("a", 2), 1), MixtureSource("a", Items("b", 2), 1)], "distinct labels"),
        ([MixtureSource("a", Stream(), 1)], "'a' is a stream"),
        ([MixtureSource("a", Items("a", 0), 1)], "'a' is empty"),
        ([MixtureSource("a", Items("a", 2), 0)], "'a': a weight must be positive"),
    ],
)
def test_bad_sources_are_refused(sources: list[MixtureSource], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Mixture(sources)


def test_the_sampler_costs_well_under_a_microsecond_per_sample() -> None:
    m = mixture([10**8, 10**6, 10**5], [0.8, 0.15, 0.05], samples_per_epoch=10**6)
    sampler = m.epoch_sampler(seed=0, shuffle=True)
    sampler.set_epoch(7)
    start = time.process_time()  # this process's CPU: parallel test workers do not stretch it
    read = sum(1 for _ in itertools.islice(sampler, 200_000))
    per_sample = (time.process_time() - start) / read
    assert per_sample < 1e-6, f"{per_sample * 1e9:.0f} ns per sample"


# -- the built-in dataset ---------------------------------------------------------------------------------


def token_file(path: Path, count: int, first: int) -> str:
    (np.arange(first, first + count) % 300).astype("<u2").tofile(path)
    return str(path)


def source(path: str, weight: Any = 1, **entry: Any) -> dict[str, Any]:
    options = {"paths": path, "dtype": "uint16", "vocab_size": 300, "seq_len": 9}
    return {"name": "token_files", "weight": weight, "options": options, **entry}


def config_of(name: str, options: dict[str, Any]) -> Config:
    return validate_config(
        {"DATA": {"DATASET": {"NAME": name, "OPTIONS": options}}, "EXPERIMENT": {"SEED": 0}}
    )


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    # 200 tokens: 24 windows of 9 (8 targets each), 5 held out; 120 tokens: 14 windows, 3 held out.
    return token_file(tmp_path / "web.bin", 200, 0), token_file(tmp_path / "code.bin", 120, 7)


def test_builder_mixes_token_files(files: tuple[str, str]) -> None:
    web, code = files
    config = config_of(
        "mixture", {"sources": [source(web, 0.7, label="web"), source(code, 0.3, label="code")]}
    )
    train = build_dataset(config, "train")
    assert isinstance(train, Mixture)
    assert [s.label for s in train.sources] == ["web", "code"]
    assert train.interleave.shares == (Fraction(7, 10), Fraction(3, 10))
    assert (train.vocab_size, train.eos_id, train.tokens_per_sample) == (300, None, 8)
    splits: list[tuple[Split, tuple[int, int]]] = [("train", (19, 11)), ("val", (5, 3))]
    for split, sizes in splits:
        mixed = build_dataset(config, split)
        assert len(mixed) == sum(sizes)  # the sources' samples, as many as they hold together
        alone = [build_dataset(config_of("token_files", source(path)["options"]), split) for path in files]
        assert [len(a) for a in alone] == list(sizes)
        # The mixture's index space is the sources one after the other, items unchanged.
        items = [dataset[i] for dataset in alone for i in range(len(dataset))]
        for k, item in enumerate(items):
            assert mixed[k].keys() == item.keys()
            assert all(torch.equal(mixed[k][name], item[name]) for name in item)
    sized = config_of(
        "mixture", {"samples_per_epoch": 100, "sources": [source(web), source(code, label="c")]}
    )
    assert len(build_dataset(sized, "train")) == 100
    assert len(build_dataset(sized, "val")) == 8  # samples_per_epoch is for training


@register_dataset("test_mixture_stream")
def build_stream(config: Config, split: str) -> Stream:
    return Stream()


MISSING = object()  # an entry's key left out


@pytest.mark.parametrize(
    ("entries", "keys"),
    [
        ([{"weight": 0}], ["sources.0.weight"]),
        ([{}, {"weight": -1}], ["sources.1.weight"]),
        ([{"weight": MISSING}], ["sources.0.weight"]),
        ([{"weight": None}], ["sources.0.weight"]),
        ([{"weight": "0.5"}], ["sources.0.weight"]),
        ([{"label": "x"}, {"label": "x"}], ["sources.1.label"]),  # a real clash: labels given alike
        ([{"weights": 2}], ["sources.0"]),
        ([{"name": "test_mixture_stream", "options": {}}], ["sources.0.name"]),
        ([{}, {"name": "no_such_data", "options": {}}], ["sources.1.name"]),
        ([{"options": {"paths": "x.bin", "seq_len": 1}}], ["sources.0.options.seq_len"]),
        ([{"options": {"paths": "x.bin"}}], ["sources.0.options.paths"]),
        ([{"weight": 0}, {"name": "no_such_data"}], ["sources.0.weight", "sources.1.name"]),  # all at once
    ],
)
def test_builder_names_the_key_of_each_problem(
    files: tuple[str, str], entries: list[dict[str, Any]], keys: list[str]
) -> None:
    sources = [
        {k: v for k, v in {**source(files[i % 2]), **entry}.items() if v is not MISSING}
        for i, entry in enumerate(entries)
    ]
    with pytest.raises(ConfigError) as exc:
        build_dataset(config_of("mixture", {"sources": sources}), "train")
    assert [key for key, _ in exc.value.problems] == [f"DATA.DATASET.OPTIONS.{key}" for key in keys]
    for key, message in exc.value.problems:
        if key.endswith(".weight"):
            assert "a number > 0, the source's share" in message
        if key.endswith(".label"):
            assert "give each source a distinct label" in message
        if key.endswith(".options.paths"):  # a source's own message names the key where it now is
            assert message.startswith("token_files: 'x.bin' is not a file")


@pytest.mark.parametrize(
    ("paths", "labels", "expected"),
    [
        (["data/train_a.bin", "data/train_b.bin"], [None, None], ["train_a", "train_b"]),  # the stems
        (["a/train.bin", "b/train.bin"], [None, None], ["train_0", "train_1"]),  # stems alike: + index
        (["web/*.bin", "code/part-*.bin"], [None, None], ["web", "part"]),  # patterns
        (["web.bin", "code.bin"], ["token_files", None], ["token_files", "code"]),  # given vs default
        (
            ["x.bin", "web.bin", "code.bin"],
            ["code", None, None],
            ["code", "web", "code_2"],
        ),  # a default label never clashes with a given one: + index
        (["web.bin", "code.bin"], [None, "c"], ["token_files", "c"]),  # a name no other shares: kept
    ],
)
def test_unlabelled_sources_that_share_a_name_are_told_apart(
    paths: list[str], labels: list[str | None], expected: list[str]
) -> None:
    raw = [
        {
            "name": "token_files",
            "weight": 1,
            "options": {"paths": p},
            **({} if label is None else {"label": label}),
        }
        for p, label in zip(paths, labels, strict=True)
    ]
    options = DatasetOptions("mixture", {"sources": raw}, "DATA.DATASET.OPTIONS")
    assert [entry.label for entry in parse_sources(options)] == expected
    assert options.problems == []


def test_a_mixture_of_two_unlabelled_token_files_builds(files: tuple[str, str]) -> None:
    train = build_dataset(config_of("mixture", {"sources": [source(files[0]), source(files[1])]}), "train")
    assert [s.label for s in train.sources] == ["web", "code"]  # tmp/web.bin and tmp/code.bin


def test_the_stream_and_unknown_source_messages_say_why(files: tuple[str, str]) -> None:
    stream = {"name": "test_mixture_stream", "weight": 1}
    with pytest.raises(
        ConfigError, match=r"'test_mixture_stream' .* is a stream .* draws its samples by index"
    ):
        build_dataset(config_of("mixture", {"sources": [stream]}), "train")
    with pytest.raises(ConfigError, match="no dataset named 'no_such_data'"):
        build_dataset(config_of("mixture", {"sources": [{"name": "no_such_data", "weight": 1}]}), "train")


VALID = "one valid source"


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({}, "DATA.DATASET.OPTIONS.sources"),
        ({"sources": []}, "DATA.DATASET.OPTIONS.sources"),
        ({"sources": ["token_files"]}, "DATA.DATASET.OPTIONS.sources.0"),
        ({"sources": VALID, "shuffle": True}, "DATA.DATASET.OPTIONS"),
        ({"sources": VALID, "samples_per_epoch": 0}, "DATA.DATASET.OPTIONS.samples_per_epoch"),
    ],
)
def test_builder_checks_its_own_options(files: tuple[str, str], options: dict[str, Any], key: str) -> None:
    if options.get("sources") == VALID:
        options = {**options, "sources": [source(files[0])]}
    with pytest.raises(ConfigError) as exc:
        build_dataset(config_of("mixture", options), "train")
    assert [k for k, _ in exc.value.problems] == [key]


def test_sources_with_different_vocabularies_are_refused(files: tuple[str, str]) -> None:
    other = source(files[1], label="other")
    other["options"]["vocab_size"] = 512
    with pytest.raises(ConfigError, match="'token_files' and 'other' declare different vocab_size") as exc:
        build_dataset(config_of("mixture", {"sources": [source(files[0]), other]}), "train")
    assert [k for k, _ in exc.value.problems] == ["DATA.DATASET.OPTIONS.sources"]


def test_a_model_built_for_a_mixture_reads_what_its_sources_say_alike() -> None:
    """digits_mlp reads the dataset's levels and num_classes: a mixture of digits sources has them
    (it crashed with AttributeError); sources that disagree are named as the reason."""
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model

    config = load_config(REPO / "configs" / "default.yaml", [])
    digits = build_dataset(config, "train")
    mixture = Mixture([MixtureSource("a", digits, 1), MixtureSource("b", digits, 2)])
    alone = build_model(config, digits)
    mixed = build_model(config, mixture)
    assert [p.shape for p in mixed.parameters()] == [p.shape for p in alone.parameters()]
    assert (mixture.levels, mixture.num_classes) == (digits.levels, digits.num_classes)
    odd = Mixture([MixtureSource("a", Items("a", 3, levels=("x",)), 1), MixtureSource("b", Items("b", 3), 1)])
    with pytest.raises(AttributeError, match="'levels': the mixture's sources do not all have it"):
        _ = odd.levels


def test_a_source_drawing_random_windows_is_refused(files: tuple[str, str]) -> None:
    """A mixture reads a source by index, cycle after cycle: random windows would repeat, not be
    drawn afresh, so the option is refused there rather than quietly weakened."""
    drawing = source(files[0])
    drawing["options"] = {**drawing["options"], "windows": "random"}
    with pytest.raises(ConfigError, match=r"draws random windows \(windows: random\).*use aligned"):
        build_dataset(config_of("mixture", {"sources": [drawing, source(files[1], label="b")]}), "train")


@register_dataset("test_mixture_items")
def build_items(config: Config, split: str) -> Items:
    return Items("items", 5)  # no seq_len: it sets no length


def test_sources_cutting_windows_of_different_lengths_are_refused_at_start(
    tmp_path: Path, files: tuple[str, str]
) -> None:
    """One batch stacks samples of every source: windows of 9 and 5 tokens were a traceback in
    collate once training began. Only sources that declare a seq_len are compared."""
    short = source(files[1], label="code")
    short["options"]["seq_len"] = 5
    config = mixture_config(tmp_path, source(files[0], label="web"), short, steps=2)
    reset_accelerate()
    try:
        rc, out, err = run_cli("train", "--cfg", str(config))
    finally:
        reset_accelerate()
    assert rc == 2, out + err
    assert err.strip().splitlines()[1:] == [
        "  DATA.DATASET.OPTIONS.sources.1.options.seq_len: mixture: sources 'web' (seq_len 9) and 'code' "
        "(seq_len 5) cut windows of different lengths, which cannot be stacked into one batch: give every "
        "source the same seq_len (e.g. 9)"
    ]
    assert not (tmp_path / "runs").exists()  # nothing trained
    items = {"name": "test_mixture_items", "weight": 1}
    with pytest.raises(ConfigError) as exc:
        build_dataset(config_of("mixture", {"sources": [source(files[0]), items, short]}), "train")
    assert [k for k, _ in exc.value.problems] == ["DATA.DATASET.OPTIONS.sources.2.options.seq_len"]
