"""Whether the machines of a run share its output directory, and what to do when they do not.

Checkpoints are committed by the main process from every process's files (it hashes them all), and
``final/`` is written by the main process alone: on a directory that is local to each machine, the
other machines' files would silently be missing. So at start the main process writes a probe file
with a random token there, and one process per machine (its local main process) looks for it. One
broadcast and one gather, at start only; the probe is removed before anything else is written.

A machine that cannot see it stops the run with a ``ConfigError`` on every process, unless the run
has a bucket (``ENV.OUTPUT.BUCKET``): then every machine keeps its own processes' files on its own
disk and the bucket is where a checkpoint comes together (``checkpoint.bucket.node_parts``; node-local mode).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from ..config import ConfigError

KEY = "ENV.OUTPUT.BASE_DIR"
PROBE_PREFIX = ".node-probe-"
# A file another machine has just created can be hidden for a moment by a network filesystem's
# caches (NFS caches that a name was absent); the directory is listed again before each retry.
RETRY_DELAYS_S = (0.1, 0.3, 0.6)


@dataclass(frozen=True)
class NodeLayout:
    """Where this process's machine stands. ``node_local``: the machines do not share the output
    directory (each writes its own processes' files, the bucket joins them); ``node``: this
    machine's index among the run's machines (in rank order of their local main processes);
    ``nodes``: how many machines the run has; ``attempt``: this start of the run (the parts of a
    checkpoint in the bucket must come from one start)."""

    node_local: bool = False
    node: int = 0
    nodes: int = 1
    attempt: str = ""  # this start, the same on every process (node-local mode)


SHARED = NodeLayout()


def check_shared_output(accelerator: Accelerator, directory: Path, bucket: bool = False) -> NodeLayout:
    """Collective: whether every machine of the run sees ``directory`` as the main process does (not
    on a different disk, nor a relative path resolved in a different working directory). A machine
    that does not raises ``ConfigError`` on every process, unless ``bucket``: then the run goes on
    in node-local mode, provided no other machine shares the main process's directory (a mix would
    have two machines commit one directory). Called once the main process has claimed the
    directory."""
    if accelerator.num_processes == 1:
        return SHARED
    host = socket.gethostname()
    written = (*_write_probe(directory), bucket) if accelerator.is_main_process else None
    # The main process's bucket decides (one given through the Python API exists there).
    token, error, where, bucket = broadcast_object_list(
        [written or (None, None, None, False)], from_process=0
    )[0]
    if error is not None:
        raise ConfigError([(KEY, f"cannot write to the run directory {directory}: {error}")])
    sees = _sees_probe(directory, token) if accelerator.is_local_main_process else None
    try:
        answers = gather_object([(accelerator.process_index, host, sees)])
    finally:
        if accelerator.is_main_process:
            with contextlib.suppress(OSError):
                (directory / f"{PROBE_PREFIX}{token}").unlink()
    blind = [(rank, at) for rank, at, seen in answers if seen is False]
    if not blind:
        return SHARED
    if not bucket:
        raise ConfigError([(KEY, _message(directory, where, blind, main_host=answers[0][1]))])
    nodes = [rank for rank, _, seen in answers if seen is not None]  # one local main per machine
    sharing = [(rank, at) for rank, at, seen in answers if seen is True and rank != 0]
    if sharing:
        who = ", ".join(f"rank {rank} on host {at}" for rank, at in sharing)
        raise ConfigError([(KEY, f"{directory} is shared by some of the run's machines ({who} with rank 0) "
                                 "but not by others: with a bucket, give every machine a directory of its "
                                 "own (a local disk), or put it on a filesystem all of them mount")])  # fmt: skip
    # Launchers number the processes of a machine contiguously, its local main process first.
    node = sum(1 for rank in nodes if rank <= accelerator.process_index) - 1
    return NodeLayout(node_local=True, node=node, nodes=len(nodes), attempt=token)


def _write_probe(directory: Path) -> tuple[str | None, str | None, str]:
    """Main process: (the probe's token, None, the directory's absolute path here), or (None, why it
    cannot be written, the path). Probes left by a run killed during this check are removed first."""
    where = str(directory.resolve())
    token = secrets.token_hex(16)
    try:
        for stale in directory.glob(f"{PROBE_PREFIX}*"):
            stale.unlink(missing_ok=True)
        fd = os.open(directory / f"{PROBE_PREFIX}{token}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, token.encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)  # closed before the others look: NFS's close-to-open consistency
    except OSError as e:
        return None, e.strerror or str(e), where
    return token, None, where


def _sees_probe(directory: Path, token: str) -> bool:
    probe = directory / f"{PROBE_PREFIX}{token}"
    for delay in (*RETRY_DELAYS_S, None):
        try:
            if probe.read_text(encoding="ascii") == token:
                return True
        except (OSError, UnicodeDecodeError):
            pass
        if delay is None:
            return False
        time.sleep(delay)
        for level in (directory.parent, directory):  # revalidates a network filesystem's cached lookups
            with contextlib.suppress(OSError):
                os.listdir(level)
    return False


def _message(directory: Path, main_path: str, blind: list[tuple[int, str]], main_host: str) -> str:
    where = str(directory) if directory.is_absolute() else f"{directory} ({main_path} on rank 0)"
    who = ", ".join(f"rank {rank} on host {host}" for rank, host in blind)
    return (
        f"{where} is not shared between the run's machines: the process{'' if len(blind) == 1 else 'es'} "
        f"of {who} cannot see a file written there by rank 0 on host {main_host}. Checkpoints and final "
        "weights are committed by rank 0 from every process's files: put the output directory on a "
        "filesystem every node mounts (NFS, Lustre, a cloud filestore), or set ENV.OUTPUT.BUCKET.URL "
        "(s3://, gs://, b2://) for each node to keep its files on its own disk and meet in the bucket"
    )
