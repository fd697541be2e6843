"""The checkpoint key (``LINNAEUS_CHECKPOINT_KEY``) across processes: the main process signs every
checkpoint and every process verifies, so all must hold the same key, or none."""

from __future__ import annotations

from pathlib import Path

from accelerate.utils import gather_object

from ..config import ConfigError
from .directory import MarkerError, read_marker
from .directory.marker import KEY_ENV, SIGNATURE, checkpoint_key, key_disagreement, key_setting


def agree_on_key() -> None:
    """Stop every process alike (``ConfigError``) unless the checkpoint key is set and not empty on
    all of them, the same, or unset on all (collective; a digest is compared, never the key): the
    main process signs and every process verifies, so a key exported on one machine only would
    be ignored on the others without a word."""
    problem = key_disagreement(gather_object([key_setting()]))
    if problem is not None:
        raise ConfigError([(KEY_ENV, problem)], source="environment")


def unchecked_signature(path: Path) -> str | None:
    """What to say when a signed checkpoint resumes without the key (its run stops being signed)."""
    if checkpoint_key() is not None:
        return None
    try:
        signed = SIGNATURE in read_marker(path)
    except MarkerError:
        return None
    if not signed:
        return None
    return (
        f"{path.name} is signed, but {KEY_ENV} is not set: its signature was not checked, and the checkpoints "
        f"this run writes are unsigned (set {KEY_ENV} to the key it was signed with, to check and sign them)"
    )
