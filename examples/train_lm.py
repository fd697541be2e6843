"""Pretrain a small causal language model from your own script, through linnaeus-accel's Python API.

    python examples/train_lm.py
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/train_lm.py  # 2 CPU processes
    accelerate launch examples/train_lm.py                                                        # your GPUs

Nothing is registered: the model is a transformers ``LlamaForCausalLM`` built from a config (random
weights, nothing downloaded) and the data a plain PyTorch ``Dataset``: the paragraphs of Python's
own help texts (the standard library's ``pydoc_data``), as bytes, of different lengths, padded per
batch by ``collate`` with labels of -100 where there is no target. linnaeus-accel counts the target
tokens, weighs every one of them equally in each optimizer step whatever the padding, the number of
processes or the accumulation, and resumes exactly when the same command runs again.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import Dataset

from linnaeus_accel import Trainer, load_config

PAD = 0  # byte 0 never occurs in the text: it only pads


class Paragraphs(Dataset[dict[str, torch.Tensor]]):
    """Every ``split`` paragraph of the help texts (train: 9 of 10, val: the 10th), as UTF-8
    bytes, cut to ``max_len``."""

    def __init__(self, split: str, max_len: int = 96, limit: int | None = None) -> None:
        import pydoc_data.topics

        text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
        paragraphs = [p.strip().encode("utf-8")[:max_len] for p in text.split("\n\n") if len(p.strip()) > 8]
        held_out = [i % 10 == 9 for i in range(len(paragraphs))]
        self.items = [p for p, val in zip(paragraphs, held_out, strict=True) if val == (split == "val")][
            :limit
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(list(self.items[i]), dtype=torch.long)}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest paragraph; padding is masked out of attention and carries no target."""
    longest = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), longest), PAD, dtype=torch.long)
    for row, item in enumerate(items):
        input_ids[row, : len(item["input_ids"])] = item["input_ids"]
    attention_mask = (input_ids != PAD).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="outputs", help="runs go to OUTPUT/train_lm_example")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training paragraphs")
    parser.add_argument("--log-every", type=int, default=20, help="log training metrics every N steps")
    args = parser.parse_args(argv)

    config = load_config(
        {
            "EXPERIMENT": {"NAME": "train_lm_example", "SEED": 0},
            "ENV": {"OUTPUT": {"BASE_DIR": args.output}},
            "TASK": {"NAME": "causal_lm"},
            "DATA": {"BATCH_SIZE": args.batch_size},
            "TRAIN": {"EPOCHS": args.epochs, "ACCUMULATION_STEPS": args.accumulation, "CLIP_GRAD": 1.0},
            "LR_SCHEDULER": {
                "NAME": "wsd",
                "BASE_LR": 3e-3,
                "REFERENCE_BS": None,  # the LR as given, whatever the effective batch
                "WARMUP_FRACTION": 0.1,
                "MIN_LR": 3e-5,
                "WARMUP_LR": 3e-5,
            },
            "SCHEDULE": {
                "VALIDATION": {"INTERVAL_EPOCHS": 1},
                "CHECKPOINT": {"INTERVAL_EPOCHS": 1},
                "METRICS": {"STEP_INTERVAL": args.log_every},
            },
        }
    )
    torch.manual_seed(0)  # the same initial weights on every process
    model = build_model()
    trainer = Trainer(
        config,
        model,
        Paragraphs("train", limit=args.limit),
        Paragraphs("val", limit=args.limit),
        collate_fn=collate,
    )
    return trainer.fit()


if __name__ == "__main__":
    main()
