"""B2 checkpoint sync against b2sdk's own in-memory backend (`RawSimulator`): no network.

The simulator is subclassed only to inject faults (failing or slow uploads, failing downloads) and to
record the order of deletions; everything else is b2sdk's code path.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from b2sdk.v2 import B2Api, B2HttpApiConfig, InMemoryAccountInfo, RawSimulator
from b2sdk.v2.exception import ServiceError
from helpers.checkpoints import make_checkpoint, tree

from linnaeus_accel.checkpoint.bucket.remote import (
    KEY_ID_VAR,
    KEY_VAR,
    RemoteCheckpoints,
    RemoteSyncError,
    RetryPolicy,
)
from linnaeus_accel.checkpoint.bucket.uploader import BackgroundUploader
from linnaeus_accel.checkpoint.directory import MARKER

BUCKET = "linnaeus-test"
FAST = RetryPolicy(attempts=2, base_delay=0.0, max_delay=0.0)


class FaultySimulator(RawSimulator):  # type: ignore[misc]
    """RawSimulator plus fault injection: uploads/downloads whose name ends with a key of `fail_*`
    fail that many times (-1: always); `upload_delay` slows every small-file upload."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_uploads: dict[str, int] = {}
        self.fail_downloads: dict[str, int] = {}
        self.upload_delay = 0.0
        self.deleted: list[str] = []
        # (name suffix, local directory): the directory is deleted once that file is uploaded, as
        # local retention may do while the background uploader works.
        self.remove_after_upload: tuple[str, Path] | None = None

    @staticmethod
    def _should_fail(faults: dict[str, int], name: str) -> bool:
        for suffix, left in faults.items():
            if name.endswith(suffix) and left != 0:
                faults[suffix] = left - 1
                return True
        return False

    def upload_file(self, upload_url: str, upload_auth_token: str, file_name: str, *a: Any, **k: Any) -> Any:
        time.sleep(self.upload_delay)
        if self._should_fail(self.fail_uploads, file_name):
            raise ServiceError("injected upload failure")
        result = super().upload_file(upload_url, upload_auth_token, file_name, *a, **k)
        if self.remove_after_upload is not None and file_name.endswith(self.remove_after_upload[0]):
            shutil.rmtree(self.remove_after_upload[1])
        return result

    def download_file_from_url(self, token: Any, url: str, *a: Any, **k: Any) -> Any:
        if self._should_fail(self.fail_downloads, url):
            raise ServiceError("injected download failure")
        return super().download_file_from_url(token, url, *a, **k)

    def delete_file_version(self, api_url: str, token: str, file_id: str, file_name: str, *a: Any) -> Any:
        self.deleted.append(file_name)
        return super().delete_file_version(api_url, token, file_id, file_name, *a)


@pytest.fixture
def b2(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FaultySimulator, Any]:
    """(api, simulator, application key): an account with a bucket and a key in the environment,
    set up the way b2sdk's own tests do it."""
    api = B2Api(InMemoryAccountInfo(), api_config=B2HttpApiConfig(_raw_api_class=FaultySimulator))
    sim = api.session.raw_api
    account_id, master_key = sim.create_account()
    api.authorize_account("production", account_id, master_key)
    api.create_bucket(BUCKET, "allPrivate")
    # Not restricted to the bucket: the simulator's list_unfinished_large_files (used by every
    # large-file upload) checks bucket restrictions without passing the bucket and always refuses.
    caps = ["listBuckets", "listFiles", "readFiles", "writeFiles", "deleteFiles"]
    key = api.create_key(caps, "linnaeus-accel")
    monkeypatch.setenv(KEY_ID_VAR, key.id_)
    monkeypatch.setenv(KEY_VAR, key.application_key)
    return api, sim, key


def remote_for(api: Any, retry: RetryPolicy = FAST) -> RemoteCheckpoints:
    return RemoteCheckpoints.from_environment(BUCKET, "runs/", "exp1", api=api, retry=retry)


def b2_checkpoint(output_dir: Path, step: int, *, marker: bool = True) -> Path:
    # 5000 bytes takes b2sdk's large-file (multi-part) path: the simulator's part size is 200 bytes.
    return make_checkpoint(output_dir, step, marker=marker, model_bytes=5000)


def test_upload_mirrors_layout_and_uploads_marker_last(b2: Any, tmp_path: Path) -> None:
    api, _, _ = b2
    remote = remote_for(api)
    local = b2_checkpoint(tmp_path, 1234)
    remote.upload(local)
    versions = [v for v, _ in api.get_bucket_by_name(BUCKET).ls("", recursive=True)]
    names = {v.file_name for v in versions}
    assert names == {f"runs/exp1/checkpoints/step_00001234/{rel}" for rel in tree(local)}
    newest = max(versions, key=lambda v: v.upload_timestamp)
    assert newest.file_name.endswith("/" + MARKER)
    assert remote.complete_steps() == [1234]


def test_failed_marker_upload_leaves_an_incomplete_remote_checkpoint(b2: Any, tmp_path: Path) -> None:
    api, sim, _ = b2
    remote = remote_for(api)
    sim.fail_uploads[MARKER] = -1
    with pytest.raises(RemoteSyncError, match="failed after 2 attempts"):
        remote.upload(b2_checkpoint(tmp_path, 7))
    assert remote.remote_steps() == [7]  # every other file made it before the marker was tried
    assert remote.complete_steps() == []


def test_upload_refuses_an_uncommitted_directory(b2: Any, tmp_path: Path) -> None:
    remote = remote_for(b2[0])
    with pytest.raises(RemoteSyncError, match=MARKER):
        remote.upload(b2_checkpoint(tmp_path, 3, marker=False))
    assert remote.remote_steps() == []


def test_download_into_an_empty_output_dir_reproduces_bytes(b2: Any, tmp_path: Path) -> None:
    api, _, _ = b2
    local = b2_checkpoint(tmp_path / "node1", 42)
    remote_for(api).upload(local)
    fresh = tmp_path / "node2" / "checkpoints"  # a fresh node after preemption: nothing local
    remote = remote_for(api)
    assert remote.complete_steps() == [42]
    got = remote.download(42, fresh)
    assert got == fresh / "step_00000042"
    assert tree(got) == tree(local)
    assert [p.name for p in fresh.iterdir()] == ["step_00000042"]  # no temporary directory left


def test_interrupted_download_is_never_a_local_checkpoint(b2: Any, tmp_path: Path) -> None:
    api, sim, _ = b2
    remote = remote_for(api)
    remote.upload(b2_checkpoint(tmp_path / "node1", 42))
    sim.fail_downloads[MARKER] = -1
    dest = tmp_path / "node2" / "checkpoints"
    with pytest.raises(RemoteSyncError):
        remote.download(42, dest)
    assert list(dest.iterdir()) == []
    with pytest.raises(RemoteSyncError, match="no complete checkpoint"):
        remote.download(99, dest)


def test_transient_upload_failures_are_retried(
    b2: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api, sim, _ = b2
    remote = remote_for(api, RetryPolicy(attempts=3, base_delay=0.0))
    # b2sdk itself retries an upload 5 times without waiting; 7 errors exhaust that once, so our
    # backoff loop has to try again (the simulator's own hook raises them on the next uploads).
    sim.set_upload_errors([ServiceError("injected") for _ in range(7)])
    with caplog.at_level(logging.WARNING):
        remote.upload(b2_checkpoint(tmp_path, 5))
    assert sim.upload_errors == []
    assert "retry 1" in caplog.text
    assert remote.complete_steps() == [5]


def test_retries_wait_as_the_policy_says_then_succeed(
    b2: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api, sim, _ = b2
    remote = remote_for(api, RetryPolicy(attempts=4, base_delay=0.1, max_delay=0.2))
    # 15 errors: b2sdk's own 5 quick tries fail in each of our first 3 attempts; the 4th succeeds.
    sim.fail_uploads["step_00000005/optimizer.bin"] = 15
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        remote.upload(b2_checkpoint(tmp_path, 5))
    elapsed = time.perf_counter() - start
    retries = [r.getMessage() for r in caplog.records if "optimizer.bin failed" in r.getMessage()]
    assert [m.rsplit(";", 1)[1] for m in retries] == [
        " retry 1 in 0.1s",
        " retry 2 in 0.2s",
        " retry 3 in 0.2s",
    ]
    assert "MaxRetriesExceeded" in retries[0]  # what b2sdk raised once its own tries were spent
    assert elapsed >= 0.5  # the waits really happened (0.1 + 0.2 + 0.2 s)
    assert remote.complete_steps() == [5]


def test_a_vanished_local_file_is_not_retried(
    b2: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Waiting cannot bring back a file that local retention deleted: the default policy would have
    held the uploader for 15 s of backoff."""
    api, sim, _ = b2
    remote = remote_for(api, RetryPolicy())
    doomed = b2_checkpoint(tmp_path, 1)
    sim.remove_after_upload = ("step_00000001/optimizer.bin", doomed)
    start = time.perf_counter()
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(RemoteSyncError, match=r"failed \(not retried\): InvalidUploadSource"),
    ):
        remote.upload(doomed)
    assert time.perf_counter() - start < 5.0
    assert "retry" not in caplog.text
    assert remote.complete_steps() == []


def test_background_uploader_reports_permanent_failure_without_raising(b2: Any, tmp_path: Path) -> None:
    api, sim, _ = b2
    uploader = BackgroundUploader(remote_for(api))
    sim.fail_uploads["step_00000001/" + MARKER] = -1
    uploader.submit(b2_checkpoint(tmp_path, 1))
    uploader.submit(b2_checkpoint(tmp_path, 2))
    assert uploader.close(timeout=20)
    assert len(uploader.errors) == 1
    assert "step_00000001/COMMITTED.json failed after 2 attempts" in uploader.errors[0]
    assert uploader.remote.complete_steps() == [2]  # later work went on
    uploader.submit(b2_checkpoint(tmp_path, 3))  # after close: reported, not raised
    assert len(uploader.errors) == 2


def test_submit_returns_immediately_while_upload_is_slow(b2: Any, tmp_path: Path) -> None:
    api, sim, _ = b2
    uploader = BackgroundUploader(remote_for(api))
    sim.upload_delay = 0.3  # per small file: the checkpoint takes >1 s to upload
    ckpts = [b2_checkpoint(tmp_path, s) for s in (1, 2)]
    start = time.perf_counter()
    for c in ckpts:
        uploader.submit(c)
    assert time.perf_counter() - start < 0.1
    assert uploader.remote.complete_steps() == []
    assert uploader.close(timeout=20)
    assert uploader.errors == []
    assert uploader.remote.complete_steps() == [1, 2]


def test_remote_retention_deletes_exactly_the_non_kept(b2: Any, tmp_path: Path) -> None:
    api, sim, _ = b2
    uploader = BackgroundUploader(remote_for(api))
    for step in (10, 20, 30, 40):
        uploader.submit(b2_checkpoint(tmp_path, step))
    uploader.submit(tmp_path / "checkpoints" / "step_00000010")  # a re-upload: a second version of each file
    keep = {20, 40}
    uploader.retention(keep)
    keep.add(10)  # the queued retention took a copy
    assert uploader.close(timeout=20)
    assert uploader.errors == []
    remote = uploader.remote
    assert remote.complete_steps() == [20, 40]
    all_versions = [
        v.file_name for v, _ in api.get_bucket_by_name(BUCKET).ls("", latest_only=False, recursive=True)
    ]
    assert not [n for n in all_versions if "step_00000010" in n or "step_00000030" in n]
    for dir_name in ("step_00000010", "step_00000030"):  # each checkpoint's marker went first
        is_marker = [n.endswith(MARKER) for n in sim.deleted if f"/{dir_name}/" in n]
        assert len(is_marker) > 2
        assert is_marker == sorted(is_marker, reverse=True)


def test_retention_never_deletes_the_newest_complete_remote_checkpoint(b2: Any, tmp_path: Path) -> None:
    remote = remote_for(b2[0])
    for step in (1, 2):
        remote.upload(b2_checkpoint(tmp_path, step))
    # the upload of the kept step 3 failed: step 2 is all the bucket has to resume from
    assert remote.retain({3}) == [1]
    assert remote.complete_steps() == [2]


def test_upload_of_a_checkpoint_deleted_midway_stops_quietly(b2: Any, tmp_path: Path) -> None:
    """Local retention deletes a checkpoint while it uploads (b2sdk then reports the next file as an
    invalid upload source, not as FileNotFoundError): not an error, and never a complete remote copy."""
    api, sim, _ = b2
    uploader = BackgroundUploader(remote_for(api))
    doomed = b2_checkpoint(tmp_path, 1)
    sim.remove_after_upload = ("step_00000001/optimizer.bin", doomed)
    uploader.submit(doomed)
    uploader.submit(b2_checkpoint(tmp_path, 2))
    assert uploader.close(timeout=20)
    assert uploader.errors == []
    assert uploader.remote.complete_steps() == [2]


def test_submit_skips_a_checkpoint_removed_locally_before_its_turn(b2: Any, tmp_path: Path) -> None:
    uploader = BackgroundUploader(remote_for(b2[0]))
    uploader.submit(tmp_path / "checkpoints" / "step_00000009")
    assert uploader.close(timeout=5)
    assert uploader.errors == []


def test_missing_credentials_name_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ID_VAR, raising=False)
    monkeypatch.delenv(KEY_VAR, raising=False)
    with pytest.raises(RemoteSyncError, match=f"{KEY_ID_VAR} and {KEY_VAR}"):
        RemoteCheckpoints.from_environment(BUCKET, "", "exp1")
    monkeypatch.setenv(KEY_ID_VAR, "someid")
    with pytest.raises(RemoteSyncError, match=f"set {KEY_VAR}$"):
        RemoteCheckpoints.from_environment(BUCKET, "", "exp1")


def test_credentials_never_appear_in_files_logs_or_reprs(
    b2: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    api, sim, key = b2
    secrets = [key.application_key, key.id_]
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):  # b2sdk traces its calls at DEBUG
        remote = remote_for(api)
        uploader = BackgroundUploader(remote)
        sim.fail_uploads["step_00000002/" + MARKER] = -1
        for step in (1, 2, 3):
            uploader.submit(b2_checkpoint(tmp_path / "out", step))
        uploader.retention({3})
        uploader.close(timeout=20)
        remote.download(3, tmp_path / "fresh" / "checkpoints")
        seen += [repr(remote), repr(uploader), *uploader.errors]
        for bad_key in (key.application_key + "x", ""):  # a wrong key, then a missing one
            os.environ[KEY_VAR] = bad_key
            with pytest.raises(RemoteSyncError) as info:
                remote_for(api)
            seen += [str(info.value), repr(info.value), str(info.value.__cause__)]
    assert uploader.errors  # the failure path (and its messages) was exercised
    out, err = capfd.readouterr()
    seen += [caplog.text, out, err]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 10
    assert "b2sdk" in caplog.text  # b2sdk's own debug traces were captured too
    for secret in secrets:
        assert all(secret not in text for text in seen), secret
        for path in files:
            assert secret.encode() not in path.read_bytes(), path


def test_single_file_operations_of_a_step(b2: Any, tmp_path: Path) -> None:
    """What multi-node sync builds on, in B2: a file rewritten keeps no old version after delete_files."""
    api, _, _ = b2
    remote = remote_for(api)
    remote.put_bytes(3, "shards/rank_1.json", b"old")
    remote.put_bytes(3, "shards/rank_1.json", b'{"rank": 1}')  # a second version of the same name
    remote.upload_file(3, "optimizer.bin", b2_checkpoint(tmp_path, 3) / "optimizer.bin")
    assert remote.get_bytes(3, "shards/rank_1.json") == b'{"rank": 1}'
    assert remote.get_bytes(3, "absent.json") is None
    assert remote.list_files(3) == {"shards/rank_1.json": 11, "optimizer.bin": 260}
    remote.download_files(3, ["shards/rank_1.json", "optimizer.bin"], tmp_path / "node2")
    assert tree(tmp_path / "node2") == {
        "optimizer.bin": bytes(range(256)) + b"\x00\r\n\xff",
        "shards/rank_1.json": b'{"rank": 1}',
    }
    with pytest.raises(RemoteSyncError, match="outside the checkpoint"):
        remote.download_files(3, ["../../etc/passwd"], tmp_path / "node3")
    remote.delete_files(3, ["shards/rank_1.json"])
    names = [v.file_name for v, _ in api.get_bucket_by_name(BUCKET).ls("", latest_only=False, recursive=True)]
    assert names == ["runs/exp1/checkpoints/step_00000003/optimizer.bin"]
