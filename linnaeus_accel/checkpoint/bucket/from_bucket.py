"""Node-local mode at start: the newest checkpoint complete in the bucket, made whole on every
machine's own disk before anything is loaded (``checkpoint.bucket.node_parts`` says how it got there).

The main process picks the step (the newest whose marker is in the bucket and, with a checkpoint
key, signed by it) and every machine's local main process completes its local copy: the files its
disk already holds with the manifest's size and digest are kept (the machine's own part of it), the
others are downloaded, checked against the manifest, and the marker is written last. The other
processes of a machine wait for it. A machine that lost its disk, or a new set of machines,
downloads the whole checkpoint; the normal resume then verifies and loads it like any other. Parts
newer than that step are uploads that never completed: they are removed, as they can never be
resumed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from ...digests import DIGEST, hash_file
from ...durable_files import fsync_directory, write_durably
from ..directory import MARKER, CheckpointStore
from ..directory.marker import MarkerError, checkpoint_key, parse_marker, read_marker, signature_problem
from ..directory.store import node_part
from ..resume.find import ResumeRefused

log = logging.getLogger(__name__)

KEY = "ENV.OUTPUT.BUCKET.URL"
PARTS = ".parts/"
CANDIDATES = 3  # complete steps tried, newest first, before the run refuses to start


def complete_from_bucket(accelerator: Accelerator, store: CheckpointStore, remote: Any) -> int | None:
    """Collective: make the newest complete checkpoint of the bucket whole on every machine's disk;
    its step, or None when the bucket holds none (a fresh start). ``remote``: the bucket, on every
    local main process. A checkpoint that a machine cannot complete (a download that keeps failing,
    a file whose digest differs) is passed over for the one before it, on every machine alike."""
    steps: list[tuple[int, bytes]] = []
    if accelerator.is_main_process:
        steps = _complete_steps(remote)
    steps = broadcast_object_list([steps], from_process=0)[0]
    problems: list[str] = []
    for step, raw in steps:
        error = None
        if accelerator.is_local_main_process:
            try:
                materialize(store, remote, step, raw)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in gather_object([error]) if e]
        if not errors:
            if accelerator.is_local_main_process:
                _remove_parts(store, after=step)
            accelerator.wait_for_everyone()
            return step
        problems.append(f"step {step}: {errors[0]}")
        log.warning("checkpoint step %d from the bucket could not be completed here: %s", step, errors[0])
    if problems:
        raise ResumeRefused([(KEY, "no complete checkpoint of the bucket could be made whole on every machine: "
                                   + "; ".join(problems))])  # fmt: skip
    if accelerator.is_local_main_process:
        _remove_parts(store, after=-1)
    accelerator.wait_for_everyone()
    return None


def _complete_steps(remote: Any) -> list[tuple[int, bytes]]:
    """Main process: up to ``CANDIDATES`` (step, marker bytes) of the bucket's complete
    checkpoints, newest first; a marker that does not parse, is a machine's part, or is not signed
    with the checkpoint key is skipped with a warning."""
    key, found = checkpoint_key(), []
    for step in reversed(remote.complete_steps()):
        raw = remote.get_bytes(step, MARKER)
        try:
            marker = parse_marker(raw) if raw is not None else None
        except MarkerError as exc:
            log.warning("skipping step %d in the bucket: %s", step, exc)
            continue
        problem = "no marker" if marker is None else (signature_problem(marker, key) or node_part(marker))
        if problem is not None or marker is None or marker["step"] != step:
            log.warning("skipping step %d in the bucket: %s", step, problem or "its marker is another step's")
            continue
        found.append((step, raw))
        if len(found) == CANDIDATES:
            break
    return found


def materialize(store: CheckpointStore, remote: Any, step: int, raw: bytes) -> Path:
    """This machine's local main process: ``checkpoints/step_XXXXXXXX`` holding every file of the
    bucket's checkpoint ``step`` (whose marker is ``raw``), built aside and renamed into place."""
    marker = parse_marker(raw)
    final = store.final_path(step)
    if (final / MARKER).is_file() and (final / MARKER).read_bytes() == raw:
        return final  # whole here already (the main process's deep verification follows)
    entries = {str(entry["path"]): entry for entry in marker["files"]}
    listed = remote.list_files(step)
    absent = sorted(set(entries) - set(listed))
    if absent:
        raise FileNotFoundError(f"the bucket lacks {', '.join(absent[:3])} of its checkpoint")
    store.root.mkdir(parents=True, exist_ok=True)
    for stale in store.root.glob(f".download-{final.name}-*"):  # a download killed earlier
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".download-{final.name}-", dir=store.root))
    try:
        wanted = sorted(rel for rel in listed if rel != MARKER and not rel.startswith(PARTS))
        fetch = [rel for rel in wanted if not _reuse(final, tmp, rel, entries.get(rel))]
        remote.download_files(step, fetch, tmp)
        for rel in fetch:
            entry = entries.get(rel)
            if (
                entry is not None
                and hash_file(tmp / rel, sync=False, algorithm=_algorithm(entry))[1]
                != entry[_algorithm(entry)]
            ):
                raise ValueError(f"{rel} from the bucket does not match its checkpoint's manifest")
        write_durably(tmp / MARKER, tmp / f".{MARKER}.tmp", raw)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_directory(store.root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kept = len(wanted) - len(fetch)
    log.info(
        "checkpoint step %d made whole from the bucket: %d files downloaded, %d kept", step, len(fetch), kept
    )
    return final


def _reuse(final: Path, tmp: Path, rel: str, entry: dict[str, Any] | None) -> bool:
    """Link this machine's own copy of ``rel`` into ``tmp`` if it has the manifest's size and digest."""
    if entry is None or ".." in PurePosixPath(rel).parts:
        return False
    local = final / rel
    try:
        if not local.is_file() or local.is_symlink() or local.stat().st_size != entry["size"]:
            return False
        if hash_file(local, sync=False, algorithm=_algorithm(entry))[1] != entry[_algorithm(entry)]:
            return False
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(local, tmp / rel)
    except OSError:
        return False
    return True


def _algorithm(entry: dict[str, Any]) -> str:
    return DIGEST if DIGEST in entry else "sha256"


def _remove_parts(store: CheckpointStore, after: int) -> None:
    """Remove this machine's parts of steps after ``after``: uploads that never completed."""
    for step, path in store.step_dirs():
        if step <= after:
            continue
        try:
            part = node_part(read_marker(path))
        except MarkerError:
            continue
        if part is not None:
            store.delete(step)
