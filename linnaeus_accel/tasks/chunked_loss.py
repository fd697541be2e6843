"""``TASK.LOSS_CHUNK_TOKENS``: the causal_lm loss computed a few thousand tokens at a time.

The plain loss projects every position onto the vocabulary at once: ``[batch, length, vocab]``
logits in float32, and as large a gradient (2.5 GB at 12 x 1024 tokens and 50,304 ids). Here the
model's body runs as usual up to its final hidden states, and the output projection and the
cross-entropy run on ``N`` (flattened) positions at a time, each chunk under
``torch.utils.checkpoint``: its logits are freed as soon as its summed loss is known, and rebuilt
for its backward, one chunk at a time. The sum and the gradients are those of the plain path (the
same float32 cross-entropy, summed with ``ignore_index``); the gradient of the projection's weight
is accumulated over the chunks by autograd, into the input embedding as well when the two are tied.

Which models can, the hidden states being fetched through the model's own forward (so that DDP,
``torch.compile`` and Accelerate's autocast wrap it as in the plain path):

- a transformers model whose forward takes ``logits_to_keep``: it is called with no position to
  keep and ``output_hidden_states=True``, and its last hidden state is projected by
  ``get_output_embeddings()``. Models that scale or cap their logits after the projection
  (``logit_scale``, ``final_logit_softcapping``, ...) are refused: the chunks would differ.
- a model of one's own with ``get_output_embeddings()`` returning its output ``nn.Linear`` and a
  ``forward(input_ids, ..., return_hidden=False)`` that, given ``return_hidden=True``, returns the
  final hidden states ``[batch, length, hidden]``, the input of that projection.

Any other model is refused at the first batch (the check before the first step runs it).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

KEY = "TASK.LOSS_CHUNK_TOKENS"
# Config attributes of transformers models whose logits are not the projection's output alone.
LOGIT_TRANSFORMS = (
    "logit_scale",
    "final_logit_softcapping",
    "logits_scaling",
    "lm_head_multiplier",
    "output_multiplier_scale",
    "logits_scale",
)


class ChunkedLossRefused(ValueError):
    """The model cannot have its loss computed in chunks (the message says why and the fix)."""


def _refuse(why: str) -> ChunkedLossRefused:
    return ChunkedLossRefused(f"{KEY} {why}: expose it or set {KEY} to 0")


def _takes(module: nn.Module, parameter: str) -> bool:
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return parameter in params  # by name: **kwargs may swallow it and do nothing


def _is_transformers(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # an own model in an environment without transformers
        return False
    return isinstance(module, PreTrainedModel)


def projection_of(model: nn.Module) -> tuple[nn.Linear, bool]:
    """The output ``nn.Linear`` of ``model`` (DDP or compiled: the module inside) and whether the
    model is a transformers one; refuses a model the chunked loss cannot run."""
    inner = extract_model_from_parallel(model, keep_fp32_wrapper=True)
    name = type(inner).__name__
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        return_why = "returns none" if callable(get) else "is missing"
        raise _refuse(
            f"needs the model's output projection, an nn.Linear from get_output_embeddings(), and {name}'s "
            f"{return_why if head is None else f'returns a {type(head).__name__}'}"
        )
    weight = head.weight
    if type(weight).__name__ == "DTensor" or hasattr(weight, "ds_numel"):
        raise ChunkedLossRefused(
            f"{KEY} needs the output projection's whole weight on every process, and FSDP or DeepSpeed ZeRO-3 "
            f"shard it: set {KEY} to 0"
        )
    if _is_transformers(inner):
        config = getattr(inner, "config", None)
        get_text = getattr(config, "get_text_config", None)
        configs = [config, get_text()] if callable(get_text) else [config]
        scaled = [a for a in LOGIT_TRANSFORMS for c in configs if getattr(c, a, None) not in (None, 1, 1.0)]
        if scaled or hasattr(inner, "logit_scale"):
            raise ChunkedLossRefused(
                f"{KEY} computes logits as the output projection alone, and {name} also transforms them "
                f"({', '.join(sorted(set(scaled))) or 'logit_scale'}): set {KEY} to 0"
            )
        if (
            getattr(config, "tie_last_hidden_states", None) is False
        ):  # hidden_states[-1] is then no head input
            raise ChunkedLossRefused(
                f"{KEY} reads the head's input as the last of the hidden states, and {name}'s config sets "
                f"tie_last_hidden_states to false: set {KEY} to 0"
            )
        if not _takes(inner, "logits_to_keep"):
            raise ChunkedLossRefused(
                f"{KEY} needs a transformers model whose forward takes logits_to_keep, and {name}'s does not: "
                f"set {KEY} to 0"
            )
        return head, True
    if not _takes(inner, "return_hidden"):
        raise _refuse(
            f"needs the model's final hidden states, from forward(input_ids, return_hidden=True), and {name}'s "
            "forward takes no return_hidden"
        )
    return head, False


def _autocast_of(model: nn.Module) -> AbstractContextManager[Any]:
    """Accelerate's mixed-precision autocast when it wraps the model's forward (the projection is
    then computed in the dtype the plain path computes it in), else nothing."""
    inner = extract_model_from_parallel(model, keep_fp32_wrapper=True)
    if getattr(inner, "_original_forward", None) is None:
        return nullcontext()
    from accelerate.state import AcceleratorState
    from accelerate.utils import get_mixed_precision_context_manager

    state = AcceleratorState()
    autocast: AbstractContextManager[Any] = get_mixed_precision_context_manager(state.mixed_precision != "no")
    return autocast


def final_hidden(
    model: nn.Module, batch: Any, transformers_model: bool, extra: dict[str, Any] | None = None
) -> Tensor:
    """The hidden states the output projection reads, ``[batch, length, hidden]``, from a call of
    ``model`` itself that computes no logits; ``extra``: more keywords of that call (document
    masking's ``position_ids``)."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    kwargs: dict[str, Any] = {} if mask is None else {"attention_mask": mask}
    kwargs.update(extra or {})
    if transformers_model:
        # No position to keep: the head projects [batch, 0, hidden]; the last hidden state is the
        # base model's output, the one the head would have projected.
        none = torch.empty(0, dtype=torch.long, device=ids.device)
        out = model(ids, logits_to_keep=none, output_hidden_states=True, **kwargs)
        hidden = out.hidden_states[-1] if getattr(out, "hidden_states", None) else None
    else:
        hidden = model(ids, return_hidden=True, **kwargs)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(ids.shape):
        got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise _refuse(
            f"needs final hidden states [batch, length, hidden] for input_ids {tuple(ids.shape)}, got {got}"
        )
    return hidden


def _chunk_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int
) -> Tensor:
    logits = F.linear(
        hidden.to(weight.dtype) if not torch.is_autocast_enabled(hidden.device.type) else hidden, weight, bias
    )
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def chunked_summed_loss(
    hidden: Tensor, head: nn.Linear, targets: Tensor, chunk_tokens: int, ignore_index: int
) -> Tensor:
    """The summed cross-entropy of ``head(hidden)`` against ``targets`` (``[tokens, hidden]`` and
    ``[tokens]``), ``chunk_tokens`` positions at a time; the number of chunks follows from the
    shapes alone, so nothing is read back from the device."""
    parts = [
        checkpoint(_chunk_loss, h, head.weight, head.bias, y, ignore_index, use_reentrant=False)
        for h, y in zip(torch.split(hidden, chunk_tokens), torch.split(targets, chunk_tokens), strict=True)
    ]
    if not parts:  # no position at all: a zero that still depends on the weight
        return (head.weight.sum() * 0).float()
    return torch.stack(parts).sum()


def causal_lm_chunked_loss(
    model: nn.Module, batch: Any, chunk_tokens: int, ignore_index: int, extra: dict[str, Any] | None = None
) -> Tensor:
    """The causal_lm summed loss (logits at t against ``labels[t + 1]``) in chunks of ``chunk_tokens``;
    ``extra``: more keywords of the model's call (document masking's)."""
    head, transformers_model = projection_of(model)
    hidden = final_hidden(model, batch, transformers_model, extra)[:, :-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = batch["labels"][:, 1:].reshape(-1)
    with _autocast_of(model):  # checkpoint recomputes each chunk under the same autocast
        return chunked_summed_loss(flat, head, targets, chunk_tokens, ignore_index)
