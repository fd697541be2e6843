"""``OPTIONS.windows``: aligned windows (as always) or random offsets drawn with replacement, keyed
by ``(seed, the draw's place in the run)`` so that any processes x accumulation layout and a resume
read the same windows (``linnaeus_accel.data.tokens.windows``). Samplers and datasets only: no
training, no process started."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from helpers.configs import LM_CFG
from torch.utils.data import BatchSampler

from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.sampling import EpochOrderSampler, EpochSeededSampler, epoch_sampler, real_in_batch
from linnaeus_accel.data.tokens.files import TokenFiles
from linnaeus_accel.data.tokens.format import TokenOutOfVocab
from linnaeus_accel.data.tokens.packing import PackedTokens
from linnaeus_accel.data.tokens.windows import VAL_STREAM, DrawSampler, WindowDraws

OPTIONS = "DATA.DATASET.OPTIONS"
SEQ_LEN = 9  # windows of 9 tokens, aligned every 8


def write_tokens(path: Path, tokens: np.ndarray[Any, Any]) -> str:
    tokens.astype("<u2").tofile(path)
    return str(path)


def corpus(tmp_path: Path, lengths: tuple[int, ...] = (203, 77, 5, 130)) -> list[np.ndarray[Any, Any]]:
    """Files ``part-i.bin`` of ``lengths`` tokens (one shorter than a window), ids < 250."""
    rng = np.random.default_rng(0)
    files = [rng.integers(0, 250, n) for n in lengths]
    for i, tokens in enumerate(files):
        write_tokens(tmp_path / f"part-{i}.bin", tokens)
    return files


def config_of(options: dict[str, Any], seed: int = 0, val_fraction: float = 0.2) -> Config:
    dataset = {"NAME": "token_files", "OPTIONS": options, "VAL_FRACTION": val_fraction}
    return validate_config({"DATA": {"DATASET": dataset}, "EXPERIMENT": {"SEED": seed}})


def token_files(tmp_path: Path, windows: str, seed: int = 0, split: str = "train", **more: Any) -> Any:
    options = {"paths": str(tmp_path / "part-*.bin"), "dtype": "uint16", "seq_len": SEQ_LEN, **more}
    return build_dataset(config_of({**options, "windows": windows}, seed), split)  # type: ignore[arg-type]


def window_of(dataset: TokenFiles, draw: int) -> tuple[str, int]:
    part, start = dataset.locate(draw)
    return dataset.parts[part].file.path, start


# -- where random windows start ------------------------------------------------------------------


def test_random_windows_lie_inside_their_file_and_cover_unaligned_starts(tmp_path: Path) -> None:
    files = corpus(tmp_path)
    aligned = TokenFiles.from_paths([tmp_path / "part-*.bin"], SEQ_LEN, dtype="uint16")
    paths = [str(tmp_path / f"part-{i}.bin") for i in range(len(files))]
    dataset = TokenFiles(aligned.parts, SEQ_LEN, windows=WindowDraws("random", seed=3))
    assert len(dataset) == len(aligned)  # an epoch draws as many windows as it cuts
    seen: set[tuple[str, int]] = set()
    for draw in range(4000):
        path, start = window_of(dataset, draw)
        tokens = files[paths.index(path)]
        assert 0 <= start <= len(tokens) - SEQ_LEN  # never past its file's end, never two files
        sample = dataset[draw]
        assert torch.equal(sample["input_ids"], torch.as_tensor(tokens[start : start + SEQ_LEN]))
        assert torch.equal(sample["labels"], sample["input_ids"])
        seen.add((path, start))
    # Every start of every file that holds a window: the unaligned ones, and the file's last tokens
    # (part-0: 203 tokens, aligned windows end at token 200; its last window starts at 194).
    every = {(p, s) for p, t in zip(paths, files, strict=True) for s in range(len(t) - SEQ_LEN + 1)}
    assert seen == every
    assert (paths[0], 194) in seen
    assert any(s % (SEQ_LEN - 1) for _, s in seen)


def test_training_windows_stay_out_of_the_held_out_tokens(tmp_path: Path) -> None:
    corpus(tmp_path, (400,))  # 49 aligned windows: 10 held out (windows 39-48, from token 312)
    train = token_files(tmp_path, "random")
    val = token_files(tmp_path, "random", split="val")
    assert val.windows.mode == "aligned"  # validation stays aligned unless val_windows says
    assert [window_of(val, k)[1] for k in range(len(val))] == [8 * w for w in range(39, 49)]
    ends = [window_of(train, draw)[1] + SEQ_LEN - 1 for draw in range(3000)]
    assert max(ends) == 312  # the first held-out window's first token (an input, never a target)
    random_val = token_files(tmp_path, "random", split="val", val_windows="random")
    assert (random_val.windows.mode, random_val.windows.stream) == ("random", VAL_STREAM)
    starts = {window_of(random_val, draw)[1] for draw in range(2000)}
    assert starts == set(range(312, 400 - SEQ_LEN + 1))  # the held-out tokens and the file's tail


def test_the_same_seed_and_draw_give_the_same_window(tmp_path: Path) -> None:
    corpus(tmp_path)
    first, again = token_files(tmp_path, "random", seed=5), token_files(tmp_path, "random", seed=5)
    copy = pickle.loads(pickle.dumps(first))  # as a DataLoader worker started by spawn has it
    other_seed = token_files(tmp_path, "random", seed=6)
    draws = [0, 1, 2, 17, 10**6, 10**12]
    assert [window_of(first, d) for d in draws] == [window_of(again, d) for d in draws]
    for draw in draws:
        assert torch.equal(first[draw]["input_ids"], copy[draw]["input_ids"])
    assert [window_of(first, d) for d in draws] != [window_of(other_seed, d) for d in draws]
    with pytest.raises(IndexError):
        first[-1]


def test_draws_are_with_replacement_and_every_epoch_draws_anew(tmp_path: Path) -> None:
    corpus(tmp_path)
    dataset = token_files(tmp_path, "random")
    sampler = epoch_sampler(dataset, seed=0, shuffle=True)
    assert isinstance(sampler, DrawSampler)
    n = len(dataset)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        draws = list(sampler)
        assert draws == list(range(epoch * n, (epoch + 1) * n))  # the run's draw numbers
        epochs.append([window_of(dataset, d) for d in draws])
    assert len({tuple(e) for e in epochs}) == 3
    run = [w for e in epochs for w in e]
    assert len(set(run)) < len(run)  # with replacement: some window drawn twice in the run
    sampler.set_epoch(1)
    assert sampler.indices_at([0, 5, n - 1]) == [n, n + 5, 2 * n - 1]


# -- processes x accumulation, resume ----------------------------------------------------------


def layout_steps(
    dataset: Any, processes: int, accumulation: int, batch: int, epoch: int, resume: int | None = None
) -> list[list[tuple[str, int]]]:
    """The real windows of each optimizer step of ``epoch`` as the Trainer's samplers deal them:
    Accelerate's ``BatchSamplerShard`` over each process's own ``epoch_sampler``, process ``p``'s
    ``j``-th batch being global batch ``j * processes + p``. ``resume``: from this global batch on, as
    a resumed run's sampler starts (``resume_at``, then each process drops the round it was given)."""
    per_process = []
    for rank in range(processes):
        sampler: EpochOrderSampler = epoch_sampler(dataset, seed=0, shuffle=True)
        sampler.set_epoch(epoch)
        first = 0
        if resume is not None:
            first = resume // processes
            sampler.resume_at(first * processes * batch, processes * batch)
        shard = BatchSamplerShard(BatchSampler(sampler, batch, drop_last=False), processes, rank)
        batches = list(shard)[1:] if resume is not None and first else list(shard)
        per_process.append(
            [
                [window_of(dataset, i) for i in b[: real_in_batch(len(dataset), batch, processes, j, rank)]]
                for j, b in enumerate(batches, first)
            ]
        )
    micro = [rounds[j] for j in range(len(per_process[0])) for rounds in per_process]  # global order
    steps = [micro[s : s + processes * accumulation] for s in range(0, len(micro), processes * accumulation)]
    return [[w for b in step for w in b] for step in steps]


@pytest.mark.parametrize("windows", ["random", "aligned"])
def test_one_process_accumulating_two_reads_what_two_processes_read(tmp_path: Path, windows: str) -> None:
    corpus(tmp_path)
    dataset = token_files(tmp_path, windows)
    assert len(dataset) % 6  # a last, partial global batch: even-batch repeats are not real
    for epoch in (0, 1):
        one = layout_steps(dataset, processes=1, accumulation=2, batch=3, epoch=epoch)
        two = layout_steps(dataset, processes=2, accumulation=1, batch=3, epoch=epoch)
        assert one == two
        assert sum(map(len, one)) == len(dataset)
        # A resume at global batch 4 (step 2) reads the rest of the epoch as the whole run did.
        for processes, accumulation in ((1, 2), (2, 1)):
            resumed = layout_steps(dataset, processes, accumulation, batch=3, epoch=epoch, resume=4)
            assert resumed == one[2:]
    if windows == "random":
        assert any(start % (SEQ_LEN - 1) for step in one for _, start in step)


def test_the_trainer_loader_uses_the_draw_sampler(tmp_path: Path) -> None:
    from linnaeus_accel.data.sampling import make_dataloader

    corpus(tmp_path)
    config = config_of({"paths": str(tmp_path / "part-*.bin"), "dtype": "uint16", "seq_len": SEQ_LEN})
    dataset = token_files(tmp_path, "random")
    loader = make_dataloader(config.DATA, config.EXPERIMENT.SEED, dataset, train=True)
    assert isinstance(loader.sampler, DrawSampler)
    loader.sampler.set_epoch(2)
    batch = next(iter(loader))
    expected = torch.stack(
        [dataset[2 * len(dataset) + k]["input_ids"] for k in range(len(batch["input_ids"]))]
    )
    assert torch.equal(batch["input_ids"], expected)


# -- aligned, options, vocabulary, PackedTokens ------------------------------------------------


def test_aligned_windows_and_their_order_are_as_before(tmp_path: Path) -> None:
    corpus(tmp_path)
    default = build_dataset(
        config_of({"paths": str(tmp_path / "part-*.bin"), "dtype": "uint16", "seq_len": SEQ_LEN}), "train"
    )
    aligned = token_files(tmp_path, "aligned")
    assert default.windows.mode == aligned.windows.mode == "aligned"
    assert [window_of(default, k) for k in range(len(default))] == [
        window_of(aligned, k) for k in range(len(aligned))
    ]
    sampler = epoch_sampler(default, seed=4, shuffle=True)
    assert type(sampler) is EpochSeededSampler
    assert list(sampler) == list(EpochSeededSampler(default, 4, shuffle=True))
    with pytest.raises(IndexError):
        default[len(default)]


@pytest.mark.parametrize(
    ("options", "keys"),
    [
        ({"windows": "shuffled"}, ["windows"]),
        ({"val_windows": True}, ["val_windows"]),
        ({"windows": 1, "val_windows": "nanogpt"}, ["windows", "val_windows"]),
    ],
)
def test_bad_window_options_name_their_key(tmp_path: Path, options: dict[str, Any], keys: list[str]) -> None:
    corpus(tmp_path)
    base = {"paths": str(tmp_path / "part-*.bin"), "dtype": "uint16", "seq_len": SEQ_LEN}
    with pytest.raises(ConfigError) as refused:
        build_dataset(config_of({**base, **options}), "train")
    assert [k for k, _ in refused.value.problems] == [f"{OPTIONS}.{key}" for key in keys]
    assert all("must be one of aligned, random" in m for _, m in refused.value.problems)
    with pytest.raises(ValueError, match="windows must be one of aligned, random"):
        WindowDraws("shuffled")


def test_random_windows_are_checked_against_the_vocabulary(tmp_path: Path) -> None:
    tokens = np.random.default_rng(1).integers(0, 100, 300)
    tokens[150] = 120
    write_tokens(tmp_path / "part-0.bin", tokens)
    dataset = token_files(tmp_path, "random", vocab_size=200)
    dataset.limit_ids(100, "the model's embedding rows")
    draws = range(2000)
    bad = [d for d in draws if window_of(dataset, d)[1] <= 150 < window_of(dataset, d)[1] + SEQ_LEN]
    good = next(d for d in draws if d not in bad)
    dataset[good]
    with pytest.raises(TokenOutOfVocab, match="150"):
        dataset[bad[0]]


def test_packed_tokens_draw_random_windows_too() -> None:
    tokens = torch.arange(100)  # each window's first token is its start
    aligned = PackedTokens(tokens, SEQ_LEN)
    assert type(epoch_sampler(aligned, 0, True)) is EpochSeededSampler
    packed = PackedTokens(tokens, SEQ_LEN, windows=WindowDraws("random", seed=2))
    assert len(packed) == len(aligned) == 12
    assert isinstance(epoch_sampler(packed, 0, True), DrawSampler)
    starts = []
    for draw in range(1500):
        window = packed[draw]["input_ids"]
        assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + SEQ_LEN))
        starts.append(int(window[0]))
    assert set(starts) == set(range(100 - SEQ_LEN + 1))  # every start, the last tokens' too
    again = PackedTokens(tokens, SEQ_LEN, windows=WindowDraws("random", seed=2))
    assert [int(again[d]["input_ids"][0]) for d in range(50)] == starts[:50]


def test_python_docs_draws_random_training_windows_and_keeps_validation_aligned() -> None:
    from linnaeus_accel.config import ConfigError, load_config
    from linnaeus_accel.data import build_dataset

    aligned = build_dataset(load_config(LM_CFG, []), "train")
    random_cfg = load_config(LM_CFG, ["DATA.DATASET.OPTIONS.windows", "random"])
    drawn = build_dataset(random_cfg, "train")
    assert len(drawn) == len(aligned)  # an epoch is the same number of tokens
    assert any(not torch.equal(drawn[i]["input_ids"], aligned[i]["input_ids"]) for i in range(8))
    val = build_dataset(random_cfg, "val")
    val_aligned = build_dataset(load_config(LM_CFG, []), "val")
    assert all(torch.equal(val[i]["input_ids"], val_aligned[i]["input_ids"]) for i in range(4))
    with pytest.raises(ConfigError, match=r"windows: random windows need random access"):
        build_dataset(load_config(LM_CFG, ["DATA.DATASET.OPTIONS.windows", "random",
                                       "DATA.DATASET.OPTIONS.streaming", "true"]), "train")  # fmt: skip
