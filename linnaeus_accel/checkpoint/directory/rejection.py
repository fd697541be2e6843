"""A rejected checkpoint's ``REJECTED.txt``: why and when it failed verification.

``CheckpointStore.reject`` writes the note inside the checkpoint directory, durably, and only then
moves the directory to ``rejected/``: a kill between the two leaves the directory where it was with
its reason in it (never a rejected checkpoint that does not say why). Such a directory fails
verification, naming the reason (``note_problem``), and the next start finishes its move
(``CheckpointStore.remove_stale_staging``); rejecting it again keeps the first reason.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ...durable_files import write_durably

REJECTED_DIR = "rejected"
REJECTED_NOTE = "REJECTED.txt"
NOTE_TMP = f".{REJECTED_NOTE}.tmp"  # a note being written: a kill may leave it
_BECAUSE = "because it failed verification: "


def write_note(path: Path, root: Path, reason: str) -> None:
    """Write ``path/REJECTED.txt`` (``path``: a checkpoint directory of ``root``) durably; a note
    already there (a rejection cut short before its move) is kept, with its first reason. A disk
    that refuses the note (full) does not stop the move: the move is what matters."""
    if (path / REJECTED_NOTE).is_file():
        return
    note = (
        f"{path.name} was rejected in {root} on {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
        f"{_BECAUSE}{reason}\n\n"
        f"It is moved to {root / REJECTED_DIR}. linnaeus-accel never resumes from it and never deletes\n"
        f"it (--overwrite does). To use it again, repair what is wrong, delete this {REJECTED_NOTE} and\n"
        "pass the directory to --resume.\n"
    )
    with contextlib.suppress(OSError):
        write_durably(path / REJECTED_NOTE, path / NOTE_TMP, note.encode("utf-8"))


def note_problem(path: Path) -> str | None:
    """What verification says of a directory holding a ``REJECTED.txt`` (its reason), else None."""
    note = path / REJECTED_NOTE
    if not note.is_file():
        return None
    try:
        text = note.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"{REJECTED_NOTE}: rejected before (the note cannot be read: {exc})"
    reason = next(
        (line.removeprefix(_BECAUSE) for line in text.splitlines() if line.startswith(_BECAUSE)), None
    )
    return f"{REJECTED_NOTE}: rejected before, because " + (reason or "of what the note says")
