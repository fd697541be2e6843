"""Document masking for ``causal_lm`` (``TASK.DOCUMENT_MASKING``): attention within each document.

Token files pack documents end to end, each followed by the end-of-document id (EOS), so a window
of ``seq_len`` tokens holds the end of one document, whole ones, and the start of another. Without
masking every token attends to everything before it in the window, other documents included. With
it, each token attends only to the tokens of its own document, and positions restart at 0 there:

- a document ends at its EOS token, which belongs to it (it attends to its own document and is at
  its document's last position); the next token starts a new document at position 0;
- the window's first document starts at position 0 too, wherever it started in the corpus;
- the targets are unchanged: every target of the window still counts (the EOS position still
  predicts the next document's first token, from its own document only), so the loss stays
  comparable with a run without masking.

The model is given the positions as ``position_ids`` ``[batch, length]`` (int64), the one
keyword for every model:

- a transformers model (``hf_causal_lm``) derives the block-causal mask from them: its
  ``create_causal_mask`` (``transformers.masking_utils``) starts a new sequence wherever a
  position is not its predecessor's plus one (``find_packed_sequence_indices``), for the sdpa,
  eager and flex attention implementations, but only when it is given no ``attention_mask`` and no
  cache. It is therefore also called with ``use_cache=False`` (a transformers model builds a cache
  by default, even in training, and with one the positions only move the rotary embedding);
- a model of your own takes ``position_ids=None`` in its forward and, when given, reads its
  position embedding at them and attends with ``block_causal_mask(position_ids)``
  (``examples/nanogpt_model.py`` does); a model whose forward takes no ``position_ids`` is refused
  before the first step.

Everything here is torch ops on the batch's device: no loop per token, no value read back.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import Tensor, nn

KEY = "TASK.DOCUMENT_MASKING"


def document_positions(input_ids: Tensor, eos_id: int) -> Tensor:
    """The position of every token in its document ``[batch, length]`` (int64): 0 at the start of
    the window and after every ``eos_id``, counting up to and including the EOS that ends it."""
    length = input_ids.shape[-1]
    index = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[..., 1:] = input_ids[..., :-1] == eos_id  # the token after an EOS starts a document
    # Each token's document starts at the last start at or before it: a running maximum.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def block_causal_mask(position_ids: Tensor) -> Tensor:
    """The attention mask of documents whose positions restart at 0 (``document_positions``):
    ``[batch, 1, length, length]`` booleans, True where query ``i`` may attend to key ``j`` (``j <=
    i``, the same document), as ``F.scaled_dot_product_attention``'s ``attn_mask`` takes them."""
    document = (position_ids == 0).cumsum(dim=-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    same = document.unsqueeze(-1) == document.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


# Why masking cannot run: no end-of-document id is known (the dataset declares no eos_id).
NO_EOS = (
    "needs the end-of-document id, and the training data declares none (its eos_id): token files "
    "get it from their sidecar (write them with linnaeus-accel tokenize, which writes one), hf_dataset "
    "from its tokenizer (DATA.DATASET.OPTIONS.eos_token), a dataset of your own from an eos_id "
    "attribute; or turn it off"
)


def batch_problem(batch: Mapping[str, Any]) -> str | None:
    """Batches with an ``attention_mask`` are padded, not packed: a transformers model would ignore
    the positions beside it (it builds the packed mask only without one)."""
    if "attention_mask" in batch:
        return (
            f"{KEY} is for packed windows (token_files, hf_dataset, python_docs), and these batches carry an "
            "attention_mask (padded sequences, one document each): turn it off"
        )
    return None


def model_keywords(model: nn.Module) -> dict[str, Any]:
    """The keywords the model is called with besides ``position_ids`` (``use_cache=False`` when its
    forward takes it); ValueError, one sentence, when its forward takes no ``position_ids``. Read
    from its class's forward, which wrappers of the instance's forward (Accelerate's autocast) leave
    as it is."""
    # The user's module under the wrappers that forward everything (DDP, DeepSpeed, compile).
    inner = extract_model_from_parallel(model, keep_torch_compile=False)
    parameters = inspect.signature(type(inner).forward).parameters
    if "position_ids" not in parameters:
        raise ValueError(
            f"{KEY} gives the model position_ids that restart at 0 after each end-of-document id, and "
            f"{type(inner).__name__}.forward takes no position_ids: add a position_ids=None argument that "
            "attends with linnaeus_accel.tasks.document_masking.block_causal_mask (as examples/nanogpt_model.py "
            f"does), or turn {KEY} off"
        )
    return {"use_cache": False} if "use_cache" in parameters else {}
