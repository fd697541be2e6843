"""``token_files``: training windows cut from token files on disk, as a user meets them.

- Windows: those ``PackedTokens`` cuts from each file alone (none spans two files), the same for
  every layout (raw ``.bin`` uint16/uint32, ``.npy`` of any integer type); files in the order
  given, each glob's matches sorted and never a ``.json`` sidecar.
- Start-up reads no token: a 16 GiB (sparse) file is a dataset, and ``plan`` resolves its run, in
  well under a second. Reading random windows leaves no file mapped (resident memory stays flat),
  keeps few files open, and pickling (DataLoader workers) sends no token.
- Splits: ``VAL_FRACTION`` holds out the last share of every file's windows; ``val_paths`` instead.
- Refusals: every one through the builder is a ConfigError keyed by the option to change, and
  through ``train`` and ``plan`` exit status 2 naming it, with nothing written. An id outside the
  vocabulary in a file without sidecar stops at the window holding it, naming file and position.
- The vocabulary check: a model with fewer outputs than the data's vocabulary or largest id is
  refused before the first step, naming ``MODEL.OPTIONS.vocab_size``.
- End to end (slow): ``configs/lm_tiny.yaml`` on a corpus made with ``tokenize_files``, killed
  with SIGKILL at seeded random moments and rerun until it completes, on 1 process with 2 DataLoader
  workers: final weights byte-identical to the uninterrupted run's, the same metrics (killed on 2
  processes: ``test_lm.py``, whose windows take the same map-style path).
"""

from __future__ import annotations

import gc
import json
import pickle
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.configs import LM_CFG, SMALL_LM
from helpers.in_process import run_cli, run_here_ending_workers
from helpers.processes import kill_tree
from helpers.runs import (
    KILLED,
    Result,
    Started,
    TrainRun,
    assert_resumed_from,
    assert_same_run,
    committed,
    logged_records,
    read_metrics,
    read_summary,
    wait_until,
)
from helpers.tokens import OPTIONS, TINY_LM, cli_opts, config_of, write_sidecar, write_tokens
from torch import Tensor, nn

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.config import ConfigError
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.tokenize.command import tokenize_files
from linnaeus_accel.data.tokens.files import TokenFiles
from linnaeus_accel.data.tokens.format import TokenFileError
from linnaeus_accel.data.tokens.packing import PackedTokens

GIB = 2**30

Window = tuple[int, ...]


# -- files, configs and windows ----------------------------------------------------------------


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` zero bytes that takes no disk space: reading it still costs the time."""
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def random_tokens(n: int, high: int = 257, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, high, n)


def windows(dataset: Any) -> list[Window]:
    """Every sample's ``input_ids``, checking what each sample is: int64, labels equal to them."""
    out = []
    for k in range(len(dataset)):
        sample = dataset[k]
        assert sample["input_ids"].dtype == torch.int64
        assert torch.equal(sample["labels"], sample["input_ids"])
        out.append(tuple(sample["input_ids"].tolist()))
    return out


def packed(tokens: Sequence[int] | np.ndarray[Any, Any], seq_len: int) -> list[Window]:
    """What ``PackedTokens`` cuts from ``tokens`` alone (nothing from fewer than ``seq_len``)."""
    if len(tokens) < seq_len:
        return []
    return windows(PackedTokens(torch.as_tensor(np.asarray(tokens, dtype=np.int64)), seq_len))


# -- windows -----------------------------------------------------------------------------------


def test_windows_of_one_file_are_packed_tokens(tmp_path: Path) -> None:
    tokens = random_tokens(1000)
    path = write_tokens(tmp_path / "one.bin", tokens)
    dataset = TokenFiles.from_paths([path], seq_len=17, dtype="uint16")
    assert (dataset.seq_len, dataset.tokens_per_sample) == (17, 16)
    assert len(dataset) == (1000 - 1) // 16 == 62
    assert windows(dataset) == packed(tokens, 17)
    assert dataset.num_tokens == 62 * 16  # the targets a run counts


def test_windows_never_span_two_files(tmp_path: Path) -> None:
    # Lengths leaving 3, 0 and 4 tokens over, and one file shorter than a window.
    lengths = [100, 16 * 3 + 1, 10, 16 * 4 + 1 + 4]
    files = [random_tokens(n, seed=i) for i, n in enumerate(lengths)]
    paths = [write_tokens(tmp_path / f"part-{i}.bin", tokens) for i, tokens in enumerate(files)]
    dataset = TokenFiles.from_paths(paths, seq_len=17, dtype="uint16")
    assert len(dataset) == sum((n - 1) // 16 for n in lengths) == 6 + 3 + 0 + 4
    # File after file, each cut alone: no window joins one file's tail to the next one's head.
    assert windows(dataset) == [w for tokens in files for w in packed(tokens, 17)]


LAYOUTS = [
    ("bin", "uint16"),
    ("bin", "uint32"),
    *[("npy", dtype) for dtype in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "uint64")],
]


def test_every_layout_gives_the_same_windows(tmp_path: Path) -> None:
    tokens = random_tokens(500, high=128)  # fits every dtype, int8 included
    expected = packed(tokens, 33)
    for suffix, dtype in LAYOUTS:
        path = write_tokens(tmp_path / f"{dtype}.{suffix}", tokens, dtype)
        # A .npy says its dtype in its header; a .bin (without sidecar) needs the option.
        dataset = TokenFiles.from_paths([path], 33, dtype=dtype if suffix == "bin" else None)
        assert windows(dataset) == expected, (suffix, dtype)


def test_bin_takes_its_dtype_from_the_sidecar(tmp_path: Path) -> None:
    tokens = random_tokens(300, high=70_000)  # ids past uint16
    path = write_tokens(tmp_path / "wide.bin", tokens, "uint32")
    write_sidecar(path, "uint32", 300, int(tokens.max()), vocab_size=70_000)
    dataset = build_dataset(config_of({"paths": str(path), "seq_len": 9}, val_fraction=0.1), "train")
    assert windows(dataset) == packed(tokens, 9)[: len(dataset)]
    assert (dataset.vocab_size, dataset.eos_id) == (70_000, 69_999)
    assert (dataset.max_token_id, dataset.max_token_file) == (int(tokens.max()), str(path))


def test_glob_matches_in_sorted_order_and_never_sidecars(tmp_path: Path) -> None:
    # Each file holds one repeated id, so a window says which file it came from.
    for name, fill in (("b.bin", 2), ("a.bin", 1), ("c.npy", 3)):
        write_tokens(tmp_path / name, [fill] * 33)
    write_sidecar(tmp_path / "a.bin", "uint16", 33, 1)
    (tmp_path / "notes.txt").write_text("not tokens")

    def files_read(*patterns: str) -> list[int]:
        dataset = TokenFiles.from_paths([tmp_path / p for p in patterns], 17, dtype="uint16")
        return [w[0] for w in windows(dataset)]

    assert files_read("*") == [1, 1, 2, 2, 3, 3]  # a.bin.json and notes.txt are not token files
    assert files_read("c.npy", "[ab].bin") == [3, 3, 1, 1, 2, 2]  # patterns in the order given


def test_construction_reads_no_token(tmp_path: Path) -> None:
    big = sparse(tmp_path / "big.bin", 16 * GIB)
    started = time.perf_counter()
    dataset = TokenFiles.from_paths([big], seq_len=1025, dtype="uint16")
    elapsed = time.perf_counter() - started
    assert len(dataset) == (8 * GIB - 1) // 1024
    assert elapsed < 1.0, f"{elapsed:.2f} s: reading 16 GiB, even of holes, takes many seconds"
    assert dataset[len(dataset) - 1]["input_ids"].tolist() == [0] * 1025  # a window is read when asked for


def test_pickling_sends_no_tokens(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "one.bin", random_tokens(500_000))  # 1 MB
    dataset = TokenFiles.from_paths([path], seq_len=65, dtype="uint16")
    expected = windows(dataset)  # the file is open now
    blob = pickle.dumps(dataset)  # what a DataLoader worker started by spawn receives
    assert len(blob) < 10_000, len(blob)  # no token, and no descriptor: the copy opens the file itself
    assert windows(pickle.loads(blob)) == expected


def rss_file_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssFile:")[1].split()[0]) / 1024


def test_random_windows_keep_resident_memory_flat(tmp_path: Path) -> None:
    dataset = TokenFiles.from_paths([sparse(tmp_path / "big.bin", 4 * GIB)], seq_len=1025, dtype="uint16")
    dataset[0]
    before = rss_file_mib()
    for k in np.random.default_rng(0).integers(0, len(dataset), 2000).tolist():
        dataset[k]
    # Memory-mapped, the same reads mapped what the kernel read around each window: 127 MiB on the
    # machine this was written on (0.9 MiB a window of a file in the page cache). Read with pread,
    # nothing stays mapped.
    assert rss_file_mib() - before < 16


def open_files() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def test_open_files_stay_few_and_close_with_the_dataset(tmp_path: Path) -> None:
    paths = [write_tokens(tmp_path / f"shard-{i:03d}.bin", random_tokens(33, seed=i)) for i in range(100)]
    gc.collect()  # what earlier tests of this process left for the collector closes now, not below
    before = open_files()
    dataset = TokenFiles.from_paths(paths, seq_len=17, dtype="uint16")
    assert windows(dataset) == [w for p in paths for w in packed(np.fromfile(p, "<u2"), 17)]
    assert open_files() - before <= 64  # a corpus of many shards does not run out of descriptors
    del dataset
    gc.collect()
    assert open_files() == before


# -- splits ------------------------------------------------------------------------------------


def test_val_fraction_holds_out_the_last_windows_of_every_file(tmp_path: Path) -> None:
    first, second = random_tokens(8 * 10 + 1, seed=1), random_tokens(8 * 7 + 4, seed=2)  # 10 and 7 windows
    paths = [str(write_tokens(tmp_path / name, t)) for name, t in (("x.bin", first), ("y.bin", second))]
    config = config_of({"paths": paths, "dtype": "uint16", "seq_len": 9}, val_fraction=0.25)
    train, val = (windows(build_dataset(config, split)) for split in ("train", "val"))
    a, b = packed(first, 9), packed(second, 9)
    # 25% of 10 windows is 2.5, rounded half up to 3; of 7, 1.75 to 2.
    assert train == a[:7] + b[:5]
    assert val == a[7:] + b[5:]
    assert sorted(train + val) == sorted(a + b)  # disjoint, and together every window


def test_val_paths_are_the_validation_files(tmp_path: Path) -> None:
    train_tokens, val_tokens = random_tokens(161, seed=1), random_tokens(81, seed=2)
    options = {
        "paths": str(write_tokens(tmp_path / "train.bin", train_tokens)),
        "val_paths": [str(write_tokens(tmp_path / "val.bin", val_tokens))],
        "dtype": "uint16",
        "seq_len": 9,
    }
    config = config_of(options, val_fraction=0.5)  # not used: nothing of the training files is held out
    assert windows(build_dataset(config, "train")) == packed(train_tokens, 9)
    assert windows(build_dataset(config, "val")) == packed(val_tokens, 9)


# -- refusals ----------------------------------------------------------------------------------


def uint16_file(path: Path, n: int = 100, max_id: int = 256, sidecar: bool = True) -> str:
    """A byte-level token file of ``n`` tokens up to ``max_id``, and its sidecar unless ``sidecar``
    is False."""
    tokens = random_tokens(n, high=256)
    tokens[-1] = max_id
    write_tokens(path, tokens)
    if sidecar:
        write_sidecar(path, "uint16", n, int(tokens.max()))
    return str(path)


def dtype_conflict(tmp: Path) -> dict[str, Any]:
    return {"paths": uint16_file(tmp / "a.bin"), "dtype": "uint32"}


def no_dtype(tmp: Path) -> dict[str, Any]:
    return {"paths": uint16_file(tmp / "a.bin", sidecar=False)}


def sidecar_count_wrong(tmp: Path) -> dict[str, Any]:
    path = Path(uint16_file(tmp / "a.bin", n=100))
    write_tokens(path, random_tokens(90, high=256))  # the file changed after tokenize wrote it
    return {"paths": str(path)}


def odd_size(tmp: Path) -> dict[str, Any]:
    (tmp / "a.bin").write_bytes(bytes(101))
    return {"paths": str(tmp / "a.bin"), "dtype": "uint16"}


def empty_glob(tmp: Path) -> dict[str, Any]:
    return {"paths": str(tmp / "*.bin"), "dtype": "uint16"}


def sidecars_only(tmp: Path) -> dict[str, Any]:
    uint16_file(tmp / "a.bin")
    return {"paths": str(tmp / "*.json")}


def listed_twice(tmp: Path) -> dict[str, Any]:
    return {"paths": [uint16_file(tmp / "a.bin"), str(tmp / "*.bin")]}


def missing(tmp: Path) -> dict[str, Any]:
    return {"paths": str(tmp / "nowhere.bin"), "dtype": "uint16"}


def not_tokens(tmp: Path) -> dict[str, Any]:
    (tmp / "corpus.txt").write_text("text, not tokens")
    return {"paths": str(tmp / "corpus.txt")}


def vocab_below_sidecar(tmp: Path) -> dict[str, Any]:
    return {"paths": uint16_file(tmp / "a.bin", max_id=256), "vocab_size": 200}


def two_vocabularies(tmp: Path) -> dict[str, Any]:
    first = uint16_file(tmp / "a.bin")
    second = write_tokens(tmp / "b.bin", random_tokens(100, high=256))
    write_sidecar(second, "uint16", 100, 255, vocab_size=300)
    return {"paths": [first, str(second)]}


def too_short(tmp: Path) -> dict[str, Any]:
    return {"paths": uint16_file(tmp / "a.bin", n=100), "seq_len": 101}


# (what is wrong, the options it makes, the option named, what the message says)
REFUSALS: list[tuple[str, Callable[[Path], dict[str, Any]], str, str]] = [
    ("dtype-conflicts-with-sidecar", dtype_conflict, "dtype", "a.bin's sidecar says its tokens are uint16, but dtype is uint32: leave dtype out"),
    ("bin-without-sidecar-or-dtype", no_dtype, "dtype", "has no sidecar (a.bin.json) to say its dtype"),
    ("sidecar-num-tokens-disagrees", sidecar_count_wrong, "paths", "holds 90 tokens but its sidecar says 100"),
    ("size-not-a-multiple-of-dtype", odd_size, "paths", "is 101 bytes, not a multiple of 2"),
    ("empty-glob", empty_glob, "paths", "matches no .bin or .npy file"),
    ("glob-of-sidecars", sidecars_only, "paths", "matches no .bin or .npy file"),
    ("file-listed-twice", listed_twice, "paths", "is listed twice"),
    ("missing-file", missing, "paths", "is not a file"),
    ("not-a-token-file", not_tokens, "paths", "is not a token file"),
    ("vocab-size-below-sidecar-max-id", vocab_below_sidecar, "vocab_size", "holds token id 256 (its sidecar's max_token_id), not below vocab_size 200: raise vocab_size to at least 257"),
    ("sidecars-of-two-vocabularies", two_vocabularies, "paths", "were tokenized differently (vocab_size 257 vs 300)"),
    ("no-window-of-seq-len", too_short, "paths", "hold no window of seq_len 101 tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "option", "says"), [pytest.param(*r[1:], id=r[0]) for r in REFUSALS])
def test_refused_options_name_their_key(
    tmp_path: Path, make: Callable[[Path], dict[str, Any]], option: str, says: str
) -> None:
    options = {"seq_len": 9, **make(tmp_path)}
    key = f"{OPTIONS}.{option}"
    with pytest.raises(ConfigError) as refused:
        build_dataset(config_of(options), "train")
    assert [k for k, _ in refused.value.problems] == [key]
    assert says in refused.value.problems[0][1]

    out = tmp_path / "outputs"
    for command in ("train", "plan"):
        code, stdout, stderr = run_cli(command, "--cfg", LM_CFG, *cli_opts(out, options))
        assert code == 2, (command, stdout, stderr)
        assert f"{key}: token_files: " in stderr, stderr
        assert says in stderr
        assert "Traceback" not in stderr
        assert not out.exists()  # nothing written, not even the output directory


@pytest.mark.parametrize(
    ("options", "val_fraction", "key", "says"),
    [
        pytest.param(
            {"val_paths": "nowhere.bin"}, 0.1, f"{OPTIONS}.val_paths", "is not a file", id="val-paths"
        ),
        # 1% of 11 windows is 0.11, which rounds to none
        pytest.param({}, 0.01, "DATA.DATASET.VAL_FRACTION", "holds out no window", id="nothing-held-out"),
    ],
)
def test_refused_validation_split_names_its_key(
    tmp_path: Path, options: dict[str, Any], val_fraction: float, key: str, says: str
) -> None:
    options = {"paths": uint16_file(tmp_path / "a.bin"), "seq_len": 10, **options}
    build_dataset(config_of(options, val_fraction), "train")  # training alone is fine
    with pytest.raises(ConfigError) as refused:
        build_dataset(config_of(options, val_fraction), "val")
    assert [k for k, _ in refused.value.problems] == [key]
    assert says in refused.value.problems[0][1]
    out = tmp_path / "outputs"
    more = ["DATA.DATASET.VAL_FRACTION", str(val_fraction)]
    code, _, stderr = run_cli("train", "--cfg", LM_CFG, *cli_opts(out, options, *more))
    assert code == 2, stderr
    assert key in stderr
    assert "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.parametrize(("dtype", "bad"), [("uint16", 150), ("int16", -1)])
def test_an_id_outside_the_vocabulary_stops_at_its_window(tmp_path: Path, dtype: str, bad: int) -> None:
    """A file without sidecar has no recorded largest id: each window is checked as it is read."""
    tokens = random_tokens(400, high=100)
    tokens[200] = bad  # inside window 12 (tokens 192-208) only
    path = write_tokens(tmp_path / ("tokens.bin" if dtype == "uint16" else "tokens.npy"), tokens, dtype)
    options = {"paths": str(path), "vocab_size": 100, "seq_len": 17}
    options |= {"dtype": dtype} if path.suffix == ".bin" else {}
    dataset = build_dataset(config_of(options, val_fraction=0.2), "train")  # built without reading
    assert dataset.max_token_id is None  # no sidecar recorded one
    for k in range(12):
        dataset[k]
    with pytest.raises(TokenFileError) as stopped:
        dataset[12]
    message = str(stopped.value)
    assert message.startswith(f"{path}: token 200 has id {bad}, outside the vocabulary of 100"), message
    assert "vocab_size" in message
    for k in range(13, len(dataset)):  # the windows after it are read as before
        dataset[k]


# -- the model's vocabulary --------------------------------------------------------------------


@pytest.fixture
def byte_corpus(tmp_path: Path) -> Path:
    """Byte-level tokens of a few documents: ids below 128 but the end-of-document id, 256."""
    text = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog."}) for i in range(40)
    ]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenize_files(text, tmp_path / "tokens" / "docs.bin", progress=False)
    return tmp_path / "tokens" / "docs.bin"


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(
    ("model_vocab", "data_vocab", "says"),
    [
        (200, None, "is 200, but the training data holds token id 256 (in {corpus}): the model would have no output for ids 200 to 256; set it to at least 257"),
        # a vocabulary padded past the tokenizer's: the model must cover all of it
        (300, 320, "is 300, but the training data's vocabulary is 320 ids (its vocab_size): the model would have no output for ids 300 to 319; set it to at least 320"),
    ],
)  # fmt: skip
def test_a_model_vocabulary_too_small_is_refused_before_training(
    byte_corpus: Path, tmp_path: Path, model_vocab: int, data_vocab: int | None, says: str
) -> None:
    out = tmp_path / "outputs"
    options: dict[str, Any] = {"paths": str(byte_corpus), "seq_len": 33, "vocab_size": data_vocab}
    more = [*TINY_LM, "MODEL.OPTIONS.vocab_size", str(model_vocab)]
    code, _, stderr = run_cli("train", "--cfg", LM_CFG, *cli_opts(out, options, *more))
    # Refused before the model runs: the first windows hold id 256, past a 200-row embedding
    # (an IndexError on a CPU, a device-side assert that ends the process on a GPU).
    assert code == 2, stderr
    assert f"MODEL.OPTIONS.vocab_size: {says.format(corpus=byte_corpus)}" in stderr, stderr
    assert "Traceback" not in stderr
    assert not out.exists()


class NarrowHead(nn.Module):
    """Embeds every byte-level id but predicts only the first 200: a model built in Python, whose
    vocabulary no config option states."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(257, 8), nn.Linear(8, 200)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.head(self.embed(input_ids).cumsum(1))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_model_whose_logits_are_too_few_is_refused(byte_corpus: Path, tmp_path: Path) -> None:
    config = load_config(
        LM_CFG, cli_opts(tmp_path / "outputs", {"paths": str(byte_corpus), "seq_len": 33})[1:]
    )
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    with pytest.raises(ConfigError) as refused:
        Trainer(config, NarrowHead(), train, val)
    message = str(refused.value)
    assert (
        "the model's logits have 200 entries per token, but the training data holds token id 256" in message
    )
    assert "give it at least 257 outputs (MODEL.OPTIONS.vocab_size for hf_causal_lm)" in message
    assert not (tmp_path / "outputs").exists()


# -- plan --------------------------------------------------------------------------------------


def test_plan_counts_tokens_per_step_without_reading_tokens(tmp_path: Path) -> None:
    big = sparse(tmp_path / "big.bin", 16 * GIB)
    options = {"paths": str(big), "dtype": "uint16", "seq_len": 1025}
    started = time.perf_counter()
    code, stdout, stderr = run_cli("plan", "--cfg", LM_CFG, *cli_opts(tmp_path / "outputs", options))
    elapsed = time.perf_counter() - started
    assert code == 0, stderr
    windows_in_file = (8 * GIB - 1) // 1024
    held_out = round(windows_in_file * 0.1)  # lm_tiny's VAL_FRACTION
    assert f"Data:     {windows_in_file - held_out} training samples" in stdout
    assert "Tokens:   16384 target tokens per step" in stdout  # 16 sequences of 1024 targets
    assert elapsed < 2.0, f"plan took {elapsed:.2f} s"


# -- end to end: killed at random moments, resumed byte-identical ------------------------------

STEPS_ONE = 120  # 1 process, batch 8: 113 steps an epoch, so the run crosses one boundary


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 64,000 byte-level tokens of the standard library's help topics, tokenized into a
    .bin (from a .txt: one document) and a .npy (from JSON Lines: one topic a document)."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("corpus")
    names = sorted(topics)
    (root / "intro.txt").write_text("".join(topics[n] for n in names[:10]), encoding="utf-8")
    lines = [json.dumps({"text": topics[n]}) for n in names[10:21]]
    (root / "more.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenize_files(root / "intro.txt", root / "tokens" / "part-0.bin", progress=False)
    tokenize_files(root / "more.jsonl", root / "tokens" / "part-1.npy", progress=False)
    return root / "tokens"


def corpus_opts(corpus: Path, processes: int, steps: int, *more: str) -> list[str]:
    """lm_tiny with test_lm's small model, checkpoints every 20 steps, on the corpus in windows of 65."""
    options = json.dumps({"paths": str(corpus / "part-*"), "seq_len": 65})
    return [
        *SMALL_LM,
        "DATA.DATASET.NAME", "token_files",
        OPTIONS, options,
        "MODEL.OPTIONS.max_position_embeddings", "65",
        "TRAIN.TARGET_TOKENS", str(steps * processes * 8 * 64),
        *more,
    ]  # fmt: skip


def reference(root: Path, opts: list[str], processes: int, steps: int) -> Result:
    root.mkdir()
    run = TrainRun(root, opts, processes=processes, cfg=LM_CFG)
    # One process trains here: its own would spend seconds importing torch, and the runs it is
    # compared with are real processes.
    result = (run_here_ending_workers(run) if processes == 1 else run.run()).check_ok()
    data = read_summary(result.dir)
    assert (data["global_step"], data["epoch"]) == (steps, 2), data
    assert data["tokens_seen"] == steps * processes * 8 * 64
    losses = [r["val/loss"] for r in read_metrics(result.dir) if "val/loss" in r]
    assert len(losses) == 2
    assert losses[1] < losses[0] < 5.55  # it learns (ln 257 = 5.55 at random)
    return result


def logged_step(run_dir: Path) -> int:
    """The last training step in metrics.jsonl (0 before any)."""
    return max((r["global_step"] for r in logged_records(run_dir) if "train/loss" in r), default=0)


def wait_for_step(started: Started, step: int) -> None:
    wait_until(started, lambda: logged_step(started.dir) >= step, f"it logged step {step}")


def killed_until_complete(run: TrainRun, spans: list[tuple[int, int]], seed: int) -> Result:
    """Launch ``run``; once it has logged a seeded random step of ``spans[i]`` (past what earlier
    launches logged), wait a seeded random 0-200 ms, so that the SIGKILL lands anywhere in a step,
    a checkpoint write or a validation pass, and kill it and its workers; relaunch, and let the
    last launch complete. Each relaunch must resume from the newest committed checkpoint."""
    moments = random.Random(seed)
    for low, high in spans:
        before = logged_step(run.dir)
        newest = committed(run.dir)[-1:]
        started = run.start()
        wait_for_step(started, max(moments.randint(low, high), before + 5))
        time.sleep(moments.uniform(0.0, 0.2))
        kill_tree(started.proc.pid)
        killed = started.finish()
        assert killed.returncode == KILLED, killed.tail()
        assert not (run.dir / "summary.json").exists(), "killed after the run completed"
        if newest:
            assert_resumed_from(killed.output, int(newest[0].removeprefix("step_")))
        assert committed(run.dir), "killed before the first checkpoint: nothing to resume from"
    newest = committed(run.dir)[-1]
    resumed = run.run()
    assert_resumed_from(resumed.output, int(newest.removeprefix("step_")))
    return resumed


@pytest.mark.slow
def test_one_process_with_workers_killed_at_random_moments_resumes_byte_identical(
    corpus: Path, tmp_path: Path
) -> None:
    opts = corpus_opts(corpus, 1, STEPS_ONE, "DATA.NUM_WORKERS", "2")
    ref = reference(tmp_path / "reference", opts, 1, STEPS_ONE)
    (tmp_path / "killed").mkdir()
    run = TrainRun(tmp_path / "killed", opts, cfg=LM_CFG)
    # Killed at a random moment between the checkpoint of step 60 and the epoch boundary (113).
    resumed = killed_until_complete(run, [(65, 108)], seed=20261125)
    assert_same_run(resumed, ref)
