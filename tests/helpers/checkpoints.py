"""Checkpoints made by hand: committed through the real store without a run, or rewritten as an
attacker who can write a checkpoint's files would."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from linnaeus_accel.checkpoint.directory import MARKER, CheckpointStore, file_digest, read_marker
from linnaeus_accel.checkpoint.directory.marker import SIGNATURE, signature


def stage(store: CheckpointStore, step: int, extra: dict[str, bytes] | None = None) -> Path:
    """What save_state of every process plus the trainer's JSON would leave in staging."""
    staging = store.staging_dir(step)
    files = {
        "model.safetensors": hashlib.sha256(f"model {step}".encode()).digest() * 64,
        "optimizer.bin": f"optimizer {step}".encode() * 10,
        "random_states_0.pkl": b"rng",
        "sharded/part_0.bin": bytes(range(256)),  # FSDP-style subdirectories are part of it too
        "trainer_state.json": json.dumps({"global_step": step}).encode(),
        **(extra or {}),
    }
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    return staging


def save(store: CheckpointStore, step: int) -> Path:
    """``stage`` committed: a checkpoint of step ``step`` that verifies."""
    stage(store, step)
    return store.commit(step, {"global_step": step})


class RunsCode:
    """A pickle that runs a shell command when it is loaded (what the attacker writes)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def reseal(checkpoint: Path, key: str | None = None) -> None:
    """Rewrite COMMITTED.json for the files as they are now, every one listed (what an attacker
    who can write the checkpoint does), signed with ``key`` if given."""
    marker = read_marker(checkpoint)
    files = []
    for file in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        rel = file.relative_to(checkpoint).as_posix()
        if rel in (MARKER, "validation_journal.jsonl"):
            continue
        data = file.read_bytes()
        files.append({"path": rel, "size": len(data), **dict([file_digest(data)])})
    marker = {k: v for k, v in marker.items() if k != SIGNATURE}
    marker["files"] = files
    if key is not None:
        marker[SIGNATURE] = signature(marker, key.encode())
    (checkpoint / MARKER).write_text(json.dumps(marker), encoding="utf-8")


def make_checkpoint(output_dir: Path, step: int, *, marker: bool = True, model_bytes: int = 300_000) -> Path:
    """``<output_dir>/checkpoints/step_XXXXXXXX`` with files of the shapes a run writes (random
    weights of ``model_bytes``, a subdirectory, a binary that must survive byte for byte) and, with
    ``marker``, a commit marker: what a bucket's upload and download are tried on."""
    d = output_dir / "checkpoints" / f"step_{step:08d}"
    (d / "random_states").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(model_bytes))
    (d / "optimizer.bin").write_bytes(bytes(range(256)) + b"\x00\r\n\xff")
    (d / "random_states" / "rank_0.bin").write_bytes(os.urandom(64))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}), encoding="utf-8")
    if marker:
        (d / MARKER).write_text(json.dumps({"global_step": step}), encoding="utf-8")
    return d


def tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d``, by its '/'-separated path: for byte-for-byte comparisons."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
