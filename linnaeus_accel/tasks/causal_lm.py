"""``causal_lm``: next-token prediction, counted in tokens.

Batches are dicts with ``input_ids`` ``[batch, length]``, ``labels`` of the same shape and an
optional ``attention_mask``, in the Hugging Face convention: ``labels`` are aligned with
``input_ids`` (often a copy of them) and the loss shifts them, so the logits at position t predict
``labels[t + 1]``; a label of -100 (padding, a prompt) carries no target. The model is called as
``model(input_ids, attention_mask=...)`` (without the mask when the batch has none) and returns
logits ``[batch, length, vocab]``, or an object with ``.logits`` such as a transformers
``ModelOutput``; labels are not passed, so a transformers model computes no loss of its own.

A target token is a unit: the step's loss is the mean over every target token of the step, on
every process, and ``tokens_seen`` counts them. Validation: loss and perplexity over every token.

Before the first step the model's vocabulary is checked against the training data's: a dataset may
declare ``vocab_size`` and ``max_token_id`` (``TokenFiles`` reads the largest id from its
sidecars), and a model with fewer outputs is refused. ``MODEL.OPTIONS.vocab_size`` is compared
before the model ever runs (an id past the embedding is an opaque IndexError on a CPU, a device-side
assert that ends the process on a GPU); the logits' last dimension once the probe has run, whatever
built the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config
from .base import (
    IGNORE_INDEX,
    Direction,
    Task,
    ValidationPass,
    describe_keys,
    drop_targets,
    linnaeus_only_problems,
    logits_of,
    output_logits_problem,
)

VOCAB_KEY = "MODEL.OPTIONS.vocab_size"


def vocabulary_shortfall(size: int, dataset: Any) -> tuple[int, str] | None:
    """When a model vocabulary of ``size`` is too small for ``dataset``'s tokens: the size it needs,
    and why (ending in the ids it leaves out). A dataset may declare ``vocab_size``, and
    ``max_token_id`` with ``max_token_file`` (``TokenFiles`` does); None when ``size`` covers both,
    or the dataset declares neither."""
    declared, largest = getattr(dataset, "vocab_size", None), getattr(dataset, "max_token_id", None)
    declared = declared if isinstance(declared, int) and not isinstance(declared, bool) else 0
    top = largest + 1 if isinstance(largest, int) and not isinstance(largest, bool) and largest >= 0 else 0
    needed = max(declared, top)
    if size >= needed:
        return None
    if top >= declared:  # the id itself (and its file) says more than a vocabulary size
        file = getattr(dataset, "max_token_file", None)
        why = f"the training data holds token id {top - 1}" + (f" (in {file})" if file else "")
    else:
        why = f"the training data's vocabulary is {declared} ids (its vocab_size)"
    return needed, f"{why}: the model would have no output for ids {size} to {needed - 1}"


class CausalLMTask(Task):
    name = "causal_lm"
    counts_tokens = True
    metric_directions: Mapping[str, Direction] = {"loss": "min", "perplexity": "min"}

    def config_problems(self, config: Config) -> list[tuple[str, str]]:
        problems = linnaeus_only_problems(config, self.name)
        configured = config.MODEL.OPTIONS.get("vocab_size")
        context = getattr(self, "context", None)  # set by bind
        if context is None or not isinstance(configured, int) or isinstance(configured, bool):
            return problems
        # Found here, before the model ever runs: an id past its embedding would crash it.
        if (found := vocabulary_shortfall(configured, context.dataset)) is not None:
            least, why = found
            problems.append((VOCAB_KEY, f"is {configured}, but {why}; set it to at least {least}"))
        return problems

    def batch_problem(self, batch: Any) -> str | None:
        if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
            return (
                "the causal_lm task needs batches with 'input_ids' and 'labels' (and optionally 'attention_mask'), "
                f"each [batch, length]; the training data gives {describe_keys(batch)} "
                "(for packed token sequences see linnaeus_accel.data.PackedTokens)"
            )
        shapes = {k: tuple(batch[k].shape) for k in ("input_ids", "labels", "attention_mask") if k in batch}
        if any(len(s) != 2 for s in shapes.values()) or len(set(shapes.values())) != 1:
            return f"input_ids, labels and attention_mask must all be [batch, length], got {shapes}"
        return None

    def output_problem(self, output: Any, batch: Any) -> str | None:
        problem = output_logits_problem(output)
        if problem is None:
            logits = logits_of(output)
            if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(batch["input_ids"].shape):
                problem = (
                    f"the causal_lm task needs logits [batch, length, vocab] for input_ids {tuple(batch['input_ids'].shape)}, "
                    f"got {tuple(logits.shape)}"
                )
            elif getattr(self, "context", None) is not None:
                size = logits.shape[-1]
                if (found := vocabulary_shortfall(size, self.context.dataset)) is not None:
                    least, why = found
                    problem = (
                        f"the model's logits have {size} entries per token, but {why}; give it at least "
                        f"{least} outputs ({VOCAB_KEY} for hf_causal_lm)"
                    )
        return problem

    def default_flops_per_unit(self, model: nn.Module) -> float | None:
        # The usual estimate for a decoder: forward 2 x parameters per token, backward twice that.
        # Full sizes: a DTensor (FSDP2) reports its global size, a ZeRO-3 placeholder its ds_numel.
        return 6.0 * sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)

    def prepare(self, batch: Any, step: int, epoch: int, batch_index: int, real: Tensor | None) -> Any:
        if real is None:
            return batch
        return {**batch, "labels": drop_targets(batch["labels"], real)}

    def units(self, batch: Any) -> Tensor:
        labels: Tensor = batch["labels"]
        return (labels[:, 1:] != IGNORE_INDEX).sum().reshape(1)

    def forward(self, model: nn.Module, batch: Any) -> Any:
        mask = batch.get("attention_mask")
        return model(batch["input_ids"]) if mask is None else model(batch["input_ids"], attention_mask=mask)

    def _summed_loss(self, model: nn.Module, batch: Any) -> Tensor:
        logits = logits_of(self.forward(model, batch))[:, :-1]
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            batch["labels"][:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def loss_sums(self, model: nn.Module, batch: Any) -> Tensor:
        return self._summed_loss(model, batch).reshape(1)

    def validation_step(
        self, model: nn.Module, batch: Any, real: Tensor | None, vpass: ValidationPass
    ) -> Tensor:
        """[summed loss, target tokens] over the real rows."""
        batch = self.prepare(batch, 0, 0, 0, real)
        return torch.stack([self._summed_loss(model, batch).double(), self.units(batch)[0].double()])

    def validation_metrics(self, sums: list[float], vpass: ValidationPass) -> dict[str, float]:
        loss = sums[0] / max(1.0, sums[1])
        return {f"{vpass.prefix}/loss": loss, f"{vpass.prefix}/perplexity": math.exp(min(loss, 700.0))}
