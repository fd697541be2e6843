"""``final/``: the trained weights, written so that the tools a user already has can load them.

- A transformers model (any ``PreTrainedModel``: ``hf_causal_lm``, or one given through the Python
  API) is written by its own ``save_pretrained``: ``config.json``, ``generation_config.json`` where
  the model has one, and ``model.safetensors`` (sharded with an index past 50 GB) without the tied
  copies that ``from_pretrained`` ties back, so ``AutoModelForCausalLM.from_pretrained(final)``
  loads every tensor without a warning. The run's tokenizer goes beside them
  (``tokenizer.json`` and ``tokenizer_config.json``; ``AutoTokenizer.from_pretrained(final)``).
  Both configs carry the data's special ids (``models.hf.special_ids``: its end-of-document id as
  ``eos_token_id``, so ``generate()`` stops where a document ends), the tokenizer the same tokens.
- A model wrapped by peft (``MODEL.OPTIONS.lora``) is written as peft writes an adapter
  (``adapter_config.json``, ``adapter_model.safetensors``; ``PeftModel.from_pretrained(base,
  final)``); with ``lora.merge`` the merged full model also goes to ``final/merged/`` in the layout
  above.
- Any other model keeps Accelerate's ``save_model`` (``model.safetensors`` under the model's own
  names).

Every process calls ``save_final`` (collective): under FSDP and DeepSpeed ZeRO-3 the full weights
are gathered by ``Accelerator.get_state_dict`` and written by the main process, the same way.
"""

from __future__ import annotations

import copy
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import is_compiled_module
from torch import nn

from ...models.hf import SpecialIds, set_special_ids, special_ids
from ...models.lora import is_peft_model, write_base_record
from ...models.pretrained import quiet_progress

MERGED_DIR = "merged"  # a LoRA run's base with the adapter merged in (lora.merge)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


@dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer.json the run's tokens come from (None: bytes), and their special ids (None:
    the data does not say)."""

    path: str | None
    ids: SpecialIds | None


def run_tokenizer(dataset: Any) -> RunTokenizer | None:
    """The training data's tokenizer (``tokenizer_file`` of the built-in token datasets) and
    special ids; None for data that says neither."""
    path = getattr(dataset, "tokenizer_file", None)
    path = path if isinstance(path, str) else None
    ids = special_ids(dataset)
    return RunTokenizer(path, ids) if path is not None or ids is not None else None


def is_transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # never imported for models that are not its
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def data_records(dataset: Any) -> dict[str, dict[str, Any]]:
    """What the training dataset asks the run to keep beside its weights, by file name (JSON
    data): a species dataset's taxonomy, so that predictions can be named, and its preprocessing,
    so that serving cannot disagree with training. A dataset declares them with ``run_records()``."""
    records = getattr(dataset, "run_records", None)
    return dict(records()) if callable(records) else {}


def save_final(
    accelerator: Accelerator, model: nn.Module, directory: Path, tokenizer: RunTokenizer | None = None
) -> None:
    """Write ``model``'s weights to ``directory`` (collective; see the module docstring).
    ``tokenizer``: the run's, if it has one."""
    inner = model._orig_mod if is_compiled_module(model) else model  # the model's own names
    unwrapped = accelerator.unwrap_model(inner, keep_torch_compile=False)
    if not (is_transformers_model(unwrapped) or is_peft_model(unwrapped)):
        accelerator.save_model(inner, directory, safe_serialization=True)
        return
    if tokenizer is not None and tokenizer.ids is not None:
        set_special_ids(unwrapped, tokenizer.ids)  # a model given through the Python API too
    state_dict = accelerator.get_state_dict(inner)  # collective: gathers sharded weights
    if not accelerator.is_main_process:
        return
    directory.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        unwrapped.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        _save_tokenizer(directory, tokenizer, unwrapped)
        lora = getattr(unwrapped, "linnaeus_lora", None) if is_peft_model(unwrapped) else None
        if lora is not None:
            write_base_record(unwrapped, directory)  # for evaluate: the base this adapter needs
        if lora is not None and lora.merge:
            merged = copy.deepcopy(unwrapped).merge_and_unload()  # the run's model stays as it is
            merged.save_pretrained(directory / MERGED_DIR, safe_serialization=True)
            _save_tokenizer(directory / MERGED_DIR, tokenizer, merged)


def _save_tokenizer(directory: Path, tokenizer: RunTokenizer | None, model: Any) -> None:
    """The run's tokenizer.json as transformers loads it (its end-of-document token as
    ``eos_token``); else the tokenizer files of the pretrained directory the model came from."""
    if tokenizer is not None and tokenizer.path is not None:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_file=tokenizer.path)  # type: ignore[no-untyped-call]
        ids = tokenizer.ids
        named = (("eos_token", ids.eos), ("bos_token", ids.bos), ("pad_token", ids.pad)) if ids else ()
        for name, token_id in named:  # the ids of config.json and generation_config.json
            if token_id is not None:
                setattr(fast, name, fast.convert_ids_to_tokens(token_id))
        fast.save_pretrained(directory)
        return
    loaded_from = str(getattr(model, "name_or_path", "") or "")  # "" for a model built from a config
    if loaded_from and Path(loaded_from).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(loaded_from) / name).is_file():
                shutil.copyfile(Path(loaded_from) / name, directory / name)
