"""Which process failed first, so that ``summary.json`` records the cause and not its echo.

When one process raises (a bug in a user's model on rank 1, a data error), it leaves the process
group and the others fail in their next collective with "Connection closed by peer" or a timeout.
Only the main process writes ``summary.json``, so it recorded its own echo and the cause was lost
(seen: rank 1's ``RuntimeError: boom at step 23`` recorded as rank 0's gloo error). Each failing
process therefore publishes its error in the process group's store (the rendezvous store every
process already reaches, across machines too) before it leaves; a process whose own error is only
a lost peer reads the others' and reports the first real cause, naming its rank.
"""

from __future__ import annotations

import json
import time

_KEY = "linnaeus_accel/failure"
# How long a process that only lost a peer waits for that peer's own error to be published (it is
# published before the peer leaves the group, so this covers a busy machine's scheduling only).
_WAIT_S = 3.0
_POLL_S = 0.1
# What torch's process groups raise in a process whose peer left or stopped answering (gloo's
# pair errors, NCCL's watchdog); a user's own error says none of these.
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "read error",
    "timed out waiting",
    "collective operation timeout",
    "remote process exited",
    "communicator was aborted",
)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a process group's report of another process gone or silent."""
    return isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in _PEER_LOST)


def first_failure(exc: BaseException, message: str) -> str:
    """Publish this process's failure and return what the run should record as its cause:
    ``message``, or, when ``exc`` only says a peer was lost, that peer's own published error
    ("process 1: RuntimeError: boom at step 23"). On one process, ``message``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return message
    rank, world = dist.get_rank(), dist.get_world_size()
    lost = is_peer_lost(exc)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_KEY}/{rank}", json.dumps({"error": message, "peer_lost": lost}))
    except Exception:  # the store went with the launcher: this process's message is all there is
        return message
    if not lost:
        return message
    others = [f"{_KEY}/{r}" for r in range(world) if r != rank]
    deadline = time.monotonic() + _WAIT_S
    while True:
        for key in others:
            try:
                if store.check([key]):
                    record = json.loads(store.get(key))
                    if not record["peer_lost"]:
                        peer = key.rsplit("/", 1)[1]
                        return f"process {peer}: {record['error']}"
            except Exception:
                # The store went with the machine that hosted it: nobody can publish there any
                # more (and each try would print torch's C++ warning with its stack).
                return message
        if time.monotonic() >= deadline:
            return message
        time.sleep(_POLL_S)


def lost_peer(exc: BaseException) -> str:
    """The one sentence for a process whose peers went away without saying why (their machine was
    killed, lost power or its network): which machine this is, which one it lost where that can be
    told, and what to do; gloo's own words, its peer's address included, in brackets."""
    import os
    import re

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    nodes, node = max(1, world // per_node), int(os.environ.get("GROUP_RANK", "0"))
    text = " ".join(str(exc).split())
    address = re.search(r"\[([0-9A-Za-z.:\-]+)\]:\d+", text)
    where = f" at {address.group(1)}" if address else ""
    if nodes == 2:
        other = f"machine {1 - node}{where}"
    elif nodes > 2:
        other = f"another machine{where}"
    else:
        other = f"another process{where}"
    detail = text if len(text) <= 200 else text[:200] + "..."
    return (
        f"lost {other}: it stopped answering without reporting an error (killed, out of memory, or its "
        f"network failed), so machine {node} of {nodes} stops too; rerun the job once every machine is "
        f"back and it resumes from the newest checkpoint ({detail})"
    )
