"""Token ids against the vocabulary: what a window holding an id the model has no row for says,
and how the Trainer hands a token dataset the model's vocabulary.

``TokenFiles`` checks every window it reads: one reduction over the int64 copy it makes anyway,
viewed as unsigned so that a negative id (a signed ``.npy``) counts as larger than any vocabulary,
on the host (in the DataLoader worker when there are workers), before the window is collated. The
limit is the smallest it was given: the data's ``vocab_size`` (the option, else the sidecars') and
the model's embedding rows (``limit_token_ids``, called by the Trainer once the model is built).
Without either, only negative ids are refused. A sidecar's ``max_token_id`` lets a run refuse a
model that is too small before it starts; it never stands in for the check, since a sidecar can be
wrong (edited by hand, or the file changed since).

An id past the model's embedding is an opaque ``IndexError`` on a CPU, a device-side assert that
poisons the CUDA context on a GPU: found here, it is a ``TokenOutOfVocab`` naming the file, the
token's offset in it, the id, the vocabulary and the likely fix (a wrong dtype, a file of another
tokenizer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .format import TokenOutOfVocab, sidecar_path

if TYPE_CHECKING:
    from .corpus import TokenFile

NO_LIMIT = 2**63  # no vocabulary known: the unsigned view of a negative int64 is at least this
_UINT16_IDS = 2**16


def out_of_vocab(
    file: TokenFile, start: int, window: np.ndarray[Any, Any], limit: int, what: str
) -> TokenOutOfVocab:
    """The error for ``window`` (int64, read from token ``start`` of ``file``), which holds an id
    outside ``[0, limit)``; ``what`` says where ``limit`` comes from."""
    bad = int(np.flatnonzero(window.view(np.uint64) >= limit)[0])
    token = int(window[bad])
    where = f"{file.path}: token {start + bad} has id {token}"
    if limit >= NO_LIMIT:
        return TokenOutOfVocab(f"{where}: a token id is never negative; {_dtype_hint(file)}")
    said = []
    if file.sidecar is not None and token > file.sidecar.max_token_id:
        said.append(
            f"its sidecar says its largest id is {file.sidecar.max_token_id}, so the sidecar does not "
            "describe this file"
        )
    dtype = file.layout.dtype
    if dtype == "uint32" and token >= _UINT16_IDS and limit <= _UINT16_IDS:
        said.append("ids past 65535 are what a uint16 file read as uint32 holds")
    return TokenOutOfVocab(
        f"{where}, outside the vocabulary of {limit} ({what}); {'; '.join([*said, _dtype_hint(file)])}. "
        "If the dtype is right, the file was not tokenized for this model: tokenize it again with the "
        f"model's tokenizer, or give the model and the data a vocabulary of at least {token + 1} "
        "(MODEL.OPTIONS.vocab_size, DATA.DATASET.OPTIONS.vocab_size)"
    )


def _dtype_hint(file: TokenFile) -> str:
    """Where the file's dtype came from, and how to correct it if it is wrong."""
    dtype = file.layout.dtype
    if file.path.endswith(".npy"):
        return f"the file holds {dtype} tokens (its .npy header)"
    if file.sidecar is not None:
        return (
            f"the file is read as {dtype} (its sidecar, {sidecar_path(file.path)}): if its tokens are "
            "of another dtype, the sidecar is wrong (tokenize the file again)"
        )
    return (
        f"the file is read as {dtype} (the dtype option): if its tokens are of another dtype, "
        "set DATA.DATASET.OPTIONS.dtype to it"
    )


def limit_token_ids(dataset: Any, limit: int, what: str, _seen: frozenset[int] = frozenset()) -> list[Any]:
    """Have every token dataset in ``dataset`` (itself, a mixture's sources, a ``Subset``'s or
    ``ConcatDataset``'s datasets) refuse windows holding an id at or past ``limit`` (``what``: where
    it comes from, e.g. the model's embedding rows); those datasets, in order. A dataset takes part
    by having a ``limit_ids(limit, what)`` method (``TokenFiles`` has)."""
    limit_ids = getattr(dataset, "limit_ids", None)
    if callable(limit_ids):
        limit_ids(limit, what)
        return [dataset]
    sources = getattr(dataset, "sources", None)  # a Mixture's MixtureSources
    inner = [getattr(s, "dataset", None) for s in sources] if isinstance(sources, list | tuple) else []
    datasets = getattr(dataset, "datasets", None)  # a ConcatDataset's
    inner += list(datasets) if isinstance(datasets, list | tuple) else []
    inner.append(getattr(dataset, "dataset", None))  # a Subset's
    seen = _seen | {id(dataset)}
    return [
        found
        for part in inner
        if part is not None and id(part) not in seen
        for found in limit_token_ids(part, limit, what, seen)
    ]
