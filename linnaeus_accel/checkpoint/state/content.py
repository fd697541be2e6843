"""What a checkpoint's files may contain before a resume (or ``evaluate``) reads them: data, never code.

A checkpoint is the thing people pass around (a colleague's run, a bucket several jobs write to, a
download to fine-tune), and digests only say it is what its manifest lists: whoever can write the
files can write the manifest. So every file that a loader would unpickle is opened here first, as
data only, before anything is loaded:

- Accelerate's pickles (optimizer, scheduler, sampler, DataLoader state, gradient scaler, RNG
  states, a model saved without safetensors): torch's ``weights_only`` unpickler with the globals
  Accelerate itself allows, memory-mapped so that the tensors are not read. Accelerate loads them
  the same way; done here first, a file that fails is named (Accelerate would raise torch's
  traceback, or, for the RNG states, log at INFO level and resume from other random states).
- ``torch.distributed.checkpoint`` metadata (FSDP's sharded checkpoints), which torch unpickles
  with plain ``pickle``: an unpickler that builds only DCP's own metadata classes, torch sizes,
  dtypes and paths.
- ``custom_checkpoint_<i>.pkl`` (Accelerate's ``register_for_checkpointing``, loaded with
  ``weights_only=False``): the run no longer writes them (registered state is JSON and
  safetensors, ``tensor_state``). In a checkpoint of the previous layout it is loaded only when its
  owner says so (``--unsafe-load-pickles``); in a checkpoint of this layout it was put there by
  someone else, and the checkpoint is refused.
- Every safetensors file (the model, an EMA, the registered tensors) has its header parsed and
  checked (dtypes, shapes, offsets covering the file) without a tensor being read: a damaged one
  is named here, not found by the load after the run directory was written to. The registered
  tensors file must hold every tensor ``trainer_state.json`` names.

- DeepSpeed's own files (``pytorch_model/*.pt``), which DeepSpeed unpickles with
  ``weights_only=False``: torch's weights-only unpickler as above, plus the few DeepSpeed classes
  its ZeRO checkpoints hold (read off real ZeRO-3 checkpoints on an H100, and DeepSpeed's
  ``state_dict`` code for ZeRO-1/2 and fp16). Those are built as plain stand-ins, so the check
  needs no DeepSpeed and runs none of its code; a file referring to anything else is refused.
  DeepSpeed then reads the same bytes: a pickle holding only these globals can call nothing else.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

PICKLE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")
LEGACY_PICKLE = re.compile(r"custom_checkpoint_\d+\.pkl")
DCP_METADATA = ".metadata"
DEEPSPEED_DIR = "pytorch_model"  # Accelerate's name for DeepSpeed's checkpoint directory
TENSORS_FILE = "trainer_state.safetensors"
LAYOUT_KEY = "state_layout"  # in trainer_state.json: written by this layout (no pickles of ours)
LAYOUT = 2
UNSAFE_FLAG = "--unsafe-load-pickles"


def legacy_pickles(path: Path) -> list[Path]:
    """The ``custom_checkpoint_<i>.pkl`` files of a checkpoint, in index order."""
    found = [p for p in path.iterdir() if LEGACY_PICKLE.fullmatch(p.name)] if path.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[-1].split(".")[0]))


def content_problem(path: Path, state: dict[str, Any]) -> str | None:
    """None if every file of the checkpoint at ``path`` a resume would read is data; else which file
    is not, and why. ``state``: its parsed ``trainer_state.json``."""
    new_layout = state.get(LAYOUT_KEY) == LAYOUT
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        top = rel.split("/", 1)[0]
        if LEGACY_PICKLE.fullmatch(rel):
            if new_layout:
                return (
                    f"{rel}: a pickle that this layout of checkpoint never holds ({LAYOUT_KEY} {LAYOUT}); "
                    "someone else put it there"
                )
            continue  # the previous layout's: the resume asks its owner (UNSAFE_FLAG)
        if file.name == DCP_METADATA:
            problem = _dcp_metadata_problem(file)
        elif top == DEEPSPEED_DIR and "/" in rel and file.suffix in PICKLE_SUFFIXES:
            problem = _torch_data_problem(file, DEEPSPEED_STAND_INS)
        elif file.suffix in PICKLE_SUFFIXES:
            problem = _torch_data_problem(file)
        elif file.suffix == ".safetensors":
            problem = _safetensors_problem(file)
        else:
            continue
        if problem is not None:
            return f"{rel}: {problem}"
    return _tensors_problem(path, state) if new_layout else None


def load_as_data(file: Path, mmap: bool = False, extra_globals: tuple[Any, ...] = ()) -> Any:
    """``file`` (torch-saved) through torch's weights-only unpickler with the globals Accelerate
    allows (its RNG states hold numpy arrays): as Accelerate's loader reads it, minus any code."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    with torch.serialization.safe_globals([*TORCH_SAFE_GLOBALS, *extra_globals]):
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)


class _DeepSpeedRecord:
    """Stands in for a DeepSpeed class whose instances are attribute bags (a loss scaler, a
    fragment address): built with ``__new__`` and given its saved attributes, nothing run."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _deepspeed_enum(value: Any) -> Any:
    """Stands in for ``ZeroStageEnum(value)``: the enum's value, as saved."""
    return value


# The globals of DeepSpeed's ZeRO checkpoint files beyond torch's tensors and containers.
# ZeRO-3 (bf16, seen on an H100): LossScaler and ZeroStageEnum. ZeRO-1/2: fragment_address in the
# parameter slice mappings. fp16: DynamicLossScaler.
DEEPSPEED_STAND_INS: tuple[tuple[Any, str], ...] = (
    (_DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_DeepSpeedRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_deepspeed_enum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
)


def _torch_data_problem(file: Path, extra_globals: tuple[Any, ...] = ()) -> str | None:
    try:
        load_as_data(file, mmap=True, extra_globals=extra_globals)  # the tensors are mapped, not read
    except Exception as exc:
        return f"not loadable as data ({first_line(exc)})"
    return None


def _safetensors_problem(file: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt"):  # parses and checks the header; reads no tensor
            pass
    except Exception as exc:
        return f"not a safetensors file, or damaged ({first_line(exc)})"
    return None


class CheckpointLoadError(RuntimeError):
    """A verified checkpoint that could not be loaded; the message says which part and why."""


def first_line(exc: BaseException) -> str:
    """An exception in one line: its type and first line (torch's weights-only refusal: the line
    naming the global it met, a few lines down, which is the finding)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = next((m.group(1) for line in lines if (m := _UNSUPPORTED_GLOBAL.search(line))), None)
    if named is not None:
        return f"{type(exc).__name__}: Unsupported global: GLOBAL {named}"
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# torch's refusals: "Unsupported global: GLOBAL x.y was not an allowed global by default" and
# "Trying to load unsupported GLOBAL posix.system whose module posix is blocked".
_UNSUPPORTED_GLOBAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)")


_DCP_CLASSES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata: its own classes, torch sizes and dtypes, paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _DCP_CLASSES or module == "torch.distributed.checkpoint.metadata"
        if module == "torch":
            value = getattr(torch, name, None)
            allowed = value is torch.Size or isinstance(
                value, (torch.dtype, torch.layout, torch.memory_format)
            )
        if not allowed:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not checkpoint metadata")
        found = super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata" and not isinstance(found, type):
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not a metadata class")
        return found


def _dcp_metadata_problem(file: Path) -> str | None:
    try:
        with file.open("rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as exc:
        return f"not loadable as torch.distributed.checkpoint metadata ({type(exc).__name__}: {exc})"[:300]
    return None


def _tensors_problem(path: Path, state: dict[str, Any]) -> str | None:
    """The tensors ``trainer_state.json`` names must all be in its safetensors file."""
    from . import tensor_state

    wanted = tensor_state.keys(state)
    if not wanted:
        return None
    file = path / TENSORS_FILE
    if not file.is_file():
        return f"{TENSORS_FILE} is missing, and trainer_state.json names {len(wanted)} tensors in it"
    try:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            missing = wanted - set(f.keys())
    except Exception as exc:
        return f"{TENSORS_FILE}: not a safetensors file ({type(exc).__name__}: {exc})"[:300]
    if missing:
        return f"{TENSORS_FILE} lacks tensors trainer_state.json names: {', '.join(sorted(missing)[:3])}"
    return None


def saved_processes(path: Path) -> int:
    """How many processes wrote the checkpoint at ``path``: one RNG-state file each (Accelerate's)."""
    from accelerate.utils import RNG_STATE_NAME

    return len(list(path.glob(f"{RNG_STATE_NAME}_*.pkl")))


def seed_new_process(path: Path, process_index: int) -> None:
    """Seed the RNGs (Python, numpy, torch, CUDA) of a process the checkpoint at ``path`` had no
    process for: from process 0's saved torch state and ``process_index``, so that a rerun of the
    same resume draws the same numbers and no two processes draw alike."""
    from accelerate.utils import RNG_STATE_NAME, set_seed

    states = load_as_data(path / f"{RNG_STATE_NAME}_0.pkl")
    base = int.from_bytes(bytes(states["torch_manual_seed"][:8].tolist()), "little")
    set_seed((base + process_index) % 2**32)


def rng_problem(path: Path, process_index: int) -> str | None:
    """After ``load_state``: whether this process's RNG states are those of its file (Accelerate
    catches any error restoring them and logs it at INFO: the resumed run would silently draw other
    random numbers). None if restored."""
    import random

    import numpy as np
    from accelerate.utils import RNG_STATE_NAME

    file = path / f"{RNG_STATE_NAME}_{process_index}.pkl"
    if not file.is_file():
        return f"{file.name} is missing"
    states = load_as_data(file)
    try:
        same = (
            random.getstate() == states["random_state"]
            and _numpy_state_equal(np.random.get_state(), states["numpy_random_seed"])
            and torch.equal(torch.get_rng_state(), states["torch_manual_seed"])
        )
        if same and torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            restored = torch.cuda.get_rng_state_all()
            saved = states["torch_cuda_manual_seed"]
            same = len(restored) == len(saved) and all(
                torch.equal(a, b) for a, b in zip(restored, saved, strict=True)
            )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        return f"{file.name}: not the random states Accelerate saves ({type(exc).__name__}: {exc})"
    return (
        None if same else f"{file.name}: its random states were not restored (Accelerate could not load them)"
    )


def _numpy_state_equal(a: Any, b: Any) -> bool:
    import numpy as np

    return (
        isinstance(b, tuple)
        and len(a) == len(b)
        and all(
            np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b, strict=True)
        )
    )


def pickled_globals(file: Path) -> set[str]:
    """The ``module.name`` globals a torch-saved file's pickle refers to, read without loading it
    (for learning what a loader's files hold, e.g. DeepSpeed's, before allowing them)."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(file) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)
    found: set[str] = set()
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(str(arg))
        elif opcode.name == "GLOBAL":
            found.add(str(arg).replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.add(f"{strings[-2]}.{strings[-1]}")
    return found
