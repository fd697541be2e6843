"""Datasets: a registry by name, the built-in datasets (``digits``, ``digits_images``,
``python_docs``), and helpers for data of your own: ``PackedTokens`` / ``PackedTokenStream`` (token
streams packed into fixed-length training sequences) and ``StreamShard`` (streams across processes
and DataLoader workers). The helpers load torch, so they are imported on first use: ``plan`` with
``--dataset-size`` stays fast."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .registry import build_dataset, dataset_problems, get_dataset_builder, register_dataset

if TYPE_CHECKING:
    from .streams.streaming import StreamShard
    from .tokens.packing import PackedTokens, PackedTokenStream

_LAZY = {
    "PackedTokens": "tokens.packing",
    "PackedTokenStream": "tokens.packing",
    "StreamShard": "streams.streaming",
}

__all__ = [
    "PackedTokenStream",
    "PackedTokens",
    "StreamShard",
    "build_dataset",
    "dataset_problems",
    "get_dataset_builder",
    "register_dataset",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
