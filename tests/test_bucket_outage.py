"""The store stops answering mid-run: training goes on to the end, and the run says which
checkpoints did not reach the bucket (summary.json's ``remote_sync_errors``; the command line
exits 3 for them).

The outage is real, not a mock: a moto S3 server of the test's own on localhost, reached through
the standard AWS variables, is stopped once the first checkpoint is in it, so every later request
is a refused connection, as when an endpoint goes down. The command-line variant loses the bucket
itself instead (deleted mid-run: every upload is refused at once), because the command line takes
no retry policy and the default one waits about 15 s on each file an outage refuses.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import CFG, DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from helpers.s3_server import object_keys, s3_bucket_fixture, s3_client, s3_server_fixture, use_endpoint  # noqa: F401

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.checkpoint.bucket.remote import RemoteCheckpoints, RetryPolicy
from linnaeus_accel.checkpoint.directory import MARKER
from linnaeus_accel.checkpoint.directory.layout import JOURNAL_FILE
from linnaeus_accel.checkpoint.directory.store import step_name
from linnaeus_accel.cli import EXIT_NOT_SYNCED
from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.training.trainer import Trainer

EXPERIMENT = "digits_default"  # configs/default.yaml's EXPERIMENT.NAME
# Three epochs of 12 steps (1,438 images, batches of 128), a checkpoint at each epoch's end, all kept.
OPTS = [
    "TRAIN.EPOCHS", "3",
    "DATA.BATCH_SIZE", "128",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "0",
    "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0",
]  # fmt: skip
STEPS = [12, 24, 36]

pytestmark = pytest.mark.slow  # full training runs, as in test_remote_trainer


def _wait_for_marker(bucket: str, prefix: str, step: int) -> list[str]:
    """Every key of the bucket, in the first listing that holds ``step``'s marker (uploaded last:
    that listing shows what the bucket held once the checkpoint was complete)."""
    marker = f"{prefix}/{step_name(step)}/{MARKER}"
    deadline = time.monotonic() + 60
    while marker not in (keys := object_keys(bucket)):
        assert time.monotonic() < deadline, f"{marker} never reached the bucket"
        time.sleep(0.05)
    return keys


class StopTheStore(Callback):
    """At the first committed checkpoint: wait until it is in the bucket, then stop the server."""

    def __init__(self, server: Any, bucket: str, prefix: str) -> None:
        self.server, self.bucket, self.prefix = server, bucket, prefix
        self.stopped_after: int | None = None
        self.held: list[str] = []  # the bucket's keys just before the outage

    def on_checkpoint(self, run: Any, step: int, path: Path) -> None:
        if self.stopped_after is None:
            self.held = _wait_for_marker(self.bucket, self.prefix, step)
            self.server.stop()
            self.stopped_after = step


@dataclass
class Outage:
    summary: dict[str, Any]
    run: Path  # the run's output directory
    bucket: str
    stop: StopTheStore


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Outage:
    """One run through an outage, for the tests below: a moto S3 server of its own (stopped
    mid-run), the AWS variables pointing at it, a new bucket on it, and three epochs trained by the
    Trainer with checkpoints synced there, retried twice without waiting (the test stays fast)."""
    from moto.server import ThreadedMotoServer

    tmp = tmp_path_factory.mktemp("outage")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            host, port = server.get_host_and_port()
            use_endpoint(monkeypatch, f"http://{host}:{port}", tmp)
            bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
            s3_client().create_bucket(Bucket=bucket)
            fast = RetryPolicy(attempts=2, base_delay=0.0, max_delay=0.0)
            remote = RemoteCheckpoints.from_url(f"s3://{bucket}/team", EXPERIMENT, retry=fast)
            stop = StopTheStore(server, bucket, f"team/{EXPERIMENT}/checkpoints")
            reset_accelerate()
            try:
                config = load_config(DEFAULT_CONFIG, [*OPTS, "ENV.OUTPUT.BASE_DIR", str(tmp)])
                train, val = build_dataset(config, "train"), build_dataset(config, "val")
                torch.manual_seed(0)
                model = build_model(config, train)
                summary = Trainer(config, model, train, val, remote=remote, callbacks=[stop]).fit()
            finally:
                reset_accelerate()
    finally:
        server.stop()  # a second stop is harmless
    return Outage(summary, tmp / EXPERIMENT, bucket, stop)


def test_training_outlives_the_store_and_names_what_did_not_reach_it(outage: Outage) -> None:
    summary, run = outage.summary, outage.run
    # Training never waited on the bucket: every step ran, every checkpoint is committed locally.
    assert summary["status"] == "completed"
    assert summary["global_step"] == STEPS[-1]
    assert (run / "final" / "model.safetensors").is_file()
    for step in STEPS:
        assert (run / "checkpoints" / step_name(step) / MARKER).is_file(), step
    # Before the outage, the bucket held the first checkpoint whole: every file of the local one.
    # (Its validation journal, outside the manifest, is uploaded again once it grows; that upload
    # may come before or after the outage.)
    assert outage.stop.stopped_after == STEPS[0]
    first = run / "checkpoints" / step_name(STEPS[0])
    prefix = f"team/{EXPERIMENT}/checkpoints/{step_name(STEPS[0])}/"
    held = {k[len(prefix) :] for k in outage.stop.held if k.startswith(prefix)}
    local = {p.relative_to(first).as_posix() for p in first.rglob("*") if p.is_file()}
    assert held - {JOURNAL_FILE} == local - {JOURNAL_FILE}
    # After it, the run says which checkpoints are missing from the bucket, and where it is.
    errors = summary["remote_sync_errors"]
    for step in STEPS[1:]:
        assert any(step_name(step) in e for e in errors), (step, errors)
    assert all(f"s3://{outage.bucket}/team/{EXPERIMENT}/checkpoints/" in e for e in errors), errors
    on_disk = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    assert on_disk["remote_sync_errors"] == errors


def test_uploads_during_the_outage_were_retried_and_say_why_they_failed(outage: Outage) -> None:
    """A refused connection is worth a wait (RetryPolicy): each failed transfer was tried as often
    as the policy says, and its error names the endpoint that could not be reached."""
    errors = outage.summary["remote_sync_errors"]
    assert errors
    for error in errors:
        assert "failed after 2 attempts: EndpointConnectionError: Could not connect to the endpoint" in error


@register_callback("test_delete_the_bucket")
class DeleteTheBucket(Callback):
    """At the first committed checkpoint: wait until it is in the bucket, then delete the bucket
    (its objects first, as S3 requires)."""

    def __init__(self, bucket: str, prefix: str) -> None:
        self.bucket, self.prefix = bucket, prefix
        self.done = False

    def on_checkpoint(self, run: Any, step: int, path: Path) -> None:
        if not self.done:
            from botocore.exceptions import ClientError

            client = s3_client()
            keys = _wait_for_marker(self.bucket, self.prefix, step)
            # The run's uploader goes on meanwhile (the validation journal is uploaded again once
            # it grows), so an object may land between the listing and the delete: list again
            # until S3 takes the bucket's deletion.
            for _ in range(50):
                for key in keys:
                    client.delete_object(Bucket=self.bucket, Key=key)
                try:
                    client.delete_bucket(Bucket=self.bucket)
                    break
                except ClientError as error:
                    if error.response.get("Error", {}).get("Code") != "BucketNotEmpty":
                        raise
                keys = object_keys(self.bucket)
            else:
                raise AssertionError(f"{self.bucket} could not be emptied and deleted")
            self.done = True


def test_the_command_line_exits_3_when_checkpoints_did_not_reach_the_bucket(
    tmp_path: Path, s3_bucket: str
) -> None:
    callback = (
        f"[{{NAME: test_delete_the_bucket, OPTIONS: {{bucket: {s3_bucket}, "
        f"prefix: team/{EXPERIMENT}/checkpoints}}}}]"
    )
    reset_accelerate()
    try:
        rc, _, err = run_cli(
            "train", "--cfg", CFG, "--opts", *OPTS,
            "ENV.OUTPUT.BASE_DIR", str(tmp_path),
            "ENV.OUTPUT.BUCKET.URL", f"s3://{s3_bucket}/team",
            "CALLBACKS", callback,
        )  # fmt: skip
    finally:
        reset_accelerate()
    assert rc == EXIT_NOT_SYNCED == 3, err
    line = next(line for line in err.splitlines() if "not uploaded to the bucket" in line)
    for step in STEPS[1:]:
        assert step_name(step) in line, line
    summary = json.loads((tmp_path / EXPERIMENT / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "completed"
    assert summary["global_step"] == STEPS[-1]
    assert summary["remote_sync_errors"]
