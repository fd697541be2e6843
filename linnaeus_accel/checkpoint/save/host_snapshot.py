"""``SCHEDULE.CHECKPOINT.ASYNC``: ``accelerator.save_state`` split in two halves. ``capture`` copies
what it would save into host memory (pinned on CUDA), which is all the loop waits for; ``write``
saves the copy from a background thread with Accelerate's own saving function
(``save_accelerator_state``), so the files are exactly what ``load_state`` reads.

Copies go into buffers kept from one checkpoint to the next: the loop starts the next checkpoint
only after the previous write finished (``SerialWorker``), and refilling warm memory is several
times faster than touching fresh pages. Tensors that share storage (tied weights) share one copy,
so Accelerate drops the duplicate names from the safetensors file as it does for the live model.

Only the main process uses this: under DDP the other processes write nothing but their RNG state,
which they save in the loop as before. Sharded backends (FSDP, DeepSpeed) save collectively and are
refused with ASYNC at start (``backends``).
"""

from __future__ import annotations

import copy
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state
from accelerate.utils import RNG_STATE_NAME, SAFE_WEIGHTS_NAME
from safetensors.torch import save_file

from ..state.content import TENSORS_FILE
from ..state.tensor_state import storage_view

_WEIGHTS_PREFIX = SAFE_WEIGHTS_NAME.split(".")[0]  # model.safetensors, model_1.safetensors, ...


def _catching(run: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    """``run`` for a thread: what it raises is kept in ``errors`` for the joining thread."""

    def target() -> None:
        try:
            run()
        except BaseException as exc:
            errors.append(exc)

    return target


class _Frozen:
    """Stands in for an optimizer, scheduler or scaler: Accelerate's saving functions only call
    ``state_dict()`` on them."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


class _FrozenLoader:
    """Stands in for a prepared DataLoader: what ``save_accelerator_state`` reads of one."""

    def __init__(self, loader: Any) -> None:
        self.dataset = loader.dataset  # read only for its type
        self.use_stateful_dataloader = bool(getattr(loader, "use_stateful_dataloader", False))
        self._sampler = copy.deepcopy(loader.get_sampler()) if hasattr(loader, "get_sampler") else None
        self._state = copy.deepcopy(loader.state_dict()) if self.use_stateful_dataloader else None

    def get_sampler(self) -> Any:
        return self._sampler

    def state_dict(self) -> Any:
        return self._state


@dataclass
class Captured:
    """Everything ``save_state`` would write on this process, as of the instant of ``capture``."""

    weights: list[Any]
    optimizers: list[_Frozen]
    schedulers: list[_Frozen]
    loaders: list[_FrozenLoader]
    scaler: _Frozen | None
    tensors: dict[str, torch.Tensor]  # the run's registered state's (``tensor_state``)
    rng: dict[str, Any]
    step: int
    ready: Any = None  # a CUDA event the device-to-host copies complete at (None on a CPU)


class HostSnapshot:
    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._pin = torch.cuda.is_available() and accelerator.device.type == "cuda"

    def capture(self, output_dir: Path, tensors: dict[str, torch.Tensor] | None = None) -> Captured:
        """Copy the state to host memory (the loop's only wait), after running Accelerate's save
        hooks on the weights as ``save_state`` does before it writes; ``tensors``: the registered
        state's (an EMA of the weights), copied the same way."""
        acc = self.accelerator
        shared: dict[tuple[Any, ...], torch.Tensor] = {}
        weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        # The hooks first, as save_state runs them: what one drops (a LoRA model's frozen base) is
        # never copied.
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, str(output_dir))
        weights = [self._copy(state, ("model", i), shared) for i, state in enumerate(weights)]
        captured = Captured(
            weights=weights,
            optimizers=[
                _Frozen(self._copy(opt.state_dict(), ("optimizer", i), shared))
                for i, opt in enumerate(acc._optimizers)
            ],
            schedulers=[_Frozen(copy.deepcopy(s.state_dict())) for s in acc._schedulers],
            loaders=[_FrozenLoader(loader) for loader in acc._dataloaders],
            scaler=_Frozen(copy.deepcopy(acc.scaler.state_dict())) if acc.scaler is not None else None,
            tensors={k: self._copy_tensor(t, ("tensors", k), shared) for k, t in (tensors or {}).items()},
            rng=_rng_states(acc.step),
            step=acc.step,
        )
        if self._pin:
            captured.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            captured.ready.record()
        return captured

    def write(
        self, captured: Captured, output_dir: Path, written: Callable[[list[Path]], None] | None = None
    ) -> None:
        """Write ``captured`` into ``output_dir`` as ``save_state`` would have (background thread).
        ``written``: told each group of files as soon as it is complete, so that sealing them
        (hash, fsync) overlaps the rest of the write."""
        if captured.ready is not None:
            captured.ready.synchronize()
        acc = self.accelerator
        on_each_node = acc.project_configuration.save_on_each_node
        output_dir = Path(output_dir)
        rng_file = output_dir / f"{RNG_STATE_NAME}_{acc.process_index}.pkl"
        before = set(output_dir.iterdir())

        def announce(weights: bool) -> None:
            """Tell ``written`` the files the weights' (or the other) half has completed. A dot-file
            is the other half's write in progress (safetensors writes ``.tmpXXXXXX``, then renames
            it): not ours to seal."""
            if written is None:
                return
            files = [p for p in set(output_dir.iterdir()) - before if not p.name.startswith(".")]
            written(
                sorted(
                    p
                    for p in files
                    if p.name.startswith(_WEIGHTS_PREFIX) == weights and p != rng_file and p.is_file()
                )
            )

        common = {"save_on_each_node": on_each_node, "safe_serialization": True}

        def save_weights() -> None:
            save_accelerator_state(str(output_dir), captured.weights, [], [], [], acc.process_index, captured.step, None, **common)  # fmt: skip
            announce(weights=True)

        # Accelerate's one saving function, called for two halves of the state at once: the
        # weights on a thread of their own, the optimizer's state (the largest file) and the rest
        # on this one. Both halves also write the RNG file; it is written over below.
        weights_error: list[BaseException] = []
        weights = threading.Thread(
            target=_catching(save_weights, weights_error), name="linnaeus-accel weights", daemon=True
        )
        weights.start()
        try:
            save_accelerator_state(
                str(output_dir),
                [],
                captured.optimizers,
                captured.schedulers,
                captured.loaders,
                acc.process_index,
                captured.step,
                captured.scaler,
                **common,
            )
            announce(weights=False)
        finally:
            weights.join()
        if weights_error:
            raise weights_error[0]
        # save_accelerator_state read the RNG now, on this thread; the loop's states are those
        # of the capture instant, written over its file under the same name and layout.
        torch.save(captured.rng, rng_file)
        if captured.tensors:
            save_file(captured.tensors, str(output_dir / TENSORS_FILE))

    def _copy(self, value: Any, path: tuple[Any, ...], shared: dict[tuple[Any, ...], torch.Tensor]) -> Any:
        """``value`` with every tensor copied to host memory (containers rebuilt, others deep-copied)."""
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path, shared)
        if isinstance(value, dict):
            out = value.__class__() if isinstance(value, OrderedDict) else {}
            for key, item in value.items():
                out[key] = self._copy(item, (*path, key), shared)
            if hasattr(value, "_metadata"):  # module versions, kept by torch.save
                out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(value, (list, tuple)):
            items = [self._copy(item, (*path, i), shared) for i, item in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _copy_tensor(
        self, tensor: torch.Tensor, path: tuple[Any, ...], shared: dict[tuple[Any, ...], torch.Tensor]
    ) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.numel() == 0:  # no storage to share (every empty tensor's data_ptr is 0)
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        view = storage_view(tensor)
        if view in shared:  # tied weights: one copy, as one storage
            return shared[view]
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pin)
            self._buffers[path] = buffer
        buffer.copy_(tensor, non_blocking=self._pin)
        shared[view] = buffer
        return buffer


def _rng_states(step: int) -> dict[str, Any]:
    """The RNG states ``save_accelerator_state`` saves, read now (same keys, same file layout)."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states
