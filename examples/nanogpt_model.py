"""A nanoGPT-style GPT that computes its own loss, trained by the causal_lm task as it is.

Its forward is ``forward(idx, targets=None) -> (logits, loss)``, the loss a cross-entropy that
ignores target -1, the shape of nanoGPT's and minGPT's models. ``TASK.MODEL_LOSS: true`` makes
causal_lm split each window of ``seq_len`` tokens into inputs and targets (``seq_len - 1`` each)
and call ``model(inputs, targets)``; ``TASK.MODEL_IGNORE_INDEX: -1`` gives unlabelled targets
(even-batch repeats, padding) the value this loss ignores. The logged loss is still the exact mean
over every target token of a step: the task weights the model's mean by its micro-batch's targets.

``examples/nanogpt.yaml`` is nanoGPT's character-level recipe, small: byte-level text that ships
with Python (the built-in ``python_docs`` data, 257 ids), 4 layers, block 64, n_embd 128. This
script registers the model as ``MODEL.TYPE nanogpt`` and runs ``linnaeus-accel train`` (other
arguments as that command takes them)::

    python examples/nanogpt_model.py                     # --cfg examples/nanogpt.yaml by default
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/nanogpt_model.py \\
        --cfg examples/nanogpt.yaml
    python examples/nanogpt_model.py --opts TRAIN.STEPS 100 EXPERIMENT.NAME nanogpt_try   # a short try

On your own token files, replace ``DATA.DATASET`` (``NAME: token_files``, ``OPTIONS: {paths: [...],
seq_len: 65}``): ``vocab_size`` then comes from the files' sidecars (``linnaeus-accel tokenize``
writes them); nanoGPT's ``.bin`` files have none, so give ``dtype: uint16`` and the vocabulary, as
``MODEL.OPTIONS.vocab_size`` (its ``meta.pkl``'s) or ``DATA.DATASET.OPTIONS.vocab_size``: without
it the model is refused.

``MODEL.OPTIONS`` are the fields of ``GPTConfig`` below; ``vocab_size`` defaults to the data's.

``TASK.DOCUMENT_MASKING: true`` (attention within each document of a window) calls it as
``model(inputs, targets, position_ids=...)``: positions that restart at 0 after each end-of-document
id, which it reads its position embedding at and attends within (``block_causal_mask``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linnaeus_accel.cli import main
from linnaeus_accel.config import Config, ConfigError
from linnaeus_accel.models import register_model
from linnaeus_accel.tasks.document_masking import block_causal_mask

IGNORE = -1  # the target value the loss leaves out (nanoGPT's and minGPT's convention)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 257  # bytes and an end-of-document id, as the built-in text data has
    block_size: int = 64  # the longest sequence the position table covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # no biases in the linear layers and LayerNorms: as good, and a little faster


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # one matmul for all three
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.residual_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        batch, length, width = x.shape
        # [batch, length, width] -> [batch, heads, length, head width]: SDPA attends over the last two.
        q, k, v = (
            part.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )
        # is_causal instead of a mask tensor: SDPA picks a fused (flash, memory-efficient) kernel;
        # a mask (document masking's block-causal one) only where the documents must be kept apart.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None
        )
        out: Tensor = self.residual_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.proj(F.gelu(self.up(x))))
        return out


class Block(nn.Module):
    """Pre-LN: each sublayer reads a normalised copy and adds to the residual stream, which is never
    normalised itself, so gradients reach the first layers undamped (stable without LR warm-up
    tricks)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_attn(x), mask)
        out: Tensor = x + self.mlp(self.ln_mlp(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.position_embedding = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_final = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.apply(self._init)
        # GPT-2's scaling: each block adds two projections to the residual stream, so their init
        # shrinks with depth and the stream's variance stays ~constant however many layers.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, position_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``position_ids`` ``[batch, length]``, when given: each token's position in its document
        (0 at each document's start, as TASK.DOCUMENT_MASKING gives them); the tokens then attend
        only within their document. Without them, positions 0.. and causal attention over all."""
        length = idx.shape[1]
        if length > self.config.block_size:
            # Past the position table an embedding lookup fails opaquely (a device-side assert on a GPU).
            raise ValueError(
                f"GPT: a sequence of {length} tokens is longer than block_size {self.config.block_size}"
            )
        positions = torch.arange(length, device=idx.device) if position_ids is None else position_ids
        mask = None if position_ids is None else block_causal_mask(position_ids)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x, mask)
        # The lm_head is the token embedding itself (tied): a projection on the same tensor rather
        # than a second module holding it, so checkpoints, safetensors and sharding see one parameter.
        logits = F.linear(self.ln_final(x), self.token_embedding.weight)
        if targets is None:
            return logits, None
        # Float32 for the softmax under bf16/fp16 autocast; the mean over the targets that are not IGNORE.
        loss = F.cross_entropy(
            logits.view(-1, logits.shape[-1]).float(), targets.view(-1), ignore_index=IGNORE
        )
        return logits, loss


@register_model("nanogpt")
def build_nanogpt(config: Config, dataset: Any) -> GPT:
    options = dict(config.MODEL.OPTIONS)
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            [("MODEL.OPTIONS", f"nanogpt takes {', '.join(sorted(known))}, not {', '.join(unknown)}")]
        )
    if "vocab_size" not in options:
        vocab = getattr(dataset, "vocab_size", None)
        if not isinstance(vocab, int):
            # GPTConfig's 257 would fit bytes, not the user's tokens: a model whose vocabulary
            # silently differs from the data's wastes rows or fails on the first larger id.
            raise ConfigError(
                [
                    (
                        "MODEL.OPTIONS.vocab_size",
                        "nanogpt: the data does not say its vocabulary size (a .bin token file without "
                        "a sidecar, as nanoGPT's prepare.py writes them): set it to the tokenizer's "
                        "(the vocab_size in nanoGPT's meta.pkl for its character data; 50304 for GPT-2's "
                        "tokens, nanoGPT's padding of 50257), or set DATA.DATASET.OPTIONS.vocab_size, "
                        "or write the files with linnaeus-accel tokenize, whose sidecar says it",
                    )
                ]
            )
        options["vocab_size"] = vocab  # the data's: every id it holds has an output
    return GPT(GPTConfig(**options))


EXAMPLE_CONFIG = Path(__file__).with_name("nanogpt.yaml")


def train_arguments(argv: list[str]) -> list[str]:
    """``linnaeus-accel train`` arguments: ``argv``, with ``--cfg examples/nanogpt.yaml`` when it names none."""
    return ["train", *argv] if "--cfg" in argv else ["train", "--cfg", str(EXAMPLE_CONFIG), *argv]


if __name__ == "__main__":
    sys.exit(main(train_arguments(sys.argv[1:])))
