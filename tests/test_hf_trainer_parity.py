"""Per-step losses equal transformers' Trainer's, up to how each averages.

The same tiny GPT-2 (same weights, no dropout), the same windows in the same order, AdamW at a
constant LR, no clipping, 2 micro-batches per step: our per-step ``train/loss`` is the exact mean
over target tokens (each window of 64 tokens has 63 targets after the shift). transformers divides
the summed loss by every label position (``num_items_in_batch`` counts 64 per window), so it reports
63/64 of ours; corrected for that the two agree at every step, and the final weights agree to float
tolerance (AdamW is all but blind to the 63/64 scale of the gradients).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.in_process import reset_accelerate
from helpers.runs import read_metrics

from linnaeus_accel import Trainer
from linnaeus_accel.config import validate_config

transformers = pytest.importorskip("transformers")

SEQ_LEN, BATCH, ACCUMULATION, STEPS, LR = 64, 4, 2, 30, 1e-3


class Windows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed windows of byte ids (the same for both trainers), labels = inputs as transformers expects."""

    tokens_per_sample = SEQ_LEN - 1

    def __init__(self, count: int) -> None:
        text = (Path(torch.__file__).parent / "functional.py").read_bytes()[: count * SEQ_LEN]
        self.ids = torch.tensor(list(text), dtype=torch.int64).view(count, SEQ_LEN)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ_LEN, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def test_per_step_losses_match_transformers_trainer_up_to_its_63_of_64(tmp_path: Path) -> None:
    data = Windows(STEPS * BATCH * ACCUMULATION)
    model = tiny_gpt2()

    # transformers' Trainer, reading the windows in order.
    class InOrder(transformers.Trainer):  # type: ignore[misc]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
        dataloader_drop_last=True, seed=0,
    )  # fmt: skip
    theirs = copy.deepcopy(model)
    hf = InOrder(model=theirs, args=args, train_dataset=data)
    hf.train()
    hf_losses = [entry["loss"] for entry in hf.state.log_history if "loss" in entry]
    reset_accelerate()

    # Ours, from the same weights, the windows in order (a ready DataLoader is used as it is).
    config = validate_config(
        {
            "EXPERIMENT": {"NAME": "parity"},
            "ENV": {"OUTPUT": {"BASE_DIR": str(tmp_path)}},
            "DATA": {"BATCH_SIZE": BATCH},
            "TASK": {"NAME": "causal_lm"},
            "TRAIN": {"STEPS": STEPS, "ACCUMULATION_STEPS": ACCUMULATION, "CLIP_GRAD": None},
            "LR_SCHEDULER": {
                "NAME": "linear",
                "BASE_LR": LR,
                "MIN_LR": LR,
                "REFERENCE_BS": None,
                "WARMUP_FRACTION": 0.0,
            },
            "SCHEDULE": {"METRICS": {"STEP_INTERVAL": 1}, "CHECKPOINT": {"INTERVAL_EPOCHS": None}},
        }
    )
    ours = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False, drop_last=True)
    try:
        Trainer(config, ours, loader).fit()
    finally:
        reset_accelerate()
    our_losses = [r["train/loss"] for r in read_metrics(config.output_dir) if "train/loss" in r]

    assert len(our_losses) == len(hf_losses) == STEPS
    for step, (mine, reported) in enumerate(zip(our_losses, hf_losses, strict=True), start=1):
        assert reported == pytest.approx(mine * (SEQ_LEN - 1) / SEQ_LEN, rel=2e-6), step
        assert reported != pytest.approx(mine, rel=1e-3)  # the two averages do differ
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, theirs.state_dict()[name], rtol=1e-4, atol=1e-5, msg=name)
