"""The commit marker of a checkpoint, ``COMMITTED.json``: its format and its validating reader.

A checkpoint directory counts only once its marker exists and verifies: written last and atomically
by ``store.CheckpointStore.commit``, removed first by ``delete``. Plain JSON::

    {"version": 1, "step": 1234, "files": [{"path": ..., "size": ..., "xxh3_128": ...}], "info": {}}

Read by the store's verification and by the remote sync, which trusts nothing in it: every path
must stay inside the checkpoint.

Authenticated checkpoints: with a key in ``LINNAEUS_CHECKPOINT_KEY``, the marker also carries
``hmac_sha256``, an HMAC-SHA256 of the rest of the marker (its canonical JSON) under that key; and a
checkpoint is verified only if it carries a valid one. The digests say the files are those the
manifest lists, which whoever can write the files can rewrite; the HMAC says the manifest was
written by a holder of the key (docs/security.md). Set but empty, the variable is refused: a secret
that a job script failed to read would otherwise turn signing off without a word.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from ...digests import DIGESTS

MARKER = "COMMITTED.json"
MARKER_VERSION = 1
MARKER_TMP = ".COMMITTED.json.tmp"
KEY_ENV = "LINNAEUS_CHECKPOINT_KEY"
SIGNATURE = "hmac_sha256"
_AGREEMENT = b"linnaeus-accel: the processes of one run compare this, never the key"


class MarkerError(ValueError):
    """COMMITTED.json is missing, unreadable or malformed; the message says which."""


def read_marker(path: Path) -> dict[str, Any]:
    """The validated contents of ``path/COMMITTED.json`` (plain JSON; for verify and remote sync)."""
    marker = Path(path) / MARKER
    try:
        raw = marker.read_bytes()
    except FileNotFoundError:
        raise MarkerError(f"{MARKER} missing") from None
    except OSError as e:
        raise MarkerError(f"{MARKER} unreadable ({e})") from None
    return parse_marker(raw)


def parse_marker(raw: bytes) -> dict[str, Any]:
    """The validated contents of a marker's bytes (one read from a bucket as from a directory)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MarkerError(f"{MARKER} unreadable ({e})") from None
    if not isinstance(data, dict):
        raise MarkerError(f"{MARKER} is not a JSON object")
    if data.get("version") != MARKER_VERSION:
        raise MarkerError(f"{MARKER} version {data.get('version')!r} is not {MARKER_VERSION}")
    if type(data.get("step")) is not int:
        raise MarkerError(f"{MARKER} has no integer step")
    if not isinstance(data.get("files"), list) or not data["files"]:
        raise MarkerError(f"{MARKER} has no file list")
    for entry in data["files"]:
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("path"), str)
            or type(entry.get("size")) is not int
            or len(digests := [k for k in DIGESTS if k in entry]) != 1
            or not isinstance(entry[digests[0]], str)
        ):
            raise MarkerError(f"{MARKER} has a malformed file entry: {entry!r}"[:200])
        rel = PurePosixPath(entry["path"])
        # An untrusted manifest must not make us stat or hash files outside the checkpoint.
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or "\\" in entry["path"]:
            raise MarkerError(f"{MARKER} names a path outside the checkpoint: {entry['path']!r}")
    if SIGNATURE in data and not isinstance(data[SIGNATURE], str):
        raise MarkerError(f"{MARKER}: {SIGNATURE} is not a string")
    return data


def checkpoint_key() -> bytes | None:
    """The key checkpoints are signed and verified with, from the environment (None: unsigned).
    Set but empty reads as unset here: a run refuses it at start, on every process alike
    (``key_disagreement``), before any checkpoint is read or written."""
    key = os.environ.get(KEY_ENV)
    return key.encode("utf-8") if key else None


def key_setting() -> str | None:
    """What this process's key is, for comparing with the other processes of the run without
    sending it: None if unset, "" if set but empty, else an HMAC of a fixed text under the key."""
    key = os.environ.get(KEY_ENV)
    if not key:
        return key
    return hmac.new(key.encode("utf-8"), _AGREEMENT, hashlib.sha256).hexdigest()


def key_disagreement(settings: Sequence[str | None]) -> str | None:
    """Why the run cannot start with these ``key_setting``s of its processes (by process index):
    set but empty on one, or not the same on all (the main process signs, every process verifies:
    a key exported on one machine only would be ignored on the others); None if they agree."""
    if "" in settings:
        return _empty_key(f" on process {settings.index('')}" if len(settings) > 1 else "")
    other = next((i for i, s in enumerate(settings) if s != settings[0]), None)
    if other is None:
        return None
    if settings[0] is not None and settings[other] is not None:
        differ = f"processes 0 and {other} hold different keys"
    else:
        unset, has = (0, other) if settings[0] is None else (other, 0)
        differ = f"process {has} has it set and process {unset} does not: exported on one machine only?"
    return (
        f"{KEY_ENV} is not the same on every process of this run ({differ}): export the same key on "
        "every machine of the job, or unset it on all of them"
    )


def _empty_key(where: str) -> str:
    return (
        f"{KEY_ENV} is set but empty{where} (a secret the job script could not read?): set it to the key "
        "the run's checkpoints are signed with, or unset it for unsigned checkpoints"
    )


def signature(marker: Mapping[str, Any], key: bytes) -> str:
    """The HMAC-SHA256 of the marker without its signature, as canonical JSON."""
    body = {k: v for k, v in marker.items() if k != SIGNATURE}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def signature_problem(marker: Mapping[str, Any], key: bytes | None) -> str | None:
    """None if no key is set or the marker is signed with it; else what is wrong."""
    if key is None:
        return None
    given = marker.get(SIGNATURE)
    if given is None:
        return (
            f"{MARKER} is not signed, and {KEY_ENV} is set: it was written without the key (by another "
            "job, or by someone who does not hold it)"
        )
    if not hmac.compare_digest(str(given), signature(marker, key)):
        return f"{MARKER}'s signature does not match {KEY_ENV}: the manifest was not written with this key"
    return None
