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
written by a holder of the key (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from .digests import DIGESTS

MARKER = "COMMITTED.json"
MARKER_VERSION = 1
MARKER_TMP = ".COMMITTED.json.tmp"
KEY_ENV = "LINNAEUS_CHECKPOINT_KEY"
SIGNATURE = "hmac_sha256"


class MarkerError(ValueError):
    """COMMITTED.json is missing, unreadable or malformed; the message says which."""


def read_marker(path: Path) -> dict[str, Any]:
    """The validated contents of ``path/COMMITTED.json`` (plain JSON; for verify and remote sync)."""
    marker = Path(path) / MARKER
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MarkerError(f"{MARKER} missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
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
    """The key checkpoints are signed and verified with, from the environment (None: unsigned)."""
    key = os.environ.get(KEY_ENV, "")
    return key.encode("utf-8") if key else None


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
