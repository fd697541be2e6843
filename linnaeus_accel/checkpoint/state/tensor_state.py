"""State that holds tensors, saved as data: the JSON it can be, and its tensors in one safetensors file.

A registered part's ``state_dict()`` (an EMA's averaged weights, a user callback's buffers) may mix
tensors with plain values. ``split`` turns it into plain JSON in which each tensor is replaced by
``{"__tensor__": key}``, and a flat ``{key: tensor}`` for ``safetensors``; ``join`` puts them back.
Nothing is pickled, so loading a checkpoint reads numbers and runs no code.

What survives the round trip unchanged: dicts (any key of str, int, float, bool, None or a numpy
scalar), lists, tuples, str, int, float (NaN and infinities included, which JSON cannot hold bare),
bool, None, numpy scalars (their dtype kept: a ``float32`` stays one), tensors (tensors sharing
memory, as tied weights do, are saved once and come back sharing it) and numpy arrays. A dict of the
user's whose one key happens to be a marker (``{"__float__": "nan"}``) is escaped, so it comes back
as that dict. Subclasses come back as what they subclass, equal to what was saved: an
``OrderedDict`` (what ``module.state_dict()`` returns) as a dict, an ``IntEnum`` as its int, a
namedtuple as a tuple. Anything else (bytes, sets, objects) is a ``TypeError`` naming where it is,
raised when the state is taken: the trainer takes it once before the first step
(``unsavable``), so only a value that turns up later is refused at a checkpoint.

``join`` is the one decoder of ``split``'s JSON, tensors or not: whoever reads a saved state hands
it over, so that what a part saved is what it gets back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

TENSOR, NUMPY, FLOAT, TUPLE, ITEMS = "__tensor__", "__numpy__", "__float__", "__tuple__", "__items__"
SCALAR = "__numpy_scalar__"
_TAGS = {TENSOR, NUMPY, FLOAT, TUPLE, ITEMS, SCALAR}
_KEYS = (str, int, float, bool, type(None), np.generic)
# Numpy scalars whose Python value JSON holds and which that value rebuilds exactly: bool, signed
# and unsigned integers, floats of up to 64 bits, str.
_SCALAR_KINDS = "biufU"
_ALLOWED = (
    "a saved state holds tensors, numpy arrays and scalars, numbers, strings, booleans, None and lists, "
    "tuples and dicts of them"
)


def split(state: Any, where: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` as JSON-ready data and the tensors it refers to, by key (see the module)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}
    return _split(state, where, tensors, seen), tensors


def _split(value: Any, where: str, tensors: dict[str, torch.Tensor], seen: dict[tuple[Any, ...], str]) -> Any:
    if isinstance(value, np.generic):  # before float and str: np.float64 and np.str_ subclass them
        return {SCALAR: [value.dtype.str, _split(_scalar_value(value, where), where, tensors, seen)]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        return {TENSOR: _keep(value.detach(), where, tensors, seen)}
    if isinstance(value, np.ndarray):
        return {NUMPY: _keep(torch.from_numpy(np.ascontiguousarray(value)), where, tensors, seen)}
    if isinstance(value, tuple):
        return {TUPLE: [_split(v, f"{where}[{i}]", tensors, seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_split(v, f"{where}[{i}]", tensors, seen) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, _KEYS)]
        if bad:
            raise TypeError(
                f"{where} has a key of type {type(bad[0]).__name__} ({bad[0]!r}): keys must be plain values"
            )
        # Any other key, or one key that reads as a marker, is saved as [key, value] pairs.
        if all(type(k) is str for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
            return {k: _split(v, f"{where}.{k}", tensors, seen) for k, v in value.items()}
        return {ITEMS: [[_split(k, where, tensors, seen), _split(v, f"{where}.{k}", tensors, seen)] for k, v in value.items()]}  # fmt: skip
    hint = ""
    if isinstance(value, (bytes, bytearray)):
        hint = " (save bytes as a numpy uint8 array: np.frombuffer(value, np.uint8))"
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}: {_ALLOWED}{hint}")


def _scalar_value(value: np.generic, where: str) -> Any:
    """The Python value a numpy scalar is saved as (its dtype beside it)."""
    item = value.item()
    if value.dtype.kind not in _SCALAR_KINDS or type(item) not in (bool, int, float, str):
        raise TypeError(f"{where} is a numpy {value.dtype} scalar, which JSON cannot hold: {_ALLOWED}")
    return item


def storage_view(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the memory a tensor views: equal for tied weights (one storage, the same
    offset, shape, strides and dtype). An empty tensor has no storage to share (its data_ptr is 0)."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _keep(
    tensor: torch.Tensor, where: str, tensors: dict[str, torch.Tensor], seen: dict[tuple[Any, ...], str]
) -> str:
    """The key ``tensor`` is saved under; a tensor viewing the same memory as one kept already
    (tied weights) gets that one's key."""
    view = storage_view(tensor)
    if view in seen:
        return seen[view]
    key = where if where not in tensors else f"{where}#{len(tensors)}"
    # safetensors writes whole, unshared buffers: a view of a larger tensor is copied on its own.
    shares = tensor.numel() and tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
    tensors[key] = tensor.clone() if shares or not tensor.is_contiguous() else tensor
    seen[view] = key
    return key


def join(data: Any, tensors: Mapping[str, torch.Tensor] | None = None) -> Any:
    """What ``split`` took apart, with the tensors loaded (``KeyError`` naming a missing one).
    Needed whether there are tensors or not: NaN, tuples and int keys are encoded without them.
    Data that ``split`` cannot have written (a damaged file) raises ``TypeError``, ``ValueError``
    or ``KeyError``."""
    tensors = {} if tensors is None else tensors
    if isinstance(data, list):
        return [join(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        tag, inner = next(iter(data.items()))
        if tag == TENSOR:
            return tensors[inner]
        if tag == NUMPY:
            return tensors[inner].numpy()
        if tag == FLOAT:
            return float(inner)
        if tag == TUPLE:
            return tuple(join(v, tensors) for v in inner)
        if tag == ITEMS:
            return {join(k, tensors): join(v, tensors) for k, v in inner}
        if tag == SCALAR:
            code, item = inner
            dtype = np.dtype(str(code))
            if dtype.kind not in _SCALAR_KINDS:
                raise ValueError(f"{SCALAR} of dtype {dtype}: not one split writes")
            return dtype.type(join(item, tensors))
    return {k: join(v, tensors) for k, v in data.items()}


def keys(data: Any) -> set[str]:
    """The tensor keys ``data`` (split's JSON) refers to."""
    found: set[str] = set()
    if isinstance(data, list):
        for v in data:
            found |= keys(v)
    elif isinstance(data, dict):
        if len(data) == 1 and next(iter(data)) in (TENSOR, NUMPY):
            found.add(str(next(iter(data.values()))))
        else:
            for v in data.values():
                found |= keys(v)
    return found


def unsavable(parts: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first part whose state a checkpoint cannot hold, and why (None: all can)."""
    for name, value in parts.items():
        try:
            json.dumps(split(value, name)[0], allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: a state that holds itself
            return name, str(exc)
    return None
