"""``MODEL.OPTIONS.lora``: train a LoRA adapter through peft, the base model frozen.

    MODEL:
      TYPE: hf_causal_lm
      OPTIONS:
        pretrained: /models/my-base
        lora: {r: 16, alpha: 32, dropout: 0.05, target_modules: [q_proj, v_proj]}

- Only the adapter (and, for a classifier, its new head) trains. Checkpoints hold those parameters
  and their optimizer state only, plus a digest of the frozen base weights: a resume rebuilds the
  base (from ``pretrained``, or from the seed) and refuses to go on when its digest differs.
- ``final/`` holds the adapter as ``PeftModel.from_pretrained(base, final)`` loads it, and
  ``base_weights.json``, the digest of the base it was trained on (``evaluate`` checks it); with
  ``merge: true`` also ``final/merged/``, the base with the adapter merged in, as
  ``from_pretrained`` loads any model (one more copy of the model in memory while it is written).
- ``target_modules`` default: peft's choice for the model type (the attention projections for most
  decoders); ``all-linear`` targets every linear layer but the output head. A name that matches
  no module of the model is an error naming it.
- Sharded training (FSDP, DeepSpeed) of a LoRA model is refused: its frozen/trainable split and
  the merged weights are untested there.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from ..config import ConfigError
from ..json_files import write_json

PEFT_EXTRA = "pip install 'linnaeus-accel[peft]'"
BASE_RECORD = "base_weights.json"  # beside a saved adapter: the digest of the base it was trained on


class LoraOptions(BaseModel):
    """``MODEL.OPTIONS.lora`` (peft's ``LoraConfig``, under shorter names)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    r: int = Field(8, ge=1, description="The adapter's rank.")
    alpha: int = Field(16, ge=1, description="Scale numerator: updates are scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] | str | None = Field(
        None,
        description="Module names (or suffixes) to adapt, or all-linear; default: peft's for the model type.",
    )
    merge: bool = Field(False, description="Also write final/merged/: the base with the adapter merged in.")


def lora_options(raw: Any, key: str) -> LoraOptions:
    if not isinstance(raw, dict):
        raise ConfigError(
            [(key, f"must be a mapping of LoRA options, e.g. {{r: 8, alpha: 16}} (got {raw!r})")]
        )
    try:
        return LoraOptions.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError([(".".join([key, *map(str, e["loc"])]), e["msg"]) for e in exc.errors()]) from None


def with_lora(model: nn.Module, raw: Any, key: str) -> nn.Module:
    """``model`` wrapped by peft with a LoRA adapter as ``raw`` (MODEL.OPTIONS.lora) says."""
    options = lora_options(raw, key)
    try:
        import peft
    except ImportError:
        raise ConfigError([(key, f"LoRA needs peft: {PEFT_EXTRA}")]) from None
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    config = peft.LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=options.target_modules,
        task_type=peft.TaskType.SEQ_CLS if classifier else peft.TaskType.CAUSAL_LM,
    )
    try:
        with warnings.catch_warnings():  # peft reads transformers' old name; nothing for the user to do
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        text = " ".join(str(exc).split())
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            [(f"{key}.target_modules", f"{text[:300]} (the model's linear layers: {', '.join(names)})")]
        ) from None
    wrapped.linnaeus_lora = LoraRun(frozen_digest(wrapped), options.merge)  # type: ignore[assignment]
    return wrapped


class LoraRun:
    """What a run needs to know of its LoRA model: the digest of the frozen weights it was built
    with, and whether ``final/merged/`` is wanted."""

    def __init__(self, digest: str, merge: bool) -> None:
        self.digest, self.merge = digest, merge


def write_base_record(model: Any, directory: Path) -> None:
    """``BASE_RECORD`` beside the adapter ``model`` (a PeftModel of a run) saved in ``directory``:
    ``evaluate`` then tells a changed base from the right one, as resume does for a checkpoint."""
    write_json(directory / BASE_RECORD, {"version": 1, "frozen_weights_xxh3": model.linnaeus_lora.digest})


def recorded_base(directory: Path) -> str | None:
    """The digest ``BASE_RECORD`` in ``directory`` holds; None when there is none (an adapter saved
    before it was written). ValueError saying what is wrong with a damaged one."""
    file = directory / BASE_RECORD
    if not file.exists():
        return None
    try:
        digest = json.loads(file.read_bytes())["frozen_weights_xxh3"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file} is damaged ({type(exc).__name__}: {exc})") from None
    if not isinstance(digest, str):
        raise ValueError(f"{file} is damaged (frozen_weights_xxh3 is {digest!r}, not a string)")
    return digest


def is_peft_model(model: Any) -> bool:
    peft = sys.modules.get("peft")  # never imported for a model that is not its
    return peft is not None and isinstance(model, peft.PeftModel)


def frozen_digest(model: nn.Module) -> str:
    """xxh3-128 over the names, dtypes, shapes and bytes of ``model``'s frozen parameters (taken on
    the CPU where the model was built, before Accelerate moves it; a model given on a GPU is
    copied to the host a tensor at a time)."""
    import xxhash

    digest = xxhash.xxh3_128()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            continue
        tensor = parameter.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return str(digest.hexdigest())
