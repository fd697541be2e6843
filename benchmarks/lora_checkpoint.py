"""A LoRA run's checkpoint against a full fine-tuning run's, of ``configs/lm_tiny.yaml``'s model and
of the same model widened to ~25M parameters.

Both start from the same ``save_pretrained`` directory (random weights): one
trains every weight, the other a LoRA adapter (r 8 on the attention projections, as
``configs/lm_finetune.yaml``). After one AdamW step each (so the optimizer holds its moments), the
two save a checkpoint in turn, round after round (default mode: the loop is blocked until every
file is written, the commit follows in the background); the paired ratio is LoRA's blocked time
over the full run's. A LoRA checkpoint writes the adapter and its optimizer state only, never the
frozen base (``checkpoint/state/frozen_weights.py``), so its cost is what any checkpoint pays whatever
its size (Accelerate's ``save_state`` pickling the optimizer and RNG states, our JSON, the
processes' agreement: ~10 ms here) plus a few kilobytes. lm_tiny's full checkpoint (3.5 MB of
weights and twice that of AdamW moments) costs little more than that fixed part, so the ratio
there says how small the fixed part is, not what LoRA saves; the widened model shows the latter.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .checkpoint import save_ours, with_optimizer_state
from .common import Row, paired, row

BENCHMARK = "lora_checkpoint"
REFERENCE = "full fine-tuning checkpoint"
TARGET = 0.2  # a LoRA checkpoint blocks the loop for less than a fifth of a full one's


def _trainer(root: Path, base: Path, lora: bool) -> Any:
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.models import build_model
    from linnaeus_accel.training.trainer import Trainer

    repo = Path(__file__).resolve().parent.parent
    config = load_config(
        repo / "configs" / "lm_finetune.yaml",
        [
            "ENV.OUTPUT.BASE_DIR", str(root), "EXPERIMENT.NAME", "lora" if lora else "full",
            "MODEL.OPTIONS.pretrained", str(base), "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2",
            *([] if lora else ["MODEL.OPTIONS.lora", "null"]),
        ],
    )  # fmt: skip
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    return Trainer(config, build_model(config, train), train, val)


def _base(directory: Path, widen: list[str]) -> Path:
    """lm_tiny's model (``widen``: options making it larger) as save_pretrained writes it."""
    from linnaeus_accel.config import load_config
    from linnaeus_accel.models import build_model

    repo = Path(__file__).resolve().parent.parent
    config = load_config(repo / "configs" / "lm_tiny.yaml", ["MODEL.OPTIONS.vocab_size", "257", *widen])
    build_model(config, None).save_pretrained(directory)  # type: ignore[operator]
    return directory


# (case, lm_tiny's options that size the model); the smoke run: the first, 1 round.
CASES = [
    ("lm_tiny", []),
    (
        "lm_tiny widened (hidden 512, 8 layers)",
        ["MODEL.OPTIONS.hidden_size", "512", "MODEL.OPTIONS.intermediate_size", "1536",
         "MODEL.OPTIONS.num_hidden_layers", "8", "MODEL.OPTIONS.num_attention_heads", "8"],
    ),
]  # fmt: skip


def _measure(root: Path, widen: list[str], rounds: int) -> tuple[dict[str, Any], dict[str, int]]:
    from accelerate.state import AcceleratorState, GradientState

    base = _base(root / "base", widen)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    full, lora = _trainer(root, base, lora=False), _trainer(root, base, lora=True)
    for trainer in (full, lora):
        with_optimizer_state(trainer)
    sizes = {
        name: sum(p.numel() * p.element_size() for p in t.model.parameters() if p.requires_grad)
        for name, t in (("full", full), ("lora", lora))
    }
    lora_s: list[float] = []
    full_s: list[float] = []
    for step in range(1, rounds + 2):  # the first round warms up: dropped
        order = (full, lora) if step % 2 else (lora, full)  # neither always goes first
        blocked = {id(t): save_ours(t, step)[0] for t in order}
        if step > 1:
            full_s.append(blocked[id(full)])
            lora_s.append(blocked[id(lora)])
    for trainer in (full, lora):
        trainer.checkpoints.writer.worker.wait()
    return paired(lora_s, full_s), sizes


def run(smoke: bool) -> list[Row]:
    rounds = 1 if smoke else 20
    rows: list[Row] = []
    for case, widen in CASES[:1] if smoke else CASES:
        with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
            stats, sizes = _measure(Path(tmp), widen, rounds)
        note = (
            f"{sizes['full'] / 1e6:.1f} MB of trained weights in full, {sizes['lora'] / 1e3:.0f} kB of adapter "
            f"(+ AdamW moments); {rounds} rounds after 1 warm-up"
        )
        rows.append(
            row(
                BENCHMARK,
                f"blocked, LoRA vs full fine-tuning, {case} (default mode)",
                "s per checkpoint",
                REFERENCE,
                **stats,
                target=f"ratio < {TARGET:.2f}",
                ok=stats["ratio"] < TARGET,
                note=note,
            )
        )
    return rows
