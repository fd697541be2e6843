"""``TokenFiles``: training windows cut from token files on disk, each read when it is asked for.

A sample is ``seq_len`` consecutive tokens of one file; windows overlap by one token, as
``PackedTokens`` cuts them (window ``k`` of a file starts at token ``k * (seq_len - 1)``, so every
token after a file's first is a target exactly once and ``tokens_per_sample = seq_len - 1``). A
file's last tokens that do not fill a window are left out; windows never span two files. Or, with
``windows: random``, windows start at offsets drawn with replacement (``token_windows``).

Start-up reads no token: a file's token count comes from its length (``.npy``: its header), its
dtype and vocabulary from the ``tokenize`` sidecar (``<file>.json``) when there is one. So a corpus
of any size starts in the time it takes to list its files. Each process (and DataLoader worker)
opens the files it reads lazily, read-only, and reads a window with one ``pread`` of its tokens,
converted to int64. Resident memory grows neither with the corpus nor with the windows read: a few
open descriptors (``_OPEN_FILES``), nothing mapped; the kernel's page cache keeps what was read
for the next epoch or run, outside the process. (A memory map was tried first: a page fault in a
random window maps whatever the kernel read around it, whole large folios of the page cache; on
Linux 6.18 that was ~0.9 MiB of ``RssFile`` a window, 3.7 GiB after 4,096 shuffled windows of a
4 GB corpus, and reading was slower than ``pread``, 6 us a window against 4.)

Token ids are checked against the vocabulary without reading every token at start: a file with a
sidecar records its largest id, compared with ``vocab_size`` at construction (and by the Trainer with
the model's); and every window is checked as it is read (the maximum of its ``seq_len`` tokens, next
to the int64 copy made anyway) against the data's ``vocab_size`` and the model's embedding rows
(``token_vocab``): a bad id stops the run naming the file and the token's position.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ...config import Config, ConfigError
from ...schedule.steps import decimal_of, round_half_up
from ..options import DatasetOptions
from ..registry import Split, register_dataset
from ..sampling import EpochOrderSampler
from .corpus import (
    FileWindows,
    OptionConflict,
    TokenFile,
    corpus_vocabulary,
    expand_paths,
    open_token_file,
)
from .format import BIN_DTYPES, TokenFileError
from .vocab import NO_LIMIT, out_of_vocab
from .windows import ALIGNED, RandomOffsets, WindowDraws, file_spans, window_option, window_sampler

_OPEN_FILES = 64  # file descriptors kept open per process, the least recently read closed first


def _close_all(descriptors: OrderedDict[int, int]) -> None:
    """Close the files a collected ``TokenFiles`` kept open."""
    for descriptor in descriptors.values():
        with contextlib.suppress(OSError):
            os.close(descriptor)
    descriptors.clear()


class TokenFiles(Dataset[dict[str, torch.Tensor]]):
    """Map-style windows over token files (see the module docstring). Sample ``k`` is found by a
    binary search over the files' window counts: O(log files), no token read but the window's.

    ``max_token_id``: the largest id the sidecars of its files recorded, and ``max_token_file`` the
    file that holds it (None when none of its files has a sidecar; files without one may hold
    larger ids): what a model's vocabulary must exceed. Every window read is checked against
    ``vocab_size`` and what ``limit_ids`` adds (the model's vocabulary), whatever the sidecars say.
    ``windows`` random: item ``g`` (any int >= 0, the run's draw number ``epoch_sampler`` yields)
    is a window at a random offset (``token_windows``).
    """

    windows: WindowDraws = ALIGNED  # (class defaults: a subclass that sets its own fields is aligned)
    _random: RandomOffsets | None = None

    def __init__(
        self,
        parts: Sequence[FileWindows],
        seq_len: int,
        *,
        vocab_size: int | None = None,
        eos_id: int | None = None,
        windows: WindowDraws = ALIGNED,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 (one input and one target token), got {seq_len}")
        self.parts = [p for p in parts if p.count > 0]
        self.seq_len = seq_len
        self.tokens_per_sample = seq_len - 1
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._ends = np.cumsum([p.count for p in self.parts]).tolist()
        # Every window is checked as it is read, against the smallest vocabulary known (limit_ids).
        self._limit, self._limit_what = NO_LIMIT, "none known"
        if vocab_size is not None:
            self.limit_ids(vocab_size, "the data's vocab_size")
        recorded = [(p.file.sidecar.max_token_id, p.file.path) for p in self.parts if p.file.sidecar]
        top = max(recorded, default=(-1, ""), key=lambda pair: pair[0])
        self.max_token_id: int | None = top[0] if top[0] >= 0 else None
        self.max_token_file: str | None = top[1] if top[0] >= 0 else None
        # The tokenizer.json the tokens came from, where it still is (final/ ships it with the model).
        described = [p.file.sidecar.tokenizer for p in self.parts if p.file.sidecar is not None]
        paths = [t.get("path") for t in described if t.get("type") == "tokenizers"]
        self.tokenizer_file: str | None = next(
            (p for p in paths if isinstance(p, str) and os.path.isfile(p)), None
        )
        self._descriptors: OrderedDict[int, int] = OrderedDict()  # part -> open file, least recent first
        weakref.finalize(self, _close_all, self._descriptors)
        # What reading a window of each part takes, worked out once: __getitem__ runs per sample.
        self._starts = [0, *self._ends[:-1]]  # the sample index of each part's first window
        self._dtypes = [np.dtype(p.file.layout.dtype).newbyteorder("<") for p in self.parts]
        self._window_bytes = [seq_len * dtype.itemsize for dtype in self._dtypes]
        self._offsets = [p.file.layout.offset for p in self.parts]
        self._len = len(self)
        self.windows = windows
        self._random = RandomOffsets(file_spans(self.parts, seq_len), windows) if windows.random else None

    @classmethod
    def from_paths(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        seq_len: int,
        *,
        dtype: str | None = None,
        vocab_size: int | None = None,
    ) -> TokenFiles:
        """Every window of the files (and glob patterns) ``paths``."""
        files = [open_token_file(p, dtype) for p in expand_paths([str(p) for p in paths])]
        vocab, eos = corpus_vocabulary(files, vocab_size)
        return cls(
            [FileWindows(f, 0, f.windows(seq_len)) for f in files], seq_len, vocab_size=vocab, eos_id=eos
        )

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def num_tokens(self) -> int:
        """Target tokens over all samples (``tokens_per_sample`` each)."""
        return len(self) * self.tokens_per_sample

    def locate(self, k: int) -> tuple[int, int]:
        """``(part, token offset in its file)`` of sample ``k`` (random windows: of draw ``k``)."""
        if self._random is not None:
            return self._random.locate(k)
        n = len(self)
        if not 0 <= k < n:
            raise IndexError(f"sample {k} out of range for {n} samples")
        part = bisect.bisect_right(self._ends, k)
        window = self.parts[part].first + k - (self._ends[part - 1] if part else 0)
        return part, window * self.tokens_per_sample

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        # locate() inlined, and what a read needs cached per part: ~15% of a
        # window's cost (a DataLoader without workers reads every window on the training process).
        k = int(k)
        if self._random is not None:
            part, start = self._random.locate(k)
        elif not 0 <= k < self._len:
            raise IndexError(f"sample {k} out of range for {self._len} samples")
        else:
            part = bisect.bisect_right(self._ends, k)
            start = (self.parts[part].first + k - self._starts[part]) * self.tokens_per_sample
        dtype, size = self._dtypes[part], self._window_bytes[part]
        data = os.pread(self._descriptor(part), size, self._offsets[part] + start * dtype.itemsize)
        if len(data) < size:
            raise self._truncated(part, start, len(data) // dtype.itemsize)
        window = np.frombuffer(data, dtype=dtype).astype(np.int64)  # a copy, not a view
        # One reduction a window (~1 us for 1024 tokens): unsigned, a negative id is past any limit.
        if window.view(np.uint64).max() >= self._limit:
            raise out_of_vocab(self.parts[part].file, start, window, self._limit, self._limit_what)
        ids = torch.from_numpy(window)
        return {"input_ids": ids, "labels": ids.clone()}

    def epoch_sampler(self, seed: int, shuffle: bool) -> EpochOrderSampler:
        """The Trainer's order (``sampling.epoch_sampler``): random windows' draw numbers, else shuffled."""
        return window_sampler(self, self.windows, seed, shuffle)

    def limit_ids(self, limit: int, what: str) -> None:
        """Refuse windows holding an id at or past ``limit`` too (``what``: where it comes from, as
        the error says it, e.g. the model's embedding rows); the smallest limit given holds."""
        if limit < self._limit:
            self._limit, self._limit_what = limit, what

    def _truncated(self, part: int, start: int, found: int) -> TokenFileError:
        return TokenFileError(
            f"{self.parts[part].file.path} ends {found} tokens after token {start}, inside a window of "
            f"{self.seq_len}: the file was truncated after the run started"
        )

    def _descriptor(self, part: int) -> int:
        """``part``'s open file (a positional read is safe on a descriptor forked DataLoader workers
        share), opened when first read; past ``_OPEN_FILES``, the least recently read is closed."""
        descriptor = self._descriptors.get(part)
        if descriptor is None:
            descriptor = self._descriptors[part] = os.open(self.parts[part].file.path, os.O_RDONLY)
            if len(self._descriptors) > _OPEN_FILES:
                os.close(self._descriptors.popitem(last=False)[1])
        elif len(self._descriptors) > 1:
            self._descriptors.move_to_end(part)
        return descriptor

    def __getstate__(self) -> dict[str, Any]:
        # A descriptor means nothing in another process (a DataLoader worker started by spawn):
        # the copy opens the files itself.
        state = dict(self.__dict__)
        state["_descriptors"] = OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        weakref.finalize(self, _close_all, self._descriptors)

    def __repr__(self) -> str:
        files = len({p.file.path for p in self.parts})
        return f"TokenFiles({files} files, {len(self)} {self.windows.mode} windows of {self.seq_len} tokens)"


# -- the built-in dataset ``token_files`` -----------------------------------------------------------
OPTIONS_KEY = "DATA.DATASET.OPTIONS"
DEFAULT_SEQ_LEN = 1024


def held_out(count: int, fraction: float) -> int:
    """Windows of a ``count``-window file held out for validation: its last ``fraction``, rounded
    half up (the split of every file, so validation samples every source of a corpus)."""
    return round_half_up(decimal_of(fraction) * count)


def split_parts(files: Sequence[TokenFile], seq_len: int, fraction: float, split: Split) -> list[FileWindows]:
    parts = []
    for f in files:
        total = f.windows(seq_len)
        val = held_out(total, fraction)
        parts.append(FileWindows(f, total - val, val) if split == "val" else FileWindows(f, 0, total - val))
    return parts


@register_dataset("token_files")
def build_token_files(config: Config, split: Split) -> TokenFiles:
    """``DATA.DATASET.OPTIONS``: ``paths`` (files or glob patterns), ``seq_len`` (default 1024),
    ``dtype`` (uint16 or uint32, for a ``.bin`` without sidecar), ``vocab_size`` (default the
    sidecar's; more is allowed, e.g. padded to a multiple of 64), ``val_paths`` (validation files;
    without them, the last ``DATA.DATASET.VAL_FRACTION`` of every file's windows is held out),
    ``windows`` / ``val_windows`` (aligned or random, default aligned: see ``token_windows``)."""
    options = DatasetOptions("token_files", config.DATA.DATASET.OPTIONS, OPTIONS_KEY)
    paths = options.strings("paths", required=True)
    val_paths = options.strings("val_paths")
    seq_len = options.integer("seq_len", DEFAULT_SEQ_LEN, minimum=2)
    dtype = options.text("dtype", None, BIN_DTYPES)
    vocab_size = options.integer("vocab_size", None, minimum=1)
    windows = window_option(options, split, config.EXPERIMENT.SEED)
    options.finish()
    assert paths is not None
    chosen, key = (val_paths, "val_paths") if split == "val" and val_paths else (paths, "paths")
    try:
        files = [open_token_file(p, dtype) for p in expand_paths(chosen)]
        vocab, eos = corpus_vocabulary(files, vocab_size)
    except OptionConflict as exc:
        raise ConfigError([(f"{OPTIONS_KEY}.{exc.option}", f"token_files: {exc}")]) from None
    except (TokenFileError, OSError) as exc:
        raise ConfigError([(f"{OPTIONS_KEY}.{key}", f"token_files: {exc}")]) from None
    if val_paths:
        parts = [FileWindows(f, 0, f.windows(seq_len)) for f in files]
    else:
        parts = split_parts(files, seq_len, config.DATA.DATASET.VAL_FRACTION, split)
    dataset = TokenFiles(parts, seq_len, vocab_size=vocab, eos_id=eos, windows=windows)
    if len(dataset) == 0:
        if split == "val" and not val_paths:
            fix = f"raise it, or give {OPTIONS_KEY}.val_paths"
            problem = (
                "DATA.DATASET.VAL_FRACTION",
                f"holds out no window of {seq_len} tokens for validation: {fix}",
            )
        else:
            says = f"the {split} files hold no window of seq_len {seq_len} tokens: add data or lower seq_len"
            problem = (f"{OPTIONS_KEY}.{key}", f"token_files: {says}")
        raise ConfigError([problem])
    return dataset
