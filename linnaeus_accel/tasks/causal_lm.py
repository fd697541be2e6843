"""``causal_lm``: next-token prediction, counted in tokens.

Batches are dicts with ``input_ids`` ``[batch, length]``, ``labels`` of the same shape and an
optional ``attention_mask``, in the Hugging Face convention: ``labels`` are aligned with
``input_ids`` (often a copy of them) and the loss shifts them, so the logits at position t predict
``labels[t + 1]``; a label of -100 (padding, a prompt) carries no target. The model is called as
``model(input_ids, attention_mask=...)`` (without the mask when the batch has none) and returns
logits ``[batch, length, vocab]``, or an object with ``.logits`` such as a transformers
``ModelOutput``; labels are not passed, so a transformers model computes no loss of its own. With
``TASK.DOCUMENT_MASKING`` it is also given ``position_ids`` that restart after each end-of-document
id, so that each token attends within its document only (``document_masking.py``).

A target token is a unit: the step's loss is the mean over every target token of the step, on
every process, and ``tokens_seen`` counts them. Validation: loss and perplexity over every token.

Models that compute their own loss (``TASK.MODEL_LOSS: true``), as nanoGPT's, minGPT's and many
research models do, ``forward(idx, targets) -> (logits, loss)``: each window is split into inputs
(its first ``length - 1`` tokens) and targets (``labels`` from the second position on), so a window
of ``seq_len`` tokens suits a model with a context of ``seq_len - 1``; the model is called as
``model(inputs, targets)`` and returns ``(logits, loss)`` (or the loss alone, or an object or
mapping with ``loss``), the loss being the mean over the targets it does not ignore. Targets
without a label (-100 in ``labels``) are given to it as ``TASK.MODEL_IGNORE_INDEX`` (nanoGPT and
minGPT ignore -1; PyTorch's cross-entropy -100 by default). The task counts the same targets on
the device and multiplies the model's mean by their number, so the step's loss is still the mean
over every target token of the step, as the per-token sums make it. ``attention_mask`` is not
passed: unlabelled (right) padding carries no target and, behind the real tokens of a causal model,
changes none of their predictions.

Before the first step the model's vocabulary is checked against the training data's: a dataset may
declare ``vocab_size`` and ``max_token_id`` (``TokenFiles`` reads the largest id from its
sidecars), and a model with fewer outputs is refused. ``MODEL.OPTIONS.vocab_size`` is compared
before the model ever runs (an id past the embedding is an opaque IndexError on a CPU, a device-side
assert that ends the process on a GPU); the logits' last dimension once the probe has run, whatever
built the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config
from . import document_masking as masking
from .base import (
    IGNORE_INDEX,
    Direction,
    Task,
    TaskContext,
    ValidationPass,
    describe_keys,
    drop_targets,
    linnaeus_only_problems,
    logits_of,
    output_logits_problem,
)
from .chunked_loss import causal_lm_chunked_loss

VOCAB_KEY = "MODEL.OPTIONS.vocab_size"
MODEL_LOSS_ADVICE = (
    "a model whose forward is (idx, targets) -> (logits, loss) computes its own loss: set TASK.MODEL_LOSS "
    "to true (and TASK.MODEL_IGNORE_INDEX to the target value it ignores, -1 for nanoGPT)"
)


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


def model_loss_of(output: Any) -> Tensor:
    """The loss a model computed itself: the second item of a ``(logits, loss)`` pair (nanoGPT,
    minGPT), a mapping's ``"loss"``, an object's ``.loss``, or the output when it is one number."""
    if isinstance(output, Tensor):
        loss: Any = output
    elif isinstance(output, (tuple, list)):
        loss = output[1] if len(output) >= 2 else None
    elif isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(
            f"with TASK.MODEL_LOSS the model must return its loss, one number (the mean over its targets), as "
            f"(logits, loss), the loss alone, or an object with .loss; its loss was {got} "
            f"(the model returned {type(output).__name__})"
        )
    return loss


def model_logits_of(output: Any) -> Tensor | None:
    """The logits beside a model's own loss, where it returns them (the vocabulary check reads them)."""
    if isinstance(output, (tuple, list)):
        first = output[0] if output else None
        return first if isinstance(first, Tensor) else None
    try:
        return logits_of(output) if not isinstance(output, Tensor) else None
    except TypeError:
        return None


def add_to_message(exc: BaseException, hint: str) -> None:
    """``hint`` at the end of ``exc``'s message, when its message is its one string argument (the
    exception keeps its type and traceback)."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str) and str(exc) == exc.args[0]:
        exc.args = (f"{exc.args[0]} ({hint})",)


class CausalLMTask(Task):
    name = "causal_lm"
    counts_tokens = True
    metric_directions: Mapping[str, Direction] = {"loss": "min", "perplexity": "min"}
    # TASK.MODEL_LOSS and TASK.MODEL_IGNORE_INDEX, read at bind unless given to the constructor.
    model_loss = False
    ignore_index = IGNORE_INDEX
    loss_chunk_tokens = 0  # TASK.LOSS_CHUNK_TOKENS, read at bind

    # TASK.DOCUMENT_MASKING, and the end-of-document id it splits windows at (the dataset's eos_id).
    document_masking = False
    eos_id: int | None = None

    def __init__(
        self,
        model_loss: bool | None = None,
        ignore_index: int | None = None,
        document_masking: bool | None = None,
        eos_id: int | None = None,
    ) -> None:
        self.given = {
            "model_loss": model_loss,
            "ignore_index": ignore_index,
            "document_masking": document_masking,
        }
        if model_loss is not None:
            self.model_loss = model_loss
        if ignore_index is not None:
            self.ignore_index = ignore_index
        if document_masking is not None:
            self.document_masking = document_masking
        self.eos_id = eos_id

    def bind(self, context: TaskContext) -> None:
        super().bind(context)
        given = getattr(self, "given", {})  # a subclass's __init__ may not call this one
        if given.get("model_loss") is None:
            self.model_loss = context.config.TASK.MODEL_LOSS
        if given.get("ignore_index") is None:
            self.ignore_index = context.config.TASK.MODEL_IGNORE_INDEX
        if given.get("document_masking") is None:
            self.document_masking = context.config.TASK.DOCUMENT_MASKING
        if self.eos_id is None:
            self.eos_id = getattr(context.dataset, "eos_id", None)
        self.loss_chunk_tokens = context.config.TASK.LOSS_CHUNK_TOKENS

    def config_problems(self, config: Config) -> list[tuple[str, str]]:
        problems = linnaeus_only_problems(config.SCHEDULE, self.name)
        if self.document_masking and self.eos_id is None:
            problems.append((masking.KEY, masking.NO_EOS))
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
        if self.document_masking and (problem := masking.batch_problem(batch)) is not None:
            return problem
        shapes = {k: tuple(batch[k].shape) for k in ("input_ids", "labels", "attention_mask") if k in batch}
        if any(len(s) != 2 for s in shapes.values()) or len(set(shapes.values())) != 1:
            return f"input_ids, labels and attention_mask must all be [batch, length], got {shapes}"
        if self.model_loss and shapes["input_ids"][1] < 2:
            return f"with TASK.MODEL_LOSS each window needs at least 2 tokens (an input and its target), got {shapes}"
        return None

    def _vocabulary_problem(self, logits: Tensor) -> str | None:
        if getattr(self, "context", None) is None or logits.dim() < 1:
            return None
        size = logits.shape[-1]
        if (found := vocabulary_shortfall(size, self.context.dataset)) is None:
            return None
        least, why = found
        return (
            f"the model's logits have {size} entries per token, but {why}; give it at least "
            f"{least} outputs ({VOCAB_KEY} for hf_causal_lm)"
        )

    def output_problem(self, output: Any, batch: Any) -> str | None:
        if self.model_loss:
            try:
                model_loss_of(output)
            except TypeError as exc:
                return str(exc)
            logits = model_logits_of(output)
            return self._vocabulary_problem(logits) if logits is not None and logits.dim() == 3 else None
        problem = output_logits_problem(output)
        if problem is not None and isinstance(output, (tuple, list)):
            problem += f"; {MODEL_LOSS_ADVICE}"
        if problem is None:
            logits = logits_of(output)
            if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(batch["input_ids"].shape):
                problem = (
                    f"the causal_lm task needs logits [batch, length, vocab] for input_ids {tuple(batch['input_ids'].shape)}, "
                    f"got {tuple(logits.shape)}"
                )
            else:
                problem = self._vocabulary_problem(logits)
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
        targets: Tensor = batch["labels"][:, 1:]
        kept = targets != IGNORE_INDEX
        if self.model_loss and self.ignore_index != IGNORE_INDEX:
            kept &= targets != self.ignore_index  # what the model's own loss leaves out
        return kept.sum().reshape(1)

    def split_window(self, batch: Any) -> tuple[Tensor, Tensor]:
        """``(inputs, targets)`` for a model with its own loss: each window's first ``length - 1``
        tokens, and its labels from the second position on, an unlabelled one as ``ignore_index``.
        Contiguous, since such models flatten them with ``.view``."""
        targets: Tensor = batch["labels"][:, 1:]
        if self.ignore_index != IGNORE_INDEX:
            targets = targets.masked_fill(targets == IGNORE_INDEX, self.ignore_index)
        return batch["input_ids"][:, :-1].contiguous(), targets.contiguous()

    def forward(self, model: nn.Module, batch: Any) -> Any:
        try:
            if self.document_masking:
                return self._masked_forward(model, batch)
            if self.model_loss:
                return model(*self.split_window(batch))
            mask = batch.get("attention_mask")
            return (
                model(batch["input_ids"]) if mask is None else model(batch["input_ids"], attention_mask=mask)
            )
        except Exception as exc:
            # Without gradients (the first-batch probe, validation): a model refusing the length it
            # was given ("Cannot forward sequence of length 65") learns what seq_len counts. A
            # training step's error, and any other error, are left as they are: a signal handler
            # (a DataLoader worker's death) raises in whatever runs, a forward included.
            if not torch.is_grad_enabled() and (hint := self._length_hint(exc, model, batch)) is not None:
                add_to_message(exc, hint)
            raise

    def _masked_forward(self, model: nn.Module, batch: Any) -> Any:
        """The model called with ``position_ids`` that restart after each end-of-document id
        (document_masking.py), on the inputs it is given (the window, or its first length - 1
        tokens with TASK.MODEL_LOSS); the targets are the same as without masking."""
        inputs = self.split_window(batch) if self.model_loss else (batch["input_ids"],)
        return model(*inputs, **self._masking_keywords(model, inputs[0]))

    def _masking_keywords(self, model: nn.Module, input_ids: Tensor) -> dict[str, Any]:
        """The keywords of a masked call of ``model`` on ``input_ids``: the positions, and what its
        forward needs besides (the chunked loss's call passes them too)."""
        if self.eos_id is None:
            raise ValueError(f"{masking.KEY} {masking.NO_EOS}")
        # The forward's signature, read once per model (at the probe before the first step).
        read: dict[int, dict[str, Any]] = self.__dict__.setdefault("_masking_keywords_of", {})
        if (keywords := read.get(id(model))) is None:
            keywords = read[id(model)] = masking.model_keywords(model)
        return {"position_ids": masking.document_positions(input_ids, self.eos_id), **keywords}

    def _length_hint(self, exc: Exception, model: nn.Module, batch: Any) -> str | None:
        """What seq_len counts, when ``exc`` is ``model`` refusing the tokens per row it was given:
        its message names that number (nanoGPT's "Cannot forward sequence of length 65, block size
        is only 64", a size mismatch "(65) must match ... (64)"; not a pid), or it is an IndexError
        while an embedding of the model has fewer rows than that (a table of positions read past
        its end; a vocabulary is larger than a window). None for any other error."""
        length = batch["input_ids"].shape[-1]
        given = length - 1 if self.model_loss else length
        if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
            return None
        named = re.search(rf"(?<![\d.])(?<!pid ){given}(?!\d|\.\d)", str(exc)) is not None
        short_table = isinstance(exc, IndexError) and any(
            isinstance(m, nn.Embedding) and m.num_embeddings < given for m in model.modules()
        )
        if not (named or short_table):
            return None
        if self.model_loss:
            return (
                f"causal_lm with TASK.MODEL_LOSS gave the model {length - 1} input tokens per row: seq_len ({length}) "
                "counts the shifted target, so the inputs are seq_len - 1 tokens, and a model whose context is N "
                "tokens takes seq_len up to N + 1"
            )
        return (
            f"causal_lm gave the model {length} tokens per row, the whole window: seq_len ({length}) counts the "
            "shifted target, and without TASK.MODEL_LOSS the model sees all seq_len tokens, so a model whose "
            "context is N tokens takes seq_len up to N; with TASK.MODEL_LOSS, for a model that computes its own "
            "loss from (inputs, targets), it is given seq_len - 1 and takes seq_len up to N + 1"
        )

    def _summed_loss(self, model: nn.Module, batch: Any) -> Tensor:
        if self.model_loss:
            return self._model_summed_loss(model, batch)
        if self.loss_chunk_tokens > 0:  # the logits never whole: chunked_loss.py
            extra = self._masking_keywords(model, batch["input_ids"]) if self.document_masking else None
            return causal_lm_chunked_loss(model, batch, self.loss_chunk_tokens, IGNORE_INDEX, extra)
        logits = logits_of(self.forward(model, batch))[:, :-1]
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            batch["labels"][:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def _model_summed_loss(self, model: nn.Module, batch: Any) -> Tensor:
        """The model's mean over its targets times their number: the sum the per-token path
        returns, so the step divides it by every target of the step as it divides that one. A
        micro-batch without targets (all even-batch repeats) has a mean of 0/0: it adds 0, and no
        gradient (a where, not a multiplication by 0, which would keep the nan)."""
        loss = model_loss_of(self.forward(model, batch)).reshape(()).float()
        count = self.units(batch)[0]
        return torch.where(count > 0, loss * count, torch.zeros((), device=loss.device))

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
