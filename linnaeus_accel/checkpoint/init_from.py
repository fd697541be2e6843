"""``MODEL.INIT_FROM``: start a run from saved weights, whatever the model (a warm start).

``MODEL.OPTIONS.pretrained`` starts a transformers model from a directory whose ``config.json``
describes it; any model (built-in, registered, or given through the Python API) starts here from
weights another run saved: a checkpoint directory (``<run>/checkpoints/step_N/``), a ``final/`` or
``save_pretrained`` directory (``model.safetensors``, or the shards of its index), or a
``.safetensors`` file. The Trainer loads them before building the optimizer and before
``accelerator.prepare`` (where FSDP and DeepSpeed shard the model; every process loads the same
file): the run trains from them with its own optimizer, LR schedule and data order. A resumed run
loads them too, then its checkpoint's weights, which count.

- Safetensors only, never unpickled: a ``pytorch_model.bin`` can run code when loaded
  (docs/security.md); a directory holding only pickles is refused, naming the file.
- Strict: every key of the model in the file and every key of the file in the model, with the
  same shape, else the keys are named: a silently partial load trains from random weights that the
  user believes pretrained. ``MODEL.INIT_IGNORE`` (fnmatch patterns) names what is left as built
  (a new head) and what of the file is not read.
- Names are the model's ``state_dict`` keys (a compiled or DDP model's ``_orig_mod.``/``module.``
  dropped); tied weights (an LM head tied to its embedding) are one tensor, loaded through the name
  the file kept (Accelerate and transformers leave the other out).

``run_info`` records the source and the XXH3-128 digest of its files (a single file's: what
``digests.file_digest`` gives its bytes). A checkpoint of ours (a directory with a
``COMMITTED.json``, our ``trainer_state.json`` or ``rank_*.json``, or a checkpoint's name), or a file
in one, is verified as a resume verifies it before any weight is read: committed, every file listed
with its size and digest, nothing unlisted, not rejected, signed where ``LINNAEUS_CHECKPOINT_KEY``
is set. A checkpoint is what people pass around, and an uncommitted one was cut by a kill or is
still being written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..config import ConfigError
from ..config.sections import ModelConfig, TrainConfig
from ..digests import DIGEST, hash_file
from ..models.lora import is_peft_model
from .directory import MARKER, CheckpointStore, read_marker
from .directory.layout import JOURNAL_FILE, STATE_FILE

KEY = "MODEL.INIT_FROM"
IGNORE_KEY = "MODEL.INIT_IGNORE"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's and DDP's
SHOWN = 10  # keys listed in an error, at most
# A checkpoint's directory as committed, or as staged before its commit (the store's names).
CHECKPOINT_NAME = re.compile(r"(?:\.staging-)?step_\d{8,}")


@dataclass(frozen=True)
class InitFrom:
    """What ``load_init_from`` loaded: for run_info and the start-up summary."""

    source: Path
    files: tuple[Path, ...]
    digest: str  # XXH3-128: of the file, or over the names and digests of the shards
    loaded: int  # tensors of the file loaded into the model
    left_as_built: int  # keys of the model INIT_IGNORE left as they were built

    def info(self) -> dict[str, Any]:
        return {
            "path": str(self.source),
            "files": [f.name for f in self.files],
            "weights_xxh3": self.digest,
            "tensors_loaded": self.loaded,
            "left_as_built": self.left_as_built,
        }


def load_init_from(
    model_config: ModelConfig, train: TrainConfig, output_dir: Path, model: nn.Module
) -> InitFrom | None:
    """Load ``MODEL.INIT_FROM`` (of the MODEL section ``model_config``) into ``model`` (see the
    module docstring); None when it is not set. Every problem is a ConfigError naming
    MODEL.INIT_FROM or MODEL.INIT_IGNORE. ``train``, ``output_dir``: whether the run resumes on its
    own (``resumes_on_its_own``)."""
    if model_config.INIT_FROM is None:
        return None
    if is_peft_model(model):
        why = (
            "a LoRA model (MODEL.OPTIONS.lora) starts from MODEL.OPTIONS.pretrained: give the directory there"
        )
        raise ConfigError([(KEY, why)])
    target = _unwrapped(model)
    if any(hasattr(p, "ds_id") for p in target.parameters()):  # built under zero3_init_flag
        why = "the model was partitioned by DeepSpeed ZeRO-3 as it was built: build it before the Accelerator"
        raise ConfigError([(KEY, why)])
    if not Path(model_config.INIT_FROM).expanduser().exists() and resumes_on_its_own(train, output_dir):
        return None  # gone since (a scratch copy), and the run resumes: its checkpoint's weights count
    source, files = weight_files(model_config.INIT_FROM)  # a checkpoint verified, as a resume does
    state = target.state_dict(keep_vars=True)
    shapes, where = _read_headers(files)
    wanted, left = _match(source, state, shapes, list(model_config.INIT_IGNORE))
    digest = _digest(source, files)
    for file in files:  # a shard's tensors in memory at once
        with safe_open(str(file), framework="pt") as handle:
            tensors = {own: handle.get_tensor(name) for name, own in wanted.items() if where[name] == file}
        target.load_state_dict(tensors, strict=False)
    return InitFrom(source, tuple(files), digest, len(wanted), left)


def resumes_on_its_own(train: TrainConfig, output_dir: Path) -> bool:
    """Whether the run in ``output_dir`` resumes from a checkpoint of its own (TRAIN.AUTO_RESUME and
    a committed one in its directory): then its weights are the checkpoint's, not INIT_FROM's."""
    return train.AUTO_RESUME and bool(CheckpointStore(output_dir / "checkpoints").complete_steps())


def check_overwrite(model_config: ModelConfig, loaded: InitFrom | None, overwrite: bool) -> None:
    """``--overwrite`` clears the checkpoints a run whose INIT_FROM (of the MODEL section
    ``model_config``) is gone would have resumed from: it would train from the weights as built.
    Refused, before anything is written."""
    if overwrite and model_config.INIT_FROM is not None and loaded is None:
        raise ConfigError([(KEY, f"{Path(model_config.INIT_FROM).expanduser()} does not exist")])


def _match(
    source: Path, state: dict[str, Any], shapes: dict[str, tuple[int, ...]], patterns: list[str]
) -> tuple[dict[str, str], int]:
    """File key -> model key of every tensor to load, and how many model keys are left as built;
    a ConfigError listing what is missing, unexpected or of another shape."""
    names = _model_names(list(shapes), state)
    keys = [*state, *names.values()]
    if unused := [p for p in patterns if not any(fnmatch(k, p) for k in keys)]:
        what = f"{', '.join(map(repr, unused))} matches no key of the model or of {source}"
        raise ConfigError([(IGNORE_KEY, what)])
    ignored = {k for k in keys if any(fnmatch(k, p) for p in patterns)}
    wanted = {name: own for name, own in names.items() if own not in ignored}
    present = set(wanted.values())
    groups = _tied_groups(state)
    missing = sorted(k for g in groups if not present.intersection(g) for k in g if k not in ignored)
    unexpected = sorted(own for own in present if own not in state)
    problems = []
    if missing:
        problems.append((KEY, f"{source} lacks {_listed(missing)} of the model: {_fix(missing)}"))
    if unexpected:
        problems.append(
            (KEY, f"{source} holds {_listed(unexpected)}, which the model lacks: {_fix(unexpected)}")
        )
    reshaped = [(n, k) for n, k in wanted.items() if k in state and tuple(state[k].shape) != shapes[n]]
    for name, own in reshaped[:SHOWN]:
        sizes = f"{source} holds shape {list(shapes[name])}, the model {list(state[own].shape)}"
        problems.append((KEY, f"{own}: {sizes}: {_fix([own])}"))
    if len(reshaped) > SHOWN:
        problems.append((KEY, f"and {len(reshaped) - SHOWN} more keys of another shape"))
    if problems:
        raise ConfigError(problems)
    return wanted, sum(len(g) for g in groups if not present.intersection(g))  # each one ignored


def weight_files(value: str) -> tuple[Path, list[Path]]:
    """The path given and the safetensors files to read from it, or a ConfigError saying why not."""
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError([(KEY, f"{path} does not exist")])
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ConfigError([(KEY, f"{path} is not a .safetensors file: {_convert(path.name)}")])
        if _is_checkpoint(path.parent):
            _verify_checkpoint(path.parent)
        return path, [path]
    if not path.is_dir():  # a device, a FIFO, a socket
        why = "give a checkpoint directory, a final/ or save_pretrained directory, or a .safetensors file"
        raise ConfigError([(KEY, f"{path} is neither a regular file nor a directory: {why}")])
    if _is_checkpoint(path):
        _verify_checkpoint(path)
    if (path / "adapter_config.json").is_file():
        merged = "its merged model (final/merged/, written with MODEL.OPTIONS.lora.merge: true)"
        raise ConfigError(
            [(KEY, f"{path} holds a LoRA adapter (adapter_config.json), not a model: use {merged}")]
        )
    if (path / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((path / INDEX).read_bytes())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError([(KEY, f"{path / INDEX} cannot be read ({exc})")]) from None
        if bad := [
            s for s in shards if not isinstance(s, str) or Path(s).name != s or not (path / s).is_file()
        ]:
            raise ConfigError(
                [(KEY, f"{path / INDEX} names shards that are not files beside it: {bad[:SHOWN]}")]
            )
        return path, [path / s for s in shards]
    if (path / WEIGHTS).is_file():
        return path, [path / WEIGHTS]
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLES or p.name.endswith("_fsdp_0"))
    if any("fsdp" in name for name in pickles):
        why = "its weights are in FSDP's sharded format: start from the run's final/ instead"
    elif pickles:
        why = f"it holds {', '.join(pickles[:SHOWN])}, which is never unpickled: {_convert(pickles[0])}"
    elif (path / "final").is_dir() or (path / "checkpoints").is_dir():
        why = "it is a run's directory: give its final/ or one of its checkpoints/step_*"
    else:
        why = "give a checkpoint directory, a final/ or save_pretrained directory, or a .safetensors file"
    raise ConfigError([(KEY, f"{path} holds no {WEIGHTS} (nor {INDEX}): {why}")])


def _convert(name: str) -> str:
    return (
        "weights are read as safetensors only (a pickle can run code when loaded); convert it, e.g. "
        f"safetensors.torch.save_file(torch.load({name!r}, weights_only=True), 'model.safetensors'), "
        "or save_pretrained(..., safe_serialization=True)"
    )


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module under torch.compile's and DDP's wrappers: its keys are the model's own."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _is_checkpoint(path: Path) -> bool:
    """Whether the directory ``path`` is one of our checkpoints, committed or not (a
    transformers Trainer's ``checkpoint-N/`` has a ``trainer_state.json`` too, without ``progress``)."""
    state: Any = {}
    unreadable = False
    if (path / STATE_FILE).is_file():
        try:
            state = json.loads((path / STATE_FILE).read_bytes())
        except (OSError, ValueError, RecursionError):
            unreadable = True
    return (
        (path / MARKER).exists()
        or unreadable
        or (isinstance(state, dict) and "progress" in state)
        or any(path.glob("rank_*.json"))
        or CHECKPOINT_NAME.fullmatch(path.name) is not None
    )


def _verify_checkpoint(path: Path) -> None:
    """A ConfigError unless the checkpoint at ``path`` verifies as a resume verifies it (its
    ``COMMITTED.json``, the files it lists, their sizes and digests, the signature)."""
    problem = CheckpointStore(path.parent, journal=JOURNAL_FILE).verify(path, deep=True)
    if problem is None:
        return
    if problem == f"{MARKER} missing":
        problem += " (never committed: cut by a kill, or still being written)"
    fix = "give a committed checkpoint that verifies, or the run's final/"
    raise ConfigError([(KEY, f"{path} is not a usable checkpoint: {problem}; {fix}")])


def _digest(source: Path, files: list[Path]) -> str:
    """The digest of the one file, or over the names and digests of several; a verified
    checkpoint's from its COMMITTED.json (its files were just hashed against it)."""
    listed: dict[str, str] = {}
    checkpoint = source.parent if source.is_file() else source
    if (checkpoint / MARKER).is_file():  # verified by weight_files
        listed = {e["path"]: e[DIGEST] for e in read_marker(checkpoint)["files"] if DIGEST in e}
    digests = {
        f: listed.get(f.relative_to(checkpoint).as_posix()) or hash_file(f, sync=False)[1] for f in files
    }
    if len(files) == 1:
        return digests[files[0]]
    import xxhash

    combined = xxhash.xxh3_128()
    for f, d in digests.items():
        combined.update(f"{f.name}:{d}\n".encode())
    return str(combined.hexdigest())


def _read_headers(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """Every tensor's shape and file, from the safetensors headers (no weight is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118  (a safetensors handle is no dict)
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
                    where[name] = file
        except (OSError, SafetensorError) as exc:
            raise ConfigError([(KEY, f"{file} is not a safetensors file, or is damaged ({exc})")]) from None
    return shapes, where


def _model_names(file_keys: list[str], state: dict[str, Any]) -> dict[str, str]:
    """Each file key -> the model's name for it: a wrapper's prefix the model has not is dropped."""
    strip = [p for p in WRAPPER_PREFIXES if not any(k.startswith(p) for k in state)]
    names = {}
    for name in file_keys:
        own = name
        while p := next((p for p in strip if own.startswith(p)), None):
            own = own[len(p) :]
        names[name] = own
    return names


def _tied_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """The model's keys, grouped by the storage they share (a tied weight is one tensor under
    several names; a file holds one of them). Empty tensors are each their own."""
    groups: dict[Any, list[str]] = {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or tensor.is_meta:
            ident: Any = ("own", key)
        else:
            storage = tensor.untyped_storage()
            ident = (tensor.device, storage.data_ptr(), storage.nbytes())
        groups.setdefault(ident, []).append(key)
    return list(groups.values())


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"{len(keys)} key{'s' if len(keys) != 1 else ''} ({shown}{more})"


def _fix(keys: list[str]) -> str:
    stem = keys[0].rsplit(".", 1)[0]
    return f"build the model the weights were saved from, or name them in {IGNORE_KEY} (e.g. [{stem}.*]) to leave them as built"
