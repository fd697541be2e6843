"""The files of a token corpus, read at start-up without reading a token: paths and glob patterns
(``expand_paths``), each file's layout and sidecar (``open_token_file``), and the vocabulary the
sidecars agree on (``corpus_vocabulary``). ``TokenFiles`` (``token_files``) reads their windows.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..paths import resolved
from .format import (
    BIN_DTYPES,
    TOKEN_SUFFIXES,
    TokenFileError,
    TokenFileLayout,
    TokenSidecar,
    bin_layout,
    npy_layout,
    read_sidecar,
)


class OptionConflict(TokenFileError):
    """A token file at odds with an option (``dtype``, ``vocab_size``): the option is what to change."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class TokenFile:
    """One file's tokens and what its sidecar (if any) says about them."""

    layout: TokenFileLayout
    sidecar: TokenSidecar | None

    @property
    def path(self) -> str:
        return self.layout.path

    def windows(self, seq_len: int) -> int:
        return max(0, (self.layout.num_tokens - 1) // (seq_len - 1))


@dataclass(frozen=True)
class FileWindows:
    """Windows ``first .. first + count - 1`` of a file (a split takes a range of each file)."""

    file: TokenFile
    first: int
    count: int


def expand_paths(patterns: Sequence[str]) -> list[Path]:
    """Files and glob patterns, each pattern's matches in sorted order, in the order given. A
    pattern matches token files only (``.bin``, ``.npy``), never their ``.json`` sidecars."""
    paths: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(m for m in glob.glob(expanded, recursive=True) if m.endswith(TOKEN_SUFFIXES))
            if not matches:
                raise TokenFileError(f"{pattern!r} matches no .bin or .npy file{resolved(pattern)}")
            paths += [Path(m) for m in matches]
            continue
        path = Path(expanded)
        if not path.is_file():
            raise TokenFileError(f"{pattern!r} is not a file{resolved(pattern)}")
        if not path.name.endswith(TOKEN_SUFFIXES):
            raise TokenFileError(f"{pattern!r} is not a token file: expected .bin (raw) or .npy")
        paths.append(path)
    seen: set[Path] = set()
    for path in paths:
        if path.resolve() in seen:
            raise TokenFileError(f"{path} is listed twice: each file would be trained on twice per epoch")
        seen.add(path.resolve())
    return paths


def open_token_file(path: Path, dtype: str | None) -> TokenFile:
    """A file's layout from its header and length; the dtype of a ``.bin`` from its sidecar, or
    from ``dtype`` when it has none (given both, they must agree)."""
    sidecar = read_sidecar(path)
    if path.suffix == ".npy":
        layout = npy_layout(path)
        if sidecar is not None and sidecar.dtype != layout.dtype:
            raise TokenFileError(f"{path} holds {layout.dtype} tokens but its sidecar says {sidecar.dtype}")
    else:
        if sidecar is not None and dtype is not None and sidecar.dtype != dtype:
            raise OptionConflict(
                "dtype",
                f"{path}'s sidecar says its tokens are {sidecar.dtype}, but dtype is {dtype}: leave dtype out",
            )
        chosen = sidecar.dtype if sidecar is not None else dtype
        if chosen is None:
            raise OptionConflict(
                "dtype",
                f"{path} has no sidecar ({path.name}.json) to say its dtype: give dtype ({' or '.join(BIN_DTYPES)})",
            )
        layout = bin_layout(path, chosen, from_sidecar=sidecar is not None)
    if sidecar is not None and sidecar.num_tokens != layout.num_tokens:
        raise TokenFileError(
            f"{path} holds {layout.num_tokens} tokens but its sidecar says {sidecar.num_tokens}: "
            "the file was changed or truncated after tokenize wrote it"
        )
    return TokenFile(layout, sidecar)


def corpus_vocabulary(files: Sequence[TokenFile], vocab_size: int | None) -> tuple[int | None, int | None]:
    """``(vocab_size, eos_id)`` of a corpus: what the sidecars say (they must agree), or
    ``vocab_size`` as given, which must exceed every id the sidecars recorded."""
    described = [f for f in files if f.sidecar is not None]
    eos_id: int | None = None
    if described:
        first = described[0]
        assert first.sidecar is not None
        for other in described[1:]:
            assert other.sidecar is not None
            for name in ("vocab_size", "eos_id", "tokenizer"):
                mine, theirs = getattr(first.sidecar, name), getattr(other.sidecar, name)
                if name == "tokenizer":  # the same tokenizer.json (by its digest), wherever it was
                    mine, theirs = _without_path(mine), _without_path(theirs)
                if mine != theirs:
                    raise TokenFileError(
                        f"{first.path} and {other.path} were tokenized differently ({name} "
                        f"{mine!r} vs {theirs!r}): one run trains on one vocabulary"
                    )
        eos_id = first.sidecar.eos_id
        largest = max(described, key=lambda f: f.sidecar.max_token_id if f.sidecar else -1)
        assert largest.sidecar is not None
        top = largest.sidecar.max_token_id
        if vocab_size is not None and top >= vocab_size:
            raise OptionConflict(
                "vocab_size",
                f"{largest.path} holds token id {top} (its sidecar's max_token_id), not below vocab_size "
                f"{vocab_size}: raise vocab_size to at least {top + 1}, or leave it out to take the sidecar's",
            )
        if vocab_size is None and top >= first.sidecar.vocab_size:  # only a sidecar edited by hand
            raise TokenFileError(
                f"{largest.path}'s sidecar says it holds token id {top}, not below its vocab_size "
                f"{first.sidecar.vocab_size}: the sidecar is damaged; tokenize the file again"
            )
        vocab_size = first.sidecar.vocab_size if vocab_size is None else vocab_size
    return vocab_size, eos_id


def _without_path(tokenizer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tokenizer.items() if k != "path"}
