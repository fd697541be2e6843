"""Crash-safe checkpoint storage: atomic commit with a verified manifest, and retention.

``store`` knows directories and files only (no Accelerate): the trainer saves into
``CheckpointStore.staging_dir`` and then calls ``commit``. See ``store`` for the commit protocol.
"""

from ...digests import EarlySeal, EarlyWriteback, file_digest
from .marker import MARKER, MarkerError, read_marker
from .retention import Mode, retained
from .store import CheckpointStore, step_name

__all__ = [
    "MARKER",
    "CheckpointStore",
    "EarlySeal",
    "EarlyWriteback",
    "MarkerError",
    "Mode",
    "file_digest",
    "read_marker",
    "retained",
    "step_name",
]
