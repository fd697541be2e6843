"""Starting from a local ``save_pretrained`` directory (``MODEL.OPTIONS.pretrained``), offline.

The directory's own ``config.json`` describes the model. Other ``MODEL.OPTIONS`` override its
fields where the pretrained weights still fit (dropout, ``attn_implementation``, ``use_cache``, a
new label count for a classifier head...) and are refused where they would not (``hidden_size``,
``num_hidden_layers``, ``vocab_size``...): an override is tried on the meta device, and one that
changes the shape of any weight is an error naming it. Weights are loaded in float32 (Accelerate's
mixed precision keeps float32 master weights; ``dtype`` overrides), never downloaded.

``weights_digest`` identifies the weights (xxh3-128 over each weight file's digest); the run
records it in ``run_info`` and a LoRA run's checkpoints verify it at resume.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..digests import hash_file

PRETRAINED_KEY = "MODEL.OPTIONS.pretrained"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Options read by transformers' from_pretrained itself rather than written into the config.
LOADING_ARGUMENTS = ("attn_implementation", "dtype")
# Fields every config has as properties rather than init arguments (a classifier's head).
HEAD_FIELDS = {"num_labels", "id2label", "label2id", "problem_type"}


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory (the shards an index names, or the one
    file), empty when it has none."""
    for index in WEIGHT_INDEXES:
        if (directory / index).is_file():
            weight_map = json.loads((directory / index).read_text(encoding="utf-8"))["weight_map"]
            return [directory / name for name in sorted(set(weight_map.values()))]
    return [directory / name for name in WEIGHT_FILES if (directory / name).is_file()]


def model_directory(value: Any, key: str = PRETRAINED_KEY) -> Path:
    """``value`` as a directory holding a model that ``from_pretrained`` reads, else a ConfigError
    naming ``key`` and what is wrong."""
    if not isinstance(value, str) or not value:
        raise ConfigError([(key, f"must be the path of a save_pretrained directory (got {value!r})")])
    directory = Path(value).expanduser()
    if not directory.is_dir():
        raise ConfigError([(key, f"{directory} does not exist or is not a directory")])
    if not (directory / "config.json").is_file():
        raise ConfigError(
            [
                (
                    key,
                    f"{directory} holds no config.json: not a model directory (give what save_pretrained wrote)",
                )
            ]
        )
    try:
        files = weight_files(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError([(key, f"{directory}: its weight index cannot be read ({exc})")]) from None
    if not files or not all(f.is_file() for f in files):
        missing = [f.name for f in files if not f.is_file()]
        what = (
            f"is missing {', '.join(missing)}"
            if missing
            else f"holds no weights ({' or '.join(WEIGHT_FILES)})"
        )
        raise ConfigError([(key, f"{directory} {what}")])
    return directory.resolve()


@functools.cache
def _digest(files: tuple[tuple[str, int, int], ...]) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    for name, _, _ in files:
        digest.update(f"{Path(name).name}:{hash_file(Path(name), sync=False)[1]}\n".encode())
    return str(digest.hexdigest())


def weights_digest(directory: Path) -> str:
    """xxh3-128 over the names and digests of ``directory``'s weight files (read once per
    process while they are unchanged)."""
    files = weight_files(directory)
    return _digest(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


def config_fields(config_class: Any) -> set[str] | None:
    """The options a config class reads (None: cannot tell). transformers keeps unknown keyword
    arguments as plain attributes without a word, so a misspelt option would silently leave the
    default in place."""
    import inspect

    import transformers

    try:
        defaults = config_class().to_dict()
    except Exception:  # a composite config with required parts: let transformers judge the options
        return None
    fields = set(defaults) | set(getattr(config_class, "attribute_map", {}))
    for cls in (config_class, transformers.PretrainedConfig):
        fields |= {
            name
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
    fields |= {"attn_implementation", "torch_dtype", "dtype"}  # read from **kwargs by the base class
    return (fields | HEAD_FIELDS) - {"self", "model_type"}


def load_pretrained(auto_class: Any, directory: Path, overrides: dict[str, Any], options_key: str) -> Any:
    """``auto_class.from_pretrained(directory)`` with ``overrides`` (see the module docstring)."""
    import torch
    import transformers
    from safetensors import SafetensorError

    key = f"{options_key}.pretrained"
    _check_config_file(transformers, directory, key)
    try:
        hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # its validators raise ValueError, TypeError, StrictDataclassError...
        raise ConfigError(
            [(key, f"transformers rejects {directory / 'config.json'}: {_one_line(exc)}")]
        ) from None
    overrides = dict(overrides)
    model_type = overrides.pop("model_type", hf_config.model_type)
    if model_type != hf_config.model_type:
        raise ConfigError(
            [
                (
                    f"{options_key}.model_type",
                    f"is {model_type!r} but {directory} holds a {hf_config.model_type!r} model: leave it out",
                )
            ]
        )
    loading = {name: overrides.pop(name) for name in LOADING_ARGUMENTS if name in overrides}
    known = config_fields(type(hf_config))
    unknown = sorted(set(overrides) - known) if known is not None else []
    if unknown:
        raise ConfigError(
            [
                (f"{options_key}.{name}", f"{type(hf_config).__name__} ({model_type}) has no such field")
                for name in unknown
            ]
        )
    try:
        reference = _shapes(auto_class, hf_config)
    except ValueError as exc:  # no such head for this model type (a T5 as a causal LM)
        raise ConfigError([(key, f"{directory} holds a {model_type!r} model: {_one_line(exc)}")]) from None
    refused = []
    for name, value in overrides.items():
        changed = hf_config.__class__.from_dict({**hf_config.to_dict(), name: value})
        if _shapes(auto_class, changed) != reference:
            refused.append(
                (
                    f"{options_key}.{name}",
                    f"cannot be {value!r} with the pretrained weights of {directory} (its value "
                    f"{getattr(hf_config, name, None)!r}): it changes the shape of its weights; leave it out",
                )
            )
    if refused:
        raise ConfigError(refused)
    for name, value in overrides.items():
        setattr(hf_config, name, value)
    dtype = loading.pop("dtype", None) or torch.float32
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(
                [(f"{options_key}.dtype", f"{dtype!r} is not a torch dtype (e.g. float32, bfloat16, auto)")]
            )
        dtype = getattr(torch, dtype)
    _check_weight_files(directory, key)
    try:
        # transformers reads a pytorch_model.bin with torch's weights-only unpickler: a pickle that
        # would run code is refused here, as any other weights it cannot load.
        return auto_class.from_pretrained(
            directory, config=hf_config, local_files_only=True, dtype=dtype, **loading
        )
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, SafetensorError) as exc:
        raise ConfigError(
            [(key, f"transformers cannot load the weights of {directory} ({_one_line(exc)})")]
        ) from None


def _one_line(exc: BaseException) -> str:
    """The exception's type and first line, cut short (transformers adds paragraphs of advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _check_config_file(transformers: Any, directory: Path, key: str) -> None:
    """config.json is a JSON object whose model_type this transformers knows. transformers' own
    messages name neither the line of a damaged file nor the fix, and end an unknown model_type
    with "pip install --upgrade transformers", which does not help a misspelt or damaged one."""
    file = directory / "config.json"
    try:
        fields = json.loads(file.read_bytes())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [
                (
                    key,
                    f"{file} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}): it is "
                    "damaged or truncated; copy it again, or write the directory again with save_pretrained",
                )
            ]
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError([(key, f"{file} cannot be read ({type(exc).__name__}: {exc})")]) from None
    if not isinstance(fields, dict):
        raise ConfigError(
            [(key, f"{file} holds a JSON {type(fields).__name__}, not an object of config fields")]
        )
    model_type = fields.get("model_type")
    if model_type is not None and model_type not in transformers.CONFIG_MAPPING:
        custom = " (its auto_map names custom code, which is never run here)" if "auto_map" in fields else ""
        raise ConfigError(
            [
                (
                    key,
                    f"model_type {model_type!r} in {file} is not one transformers {transformers.__version__} "
                    f"knows{custom}: correct it (e.g. llama, gpt2, qwen2), or use a transformers release "
                    "that has this architecture",
                )
            ]
        )


def _check_weight_files(directory: Path, key: str) -> None:
    """Every weight file opens: a safetensors file's header is read and its length checked against
    it, a zip-format pytorch_model.bin's directory (at its end) is read; cheap whatever their size.
    A truncated copy is then named, where transformers reports "Invalid argument" or the like."""
    import zipfile

    from safetensors import SafetensorError, safe_open

    for file in weight_files(directory):
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt"):
                    pass
            elif _starts_with(file, b"PK\x03\x04"):
                with zipfile.ZipFile(file):  # torch.save's format since torch 1.6
                    pass
        except (OSError, SafetensorError, zipfile.BadZipFile) as exc:
            raise ConfigError(
                [
                    (
                        key,
                        f"{file} is truncated or unreadable ({exc}): copy it again, or write the "
                        "directory again with save_pretrained",
                    )
                ]
            ) from None


def _starts_with(file: Path, magic: bytes) -> bool:
    with file.open("rb") as stream:
        return stream.read(len(magic)) == magic


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Without transformers' progress bars ("Loading weights", "Writing model shards"): the run's
    console says what it loads and writes."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _shapes(auto_class: Any, hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every weight's shape in the model ``hf_config`` describes, built on the meta device (no
    memory, no initialisation)."""
    import torch

    with torch.device("meta"):
        model = auto_class.from_config(hf_config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
