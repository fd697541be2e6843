"""The bucket as an operator whose only durable storage it is needs it (docs/guides/checkpoints.md,
"Sync checkpoints to a bucket"): from the first complete checkpoint on, it always holds one, and the
newest never goes back; each checkpoint's files go up once; a run waits for it only as long as
``ENV.OUTPUT.BUCKET.WAIT_S`` says, then exits 3 naming each checkpoint the bucket lacks, once; a rerun
uploads what an outage kept out and exits 0; a hostile key rejects its checkpoint; a slow link still
gets checkpoints there.

The store is moto's S3 server, reached only through a link the test breaks (``helpers.faulty_link``:
refused, black-holed, slowed), and its request log is the bucket's history: replaying it shows every
moment, not a listing's sample.
"""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from accelerate import Accelerator
from helpers.configs import CFG
from helpers.faulty_link import FaultyLink
from helpers.in_process import reset_accelerate, run_cli
from helpers.runs import TrainRun, wait_until
from helpers.s3_server import LoggedS3Server, direct_client, use_endpoint

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.checkpoint.bucket.from_bucket import complete_from_bucket
from linnaeus_accel.checkpoint.bucket.remote import RemoteCheckpoints
from linnaeus_accel.checkpoint.directory import MARKER, CheckpointStore, read_marker
from linnaeus_accel.checkpoint.directory.layout import JOURNAL_FILE
from linnaeus_accel.checkpoint.directory.store import step_name

pytestmark = pytest.mark.slow  # training runs against a real S3 endpoint

EXPERIMENT = "digits_default"  # configs/default.yaml's
# Epochs of 12 steps (1,438 images, batches of 128), a checkpoint and a validation at each epoch's end.
OPTS = [
    "DATA.BATCH_SIZE", "128",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1",
    "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0",
]  # fmt: skip
LINKS: dict[str, FaultyLink] = {}  # for the callback below, by name


@pytest.fixture(scope="module")
def server() -> Iterator[LoggedS3Server]:
    server = LoggedS3Server()
    yield server
    server.stop()


@pytest.fixture
def link(server: LoggedS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FaultyLink]:
    """The only way the code under test reaches the store: the AWS variables point at it."""
    link = FaultyLink(server.address)
    name = f"link-{uuid.uuid4().hex[:8]}"
    LINKS[name] = link
    link.name = name  # type: ignore[attr-defined]
    use_endpoint(monkeypatch, link.url, tmp_path)
    yield link
    LINKS.pop(name, None)
    link.close()


@pytest.fixture
def bucket(server: LoggedS3Server, link: FaultyLink) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    direct_client(server.url).create_bucket(Bucket=name)
    return name


def train(tmp_path: Path, bucket: str, *opts: str) -> tuple[int, str, str]:
    """``linnaeus-accel train`` on the default config, in this process, synced to ``bucket``."""
    reset_accelerate()
    try:
        return run_cli(
            "train", "--cfg", CFG, "--opts", *OPTS, "ENV.OUTPUT.BASE_DIR", str(tmp_path),
            "ENV.OUTPUT.BUCKET.URL", f"s3://{bucket}/team", *opts,
        )  # fmt: skip
    finally:
        reset_accelerate()


def prefix(bucket: str) -> str:
    return f"{bucket}/team/{EXPERIMENT}/checkpoints/"


def complete_in_bucket(server: LoggedS3Server, bucket: str) -> list[int]:
    """Steps whose marker is in the bucket, by boto3 straight to the server."""
    pages = direct_client(server.url).get_paginator("list_objects_v2").paginate(Bucket=bucket)
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    return sorted(int(k.split("/")[-2][5:]) for k in keys if k.endswith("/" + MARKER))


def summary(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / EXPERIMENT / "summary.json").read_text(encoding="utf-8"))


def local_steps(tmp_path: Path) -> list[int]:
    root = tmp_path / EXPERIMENT / "checkpoints"
    return sorted(int(p.parent.name[5:]) for p in root.glob(f"step_*/{MARKER}"))


def replay(
    log: list[tuple[str, str, str, int]], where: str, names: set[str]
) -> tuple[list[int], Counter[str]]:
    """Apply every successful write and delete under ``where`` to an empty bucket, in the server's
    order, checking after each one that a bucket that held a complete checkpoint (its marker and every
    file of its manifest, ``names``) still holds one, no older than before. The newest complete
    step after each change, and how often each object was written."""
    keys: set[str] = set()
    puts: Counter[str] = Counter()
    history: list[int] = []
    for method, key, query, status in log:
        if not key.startswith(where) or status >= 300:
            continue
        rel = key[len(where) :]
        if (method == "PUT" and "partNumber" not in query) or (method == "POST" and "uploadId" in query):
            keys.add(rel)
            puts[rel] += 1
        elif method == "DELETE" and "uploadId" not in query:
            keys.discard(rel)
        else:
            continue
        complete = [
            int(step[5:])
            for step in {k.split("/")[0] for k in keys}
            if {f"{step}/{n}" for n in names | {MARKER}} <= keys
        ]
        if history:
            assert complete, f"no complete checkpoint in the bucket after {method} {rel}"
            assert max(complete) >= history[-1], (
                f"the newest complete checkpoint went back after {method} {rel}"
            )
        if complete:
            history.append(max(complete))
    return history, puts


@pytest.mark.parametrize("keep_last", [1, 2])
def test_the_bucket_always_holds_a_whole_checkpoint_and_each_file_goes_up_once(
    tmp_path: Path, server: LoggedS3Server, bucket: str, keep_last: int
) -> None:
    rc, _, err = train(
        tmp_path, bucket, "TRAIN.EPOCHS", "4", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", str(keep_last)
    )
    assert rc == 0, err
    assert summary(tmp_path)["remote_sync_errors"] == []
    steps = local_steps(tmp_path)
    assert len(steps) == keep_last
    names = {
        entry["path"] for entry in read_marker(tmp_path / EXPERIMENT / "checkpoints" / step_name(48))["files"]
    }
    history, puts = replay(server.requests(), prefix(bucket), names)
    assert history[-1] == 48  # the last checkpoint is there, and it was never otherwise
    assert sorted(set(history)) == [12, 24, 36, 48]  # each checkpoint was the newest once
    for step in (12, 24, 36, 48):
        for name in names | {MARKER}:
            assert puts[f"{step_name(step)}/{name}"] == 1, (step, name, puts)
        # The journal grows after the commit (one validation pass here): at most twice.
        assert puts[f"{step_name(step)}/{JOURNAL_FILE}"] <= 2
    # Retention in the bucket followed the run's.
    assert complete_in_bucket(server, bucket) == steps


@register_callback("test_break_the_link")
class BreakTheLink(Callback):
    """At the first committed checkpoint: wait until it is whole in the bucket (seen past the link),
    then break the link (``mode``: refuse or blackhole)."""

    def __init__(self, link: str, mode: str, endpoint: str, bucket: str) -> None:
        self.link, self.mode, self.endpoint, self.bucket = link, mode, endpoint, bucket
        self.done = False

    def on_checkpoint(self, run: Any, step: int, path: Path) -> None:
        if self.done:
            return
        client, key = (
            direct_client(self.endpoint),
            f"team/{EXPERIMENT}/checkpoints/{step_name(step)}/{MARKER}",
        )
        deadline = time.monotonic() + 60
        while "Contents" not in client.list_objects_v2(Bucket=self.bucket, Prefix=key):
            assert time.monotonic() < deadline, f"{key} never reached the bucket"
            time.sleep(0.05)
        getattr(LINKS[self.link], self.mode)()
        self.done = True


@pytest.mark.parametrize("mode", ["refuse", "blackhole"])
def test_a_run_past_an_outage_exits_3_naming_each_checkpoint_once_and_its_rerun_catches_up(
    tmp_path: Path,
    server: LoggedS3Server,
    link: FaultyLink,
    bucket: str,
    mode: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    command = [
        "TRAIN.EPOCHS", "3", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0",
        "ENV.OUTPUT.BUCKET.WAIT_S", "4", "ENV.OUTPUT.BUCKET.TIMEOUT_S", "1",
        "CALLBACKS", f"[{{NAME: test_break_the_link, OPTIONS: {{link: {link.name}, mode: {mode}, "  # type: ignore[attr-defined]
        f"endpoint: '{server.url}', bucket: {bucket}}}}}]",
    ]  # fmt: skip
    started = time.monotonic()
    rc, _, err = train(tmp_path, bucket, *command)
    took = time.monotonic() - started
    assert rc == 3, err
    errors = summary(tmp_path)["remote_sync_errors"]
    # Each checkpoint the bucket lacks, once, and where it should be (the bucket held step 12 whole).
    assert [re.search(r"step_(\d+)", e).group(1) for e in errors] == ["00000024", "00000036"], errors  # type: ignore[union-attr]
    assert all(f"s3://{bucket}/team/{EXPERIMENT}/checkpoints" in e for e in errors), errors
    assert complete_in_bucket(server, bucket) == [12]
    # The end waited WAIT_S, not the 600 s (black hole) or the retries (refusals) it used to.
    assert took < 60, took
    line = next(line for line in err.splitlines() if "not uploaded to the bucket" in line)
    assert "step_00000024" in line, line
    assert "step_00000036" in line, line

    link.heal()  # the store is back: the same command again
    caplog.clear()
    rc, out, err = train(tmp_path, bucket, *command)
    assert rc == 0, err
    assert "nothing to do" in out
    assert "the bucket holds every checkpoint" in out, out
    said = caplog.text  # the package's warnings: on the console's stderr outside pytest
    line = next(line for line in said.splitlines() if "catching up" in line)
    # The newest first. (In this process the first run's abandoned upload of step 24 may have
    # finished once the link healed: a command-line run's process is gone by then.)
    assert re.search(r"uploading step_00000036(, step_00000024)? \(", line), line
    assert complete_in_bucket(server, bucket) == [12, 24, 36]
    assert summary(tmp_path)["remote_sync_errors"] == []
    caplog.clear()
    rc, _, err = train(tmp_path, bucket, *command)  # and again: nothing to upload, nothing stale
    assert rc == 0, err
    assert "catching up" not in caplog.text


def test_sigterm_with_a_black_holed_store_exits_3_within_the_bound(
    tmp_path: Path, server: LoggedS3Server, link: FaultyLink, bucket: str
) -> None:
    """A scheduler's SIGTERM while the store accepts connections and never answers: the run
    checkpoints, waits WAIT_S for the bucket and exits 3 naming every checkpoint it lacks."""
    wait_s = 3  # a few of the black-holed requests' TIMEOUT_S: the end waits for the bucket, not one request
    run = TrainRun(tmp_path, [
        *OPTS, "TRAIN.EPOCHS", "200", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0",
        "ENV.OUTPUT.BUCKET.URL", f"s3://{bucket}/team", "ENV.OUTPUT.BUCKET.WAIT_S", str(wait_s),
        "ENV.OUTPUT.BUCKET.TIMEOUT_S", "1",
    ])  # fmt: skip
    started = run.start()
    first = f"run/checkpoints/{step_name(12)}/{MARKER}"
    client = direct_client(server.url)
    wait_until(
        started,
        lambda: "Contents" in client.list_objects_v2(Bucket=bucket, Prefix=f"team/{first}"),
        "step 12 is in the bucket",
    )
    link.blackhole()
    wait_until(started, lambda: len(local_steps_of(run.dir)) >= 3, "two more checkpoints are committed")
    signalled = time.monotonic()
    started.proc.send_signal(signal.SIGTERM)
    result = started.finish(timeout=300)
    took = time.monotonic() - signalled
    assert result.returncode == 3, result.tail()
    done = json.loads((run.dir / "summary.json").read_text(encoding="utf-8"))
    assert done["status"] == "preempted"
    lacking = [s for s in local_steps_of(run.dir) if s != 12]
    named = [int(re.search(r"step_(\d+)", e).group(1)) for e in done["remote_sync_errors"]]  # type: ignore[union-attr]
    assert named == lacking, done["remote_sync_errors"]
    assert complete_in_bucket(server, bucket) == [12]
    # The wait for the bucket was WAIT_S; the rest is the checkpoint and the exit (600 s before).
    assert took < wait_s + 60, took
    assert "WAIT_S" in " ".join(done["remote_sync_errors"])


def local_steps_of(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (run_dir / "checkpoints").glob(f"step_*/{MARKER}"))


def test_a_hostile_key_rejects_its_checkpoint_and_a_fresh_machine_resumes_from_the_one_before(
    tmp_path: Path, server: LoggedS3Server, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    rc, _, err = train(
        tmp_path / "first", bucket, "TRAIN.EPOCHS", "3", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0"
    )
    assert rc == 0, err
    client = direct_client(server.url)
    hostile = f"team/{EXPERIMENT}/checkpoints/{step_name(36)}/../../escaped.txt"
    client.put_object(Bucket=bucket, Key=hostile, Body=b"written by anyone who can write the bucket")

    # Node-local mode's way in (each machine makes the bucket's newest checkpoint whole on its disk).
    reset_accelerate()
    try:
        store = CheckpointStore(tmp_path / "machine" / "checkpoints")
        remote = RemoteCheckpoints.from_url(f"s3://{bucket}/team", EXPERIMENT)
        assert complete_from_bucket(Accelerator(cpu=True), store, remote) == 24
    finally:
        reset_accelerate()
    assert store.complete_steps() == [24]
    assert "outside the checkpoint" in caplog.text

    rc, out, err = train(
        tmp_path / "fresh", bucket, "TRAIN.EPOCHS", "3", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0"
    )
    assert rc == 0, err
    assert "Traceback" not in err
    assert re.search(r"resum\w+ .*step 24\b", out + err), out + err
    said = " ".join(line for line in (out + err + caplog.text).splitlines() if "step_00000036" in line)
    assert "outside the checkpoint" in said, out + err
    assert not (tmp_path / "escaped.txt").exists()
    assert not (tmp_path / "fresh" / "escaped.txt").exists()
    # The run saved step 36 again: the bucket's copy is whole and holds only its own files.
    keys = [i["Key"] for i in client.list_objects_v2(Bucket=bucket, Prefix=f"team/{EXPERIMENT}/")["Contents"]]
    assert hostile not in keys
    assert complete_in_bucket(server, bucket) == [12, 24, 36]


def test_on_a_link_slower_than_the_checkpoints_the_bucket_still_gets_them(
    tmp_path: Path, server: LoggedS3Server, link: FaultyLink, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each checkpoint (~1.5 MB) takes ~3 s to upload, a checkpoint comes every epoch (well under
    a second): with KEEP_LAST_N 1, retention keeps the one being uploaded until it is there, says
    which uploads it skips, and the bucket ends with the last checkpoint."""
    link.slow(500_000)
    rc, _, err = train(tmp_path, bucket, "TRAIN.EPOCHS", "8", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "1")
    assert rc == 0, err
    assert summary(tmp_path)["remote_sync_errors"] == []
    marked = sorted(
        int(key.split("/")[-2][5:])
        for method, key, _, status in server.requests()
        if method == "PUT" and key.startswith(prefix(bucket)) and key.endswith("/" + MARKER) and status == 200
    )
    assert marked[0] == 12, marked  # the first and the last, at least
    assert marked[-1] == 96, marked
    assert 2 <= len(marked) < 8, marked  # some skipped to keep up
    skipped = [s for s in range(12, 96, 12) if s not in marked]
    line = next(line for line in caplog.text.splitlines() if "falling behind" in line)
    assert any(step_name(s) in line for s in skipped), line
    assert local_steps(tmp_path) == [96]  # and the disk holds what retention keeps once it is up
    assert complete_in_bucket(server, bucket) == [96]
