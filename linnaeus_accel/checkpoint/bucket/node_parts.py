"""Node-local mode: a checkpoint of a run whose machines keep their files on their own disks comes
together in the bucket (docs/guides/multi-node.md).

Every machine's local main process commits its machine's processes' files as a *part* (a directory
whose marker says which machine's: never a resume point, ``checkpoint.directory.store.node_part``) and, on its
upload thread, sends them to ``<bucket>/.../step_XXXXXXXX/`` followed by a record of the part
(``.parts/node_NNNN.json``: the files' sizes and digests, and the start the run's processes agreed
on). The main process then waits for every machine's record of this start, merges them into the
checkpoint's manifest, and writes the commit marker, last: a checkpoint in the bucket has its marker
only once every file of every process is there, whatever moment a machine died at. Training never
waits for any of it; what failed is in ``summary.json``'s ``remote_sync_errors``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...process.faults import fault_point
from ..directory.marker import MARKER, MARKER_VERSION, SIGNATURE, checkpoint_key, read_marker, signature

log = logging.getLogger(__name__)

PARTS = ".parts"
POLL_S = 0.5


def part_record(node: int) -> str:
    return f"{PARTS}/node_{node:04d}.json"


def upload_part(remote: Any, local: Path, node: int, attempt: str) -> bool:
    """Upload this machine's committed part at ``local``: its marker goes first (a checkpoint being
    replaced stops counting at once), then its files, then the record of the part. False when
    retention removed the part meanwhile (a newer one supersedes it)."""
    marker = read_marker(local)
    step = int(marker["step"])
    try:
        if MARKER in remote.list_files(step):  # a step saved again (a run resumed before it)
            remote.delete_files(step, [MARKER])
        for file in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MARKER):
            remote.upload_file(step, file.relative_to(local).as_posix(), file)
    except Exception as exc:
        # Said in the record, so that the main process stops waiting for this part, and why.
        if not (local / MARKER).is_file():  # retention removed it meanwhile: a newer one supersedes it
            record = {"node": node, "attempt": attempt, "superseded": True}
            remote.put_bytes(step, part_record(node), json.dumps(record).encode("utf-8"))
            log.warning("stopped the upload of %s: retention removed it meanwhile", local)
            return False
        failed = {"node": node, "attempt": attempt, "failed": f"{type(exc).__name__}: {exc}"}
        remote.put_bytes(step, part_record(node), json.dumps(failed).encode("utf-8"))
        raise
    fault_point("part_uploaded")  # tests: a machine killed with its files there but not its record
    record = {"node": node, "attempt": attempt, "files": marker["files"]}
    remote.put_bytes(step, part_record(node), json.dumps(record).encode("utf-8"))
    return True


def seal(
    remote: Any,
    step: int,
    nodes: int,
    attempt: str,
    timeout_s: float,
    stop: Callable[[], bool] = lambda: False,
) -> bool:
    """Main process, after its own part: wait (up to ``timeout_s``, or until ``stop()``: the run
    failed) for the record of every machine's part of ``step`` from this start, then write the
    marker of the whole checkpoint. False when a machine's part was superseded (retention removed
    it before it was uploaded): the step is not completed in the bucket, a newer one will be."""
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict[str, Any]] = {}
    while True:
        for node in range(nodes):
            if node not in records and (record := _record(remote, step, node, attempt)) is not None:
                records[node] = record
        missing = [node for node in range(nodes) if node not in records]
        failed = [f"machine {n}: {records[n]['failed']}" for n in sorted(records) if "failed" in records[n]]
        if failed:
            raise RuntimeError(f"step {step}: not complete in {remote.url}: " + "; ".join(failed))
        if any(records[n].get("superseded") for n in records):
            log.warning(
                "step %d is not completed in %s: retention removed a part of it first", step, remote.url
            )
            return False
        if not missing:
            break
        if time.monotonic() > deadline or stop():
            which = f"machine{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            when = "before the run failed" if stop() else f"within {timeout_s:.0f} s"
            raise TimeoutError(
                f"step {step}: the files of {which} did not reach {remote.url} {when}; the checkpoint "
                "is not complete there (the previous complete one stays the bucket's resume point)"
            )
        time.sleep(POLL_S)
    files: dict[str, dict[str, Any]] = {}
    for node in sorted(records):
        for entry in records[node]["files"]:
            known = files.setdefault(entry["path"], entry)
            if known != entry:  # two machines wrote one name: no marker may vouch for either
                raise ValueError(f"step {step}: machines wrote different files named {entry['path']}")
    marker: dict[str, Any] = {
        "version": MARKER_VERSION,
        "step": step,
        "files": [files[path] for path in sorted(files)],
        "info": {"global_step": step, "nodes": nodes},
    }
    key = checkpoint_key()
    if key is not None:
        marker[SIGNATURE] = signature(marker, key)
    remote.put_bytes(step, MARKER, json.dumps(marker, indent=1).encode("utf-8"))
    fault_point("bucket_sealed")  # tests: killed once a checkpoint is whole in the bucket
    return True


def _record(remote: Any, step: int, node: int, attempt: str) -> dict[str, Any] | None:
    """The record of machine ``node``'s part of ``step`` written by this start (an older start's,
    left by a run that resumed before it, is not this checkpoint's), or None."""
    raw = remote.get_bytes(step, part_record(node))
    if raw is None:
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or record.get("attempt") != attempt:
        return None
    if not (
        isinstance(record.get("files"), list)
        or isinstance(record.get("failed"), str)
        or record.get("superseded")
    ):
        return None
    return record
