"""examples/nanogpt_model.py (a model that computes its own loss), imported once for every test
module that uses it, a tiny GPT of it, and a counter of the ops that read a tensor back to the host."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.configs import REPO


def load_example() -> ModuleType:
    """examples/nanogpt_model.py, imported (which registers MODEL.TYPE nanogpt)."""
    if "nanogpt_model" in sys.modules:  # imported by another test module of this process
        return sys.modules["nanogpt_model"]
    spec = importlib.util.spec_from_file_location("nanogpt_model", REPO / "examples" / "nanogpt_model.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


EXAMPLE = load_example()


def tiny_gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model: nn.Module = EXAMPLE.GPT(
        EXAMPLE.GPTConfig(vocab_size=16, block_size=24, n_layer=1, n_head=2, n_embd=16)
    )
    return model


READ_BACK_OPS = frozenset(
    {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}
)


class ReadBacks(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the ops that read a tensor's value back to the host (they run on a CPU too)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func) in READ_BACK_OPS:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))
