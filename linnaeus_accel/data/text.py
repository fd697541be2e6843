"""``python_docs``: a small language-modelling corpus that ships with Python, so nothing is downloaded.

The texts are the help topics of CPython's ``pydoc_data.topics`` (what ``help("if")`` prints;
about 465 KB of English documentation), tokenised as UTF-8 bytes with an end-of-document token.

Train and validation are split by topic with a fixed permutation (seeded by 0, independent of
``EXPERIMENT.SEED``), so runs with different seeds are validated on the same text, and no topic is
seen in training and validation both.

``DATA.DATASET.OPTIONS``:

- ``seq_len`` (int >= 2, default 128): tokens per sample (``seq_len - 1`` prediction targets);
- ``streaming`` (bool, default false): a ``PackedTokenStream`` (an iterable dataset whose training
  split shuffles the topics per epoch by ``EXPERIMENT.SEED``) instead of a map-style
  ``PackedTokens`` over the split's topics in a fixed order.
- ``windows`` (``aligned``, default, or ``random``): training windows at aligned offsets, or at
  uniform random offsets drawn with replacement (nanoGPT's), keyed by ``EXPERIMENT.SEED`` and the
  draw's place in the run (``data.tokens.windows``); validation stays aligned. Map-style only.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ..config import Config, ConfigError
from ..schedule.steps import decimal_of, round_half_up
from .registry import Split, register_dataset
from .tokens.packing import BYTE_EOS, BYTE_VOCAB_SIZE, PackedTokens, PackedTokenStream
from .tokens.windows import ALIGNED, WINDOWS, WindowDraws

OPTIONS_KEY = "DATA.DATASET.OPTIONS"
DEFAULT_SEQ_LEN = 128


@lru_cache(maxsize=1)
def load_topics() -> tuple[tuple[str, bytes], ...]:
    """Every help topic as (name, UTF-8 text), sorted by name so the order is the installation's
    content, not its dict order."""
    try:
        module = importlib.import_module("pydoc_data.topics")
    except ImportError:
        raise ConfigError(
            [
                (
                    "DATA.DATASET.NAME",
                    "python_docs reads the help topics in the standard library's pydoc_data, "
                    "which this Python installation lacks: install a full Python or use another dataset",
                )
            ]
        ) from None
    topics: dict[str, str] = module.topics
    return tuple((name, topics[name].encode("utf-8")) for name in sorted(topics))


def split_topics(n: int, val_fraction: float) -> dict[Split, list[int]]:
    """Topic indices per split: a fixed permutation, validation share rounded half up, and at
    least one topic on each side (an empty split would fail later, less clearly)."""
    order = np.random.default_rng(0).permutation(n)
    n_val = min(max(round_half_up(decimal_of(val_fraction) * n), 1), n - 1)
    return {"val": sorted(order[:n_val].tolist()), "train": sorted(order[n_val:].tolist())}


class PythonDocs(PackedTokens):
    """Map-style: the split's topics joined (each followed by ``eos_id``) and packed."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS

    def __init__(
        self, topics: Sequence[tuple[str, bytes]], seq_len: int, windows: WindowDraws = ALIGNED
    ) -> None:
        self.topics = tuple(name for name, _ in topics)
        eos = np.array([BYTE_EOS], dtype=np.uint16)
        pieces = [p for _, text in topics for p in (np.frombuffer(text, dtype=np.uint8), eos)]
        super().__init__(np.concatenate(pieces).astype(np.uint16), seq_len, windows=windows)


class PythonDocsStream(PackedTokenStream):
    """Iterable: the same windows as ``PythonDocs`` for the same topic order, shuffled per epoch
    when ``seed`` is given."""

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, topics: Sequence[tuple[str, bytes]], seq_len: int, seed: int | None) -> None:
        self.topics = tuple(name for name, _ in topics)
        super().__init__([text for _, text in topics], seq_len, eos_id=BYTE_EOS, seed=seed)


def parse_options(options: dict[str, Any]) -> tuple[int, bool, str]:
    """``(seq_len, streaming, windows)``, every problem reported at once."""
    problems: list[tuple[str, str]] = []
    unknown = sorted(set(options) - {"seq_len", "streaming", "windows"})
    if unknown:
        problems.append(
            (OPTIONS_KEY, f"python_docs takes seq_len, streaming and windows, not {', '.join(unknown)}")
        )
    seq_len = options.get("seq_len", DEFAULT_SEQ_LEN)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        problems.append((OPTIONS_KEY, f"seq_len must be an integer of at least 2, got {seq_len!r}"))
    streaming = options.get("streaming", False)
    if not isinstance(streaming, bool):
        problems.append((OPTIONS_KEY, f"streaming must be true or false, got {streaming!r}"))
    windows = options.get("windows", "aligned")
    if windows not in WINDOWS:
        problems.append((f"{OPTIONS_KEY}.windows", f"must be one of {', '.join(WINDOWS)}, got {windows!r}"))
    elif windows == "random" and streaming is True:
        problems.append(
            (
                f"{OPTIONS_KEY}.windows",
                "random windows need random access: leave streaming out, or use aligned",
            )
        )
    if problems:
        raise ConfigError(problems)
    return seq_len, streaming, windows


@register_dataset("python_docs")
def build_python_docs(config: Config, split: Split) -> PythonDocs | PythonDocsStream:
    seq_len, streaming, windows = parse_options(dict(config.DATA.DATASET.OPTIONS))
    topics = load_topics()
    chosen = [topics[i] for i in split_topics(len(topics), config.DATA.DATASET.VAL_FRACTION)[split]]
    try:
        if streaming:
            seed = config.EXPERIMENT.SEED if split == "train" else None
            return PythonDocsStream(chosen, seq_len, seed=seed)
        # Random windows for training only: validation reads the same aligned windows every pass.
        draws = WindowDraws(windows, config.EXPERIMENT.SEED) if split == "train" else ALIGNED
        return PythonDocs(chosen, seq_len, draws)
    except ValueError as exc:  # seq_len longer than the split
        raise ConfigError([(OPTIONS_KEY, f"python_docs {split} split: {exc}")]) from None
