"""Checkpoint buckets by URL: s3:// against moto's S3 server on localhost (a real HTTP endpoint,
reached through the standard AWS variables) and file:// on a directory, through RemoteCheckpoints.

Faults are injected by wrapping the real store (``Faulty``): every byte still goes through s3fs or
the file system.
"""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.checkpoints import make_checkpoint, tree
from helpers.configs import CFG, DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from helpers.s3_server import SECRET_KEY, object_keys, s3_bucket_fixture, s3_server_fixture, use_endpoint  # noqa: F401

from linnaeus_accel.checkpoint.bucket.remote import (
    RemoteCheckpoints,
    RemoteSyncError,
    RetryPolicy,
)
from linnaeus_accel.checkpoint.bucket.uploader import BackgroundUploader
from linnaeus_accel.checkpoint.directory import MARKER
from linnaeus_accel.config import ConfigError, load_config
from linnaeus_accel.object_store import ObjectStore, open_store

FAST = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)
EXP = "exp1"


class Faulty:
    """An ObjectStore around a real one that records the order of writes and deletes, and fails
    the operations named in ``faults`` ((operation, key suffix) -> [errors still to raise])."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.describe = inner.describe
        self.faults: dict[tuple[str, str], list[BaseException]] = {}
        self.log: list[tuple[str, str]] = []
        self.listed_before_marker: set[str] | None = None

    def _maybe_fail(self, op: str, key: str) -> None:
        for (fop, suffix), errors in self.faults.items():
            if fop == op and key.endswith(suffix) and errors:
                raise errors.pop(0)

    def list(self, prefix: str) -> dict[str, int]:
        return self.inner.list(prefix)

    def put_file(self, local: Path, key: str) -> None:
        if key.endswith("/" + MARKER):  # the fault point: what the bucket holds as the marker goes up
            self.listed_before_marker = set(self.inner.list(key.rsplit("/", 1)[0]))
        self._maybe_fail("put", key)
        self.log.append(("put", key))
        self.inner.put_file(local, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._maybe_fail("put", key)
        self.inner.put_bytes(key, data)

    def get_file(self, key: str, local: Path) -> None:
        self._maybe_fail("get", key)
        self.inner.get_file(key, local)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def delete(self, key: str) -> None:
        self._maybe_fail("delete", key)
        self.log.append(("delete", key))
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def retryable(self, error: BaseException) -> bool:
        return self.inner.retryable(error)


@pytest.fixture(params=["s3", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A bucket URL with a prefix: a new S3 bucket on the moto server, or a shared directory."""
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/runs"
    share = tmp_path / "share" / "runs"
    share.mkdir(parents=True)  # a file:// URL's directory exists (a mounted share): it is not created
    return f"file://{share}"


def remote_for(url: str, *, faulty: bool = False) -> tuple[RemoteCheckpoints, Faulty | None]:
    store = Faulty(open_store(url)) if faulty else None
    return RemoteCheckpoints.from_url(url, EXP, retry=FAST, store=store), store


def test_a_checkpoint_uploaded_to_s3_comes_back_byte_identical(s3_bucket: str, tmp_path: Path) -> None:
    url = f"s3://{s3_bucket}/team/runs"
    local = make_checkpoint(tmp_path / "node1", 1234)
    first = RemoteCheckpoints.from_url(url, EXP, retry=FAST)
    first.upload(local)
    # The layout, as boto3 sees it: <url prefix>/<experiment>/checkpoints/step_XXXXXXXX/<files>.
    assert object_keys(s3_bucket) == sorted(
        f"team/runs/{EXP}/checkpoints/step_00001234/{rel}" for rel in tree(local)
    )
    fresh = RemoteCheckpoints.from_url(url, EXP, retry=FAST)  # a fresh node, a fresh client
    assert fresh.complete_steps() == [1234]
    dest = tmp_path / "node2" / "checkpoints"
    got = fresh.download(1234, dest)
    assert got == dest / "step_00001234"
    assert tree(got) == tree(local)
    assert [p.name for p in dest.iterdir()] == ["step_00001234"]  # no temporary directory left
    assert fresh.url == f"s3://{s3_bucket}/team/runs/{EXP}/checkpoints"


def test_the_marker_goes_up_last_and_comes_down_first(url: str, tmp_path: Path) -> None:
    remote, store = remote_for(url, faulty=True)
    assert store is not None
    local = make_checkpoint(tmp_path, 7)
    remote.upload(local)
    others = {f"{EXP}/checkpoints/step_00000007/{rel}" for rel in tree(local) if rel != MARKER}
    assert store.listed_before_marker == others  # every other file was in the bucket before it
    puts = [key for op, key in store.log if op == "put"]
    assert puts[-1].endswith("/" + MARKER)
    # A deletion that fails after its first file: the step is no longer complete, never a
    # complete-looking checkpoint with files missing.
    store.log.clear()
    store.faults[("delete", "optimizer.bin")] = [PermissionError("injected")] * 5
    with pytest.raises(RemoteSyncError, match=r"optimizer\.bin failed"):
        remote.delete(7)
    assert store.log[0] == ("delete", f"{EXP}/checkpoints/step_00000007/{MARKER}")
    assert remote.complete_steps() == []
    assert remote.remote_steps() == [7]


def test_an_interrupted_upload_is_never_complete(url: str, tmp_path: Path) -> None:
    remote, store = remote_for(url, faulty=True)
    assert store is not None
    store.faults[("put", "/" + MARKER)] = [OSError(errno.EIO, "injected 503")] * 3  # every attempt
    with pytest.raises(RemoteSyncError, match=f"{MARKER} failed after 3 attempts"):
        remote.upload(make_checkpoint(tmp_path, 5))
    assert remote.remote_steps() == [5]  # every other file made it before the marker was tried
    assert remote.complete_steps() == []
    with pytest.raises(RemoteSyncError, match="no complete checkpoint for step 5"):
        remote.download(5, tmp_path / "fresh")


def test_transient_errors_are_retried_and_a_refusal_is_not(
    url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    remote, store = remote_for(url, faulty=True)
    assert store is not None
    store.faults[("put", "optimizer.bin")] = [
        OSError(errno.EBUSY, "SlowDown"),
        TimeoutError("read timed out"),
    ]
    with caplog.at_level(logging.WARNING):
        remote.upload(make_checkpoint(tmp_path / "a", 1))
    assert "retry 2" in caplog.text
    assert remote.complete_steps() == [1]
    caplog.clear()
    store.faults[("put", "optimizer.bin")] = [PermissionError("AccessDenied")] * 3
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteSyncError, match="not retried"):
        remote.upload(make_checkpoint(tmp_path / "b", 2))
    assert "retry" not in caplog.text
    assert len(store.faults[("put", "optimizer.bin")]) == 2  # tried once


def test_an_interrupted_download_is_never_a_local_checkpoint(url: str, tmp_path: Path) -> None:
    remote, store = remote_for(url, faulty=True)
    assert store is not None
    remote.upload(make_checkpoint(tmp_path / "node1", 42))
    store.faults[("get", "/" + MARKER)] = [ConnectionError("reset")] * 3
    dest = tmp_path / "node2" / "checkpoints"
    with pytest.raises(RemoteSyncError):
        remote.download(42, dest)
    assert list(dest.iterdir()) == []


def test_retention_keeps_the_kept_and_the_newest_complete(url: str, tmp_path: Path) -> None:
    remote, _ = remote_for(url)
    for step in (10, 20, 30):
        remote.upload(make_checkpoint(tmp_path, step))
    # the upload of the kept step 40 failed after its first files: 30 is all there is to resume from
    remote.upload_file(
        40, "model.safetensors", tmp_path / "checkpoints" / "step_00000010" / "model.safetensors"
    )
    assert remote.retain({40}) == [10, 20]
    assert remote.complete_steps() == [30]
    assert remote.remote_steps() == [30, 40]


def test_background_uploader_syncs_on_its_own_thread(url: str, tmp_path: Path) -> None:
    remote, _ = remote_for(url)
    uploader = BackgroundUploader(remote)
    assert "checkpoint-sync" in [t.name for t in threading.enumerate()]
    for step in (1, 2, 3):
        uploader.submit(make_checkpoint(tmp_path, step))
    uploader.retention({3})
    uploader.run("a note", lambda: remote.put_bytes(3, "note.txt", b"after retention"))
    uploader.run("a bad name", lambda: remote.put_bytes(3, "../outside", b"x"))
    assert uploader.close(timeout=60)
    assert remote.complete_steps() == [3]
    assert remote.remote_steps() == [3]
    assert remote.get_bytes(3, "note.txt") == b"after retention"
    assert len(uploader.errors) == 1  # collected, not raised, and the work before it was done
    assert "outside the checkpoint" in uploader.errors[0]


def test_single_file_operations_of_a_step(url: str, tmp_path: Path) -> None:
    remote, _ = remote_for(url)
    remote.put_bytes(3, "shards/rank_1.json", b'{"rank": 1}')
    remote.upload_file(3, "model.safetensors", make_checkpoint(tmp_path, 3) / "model.safetensors")
    assert remote.get_bytes(3, "shards/rank_1.json") == b'{"rank": 1}'
    assert remote.get_bytes(3, "shards/rank_2.json") is None
    assert remote.list_files(3) == {"shards/rank_1.json": 11, "model.safetensors": 300_000}
    dest = tmp_path / "node2"
    remote.download_files(3, ["shards/rank_1.json", "model.safetensors"], dest)
    assert tree(dest) == {
        "model.safetensors": (tmp_path / "checkpoints" / "step_00000003" / "model.safetensors").read_bytes(),
        "shards/rank_1.json": b'{"rank": 1}',
    }
    for bad in ("../escape", "/etc/passwd", "a/../../b"):
        with pytest.raises(RemoteSyncError, match="outside the checkpoint"):
            remote.download_files(3, ["model.safetensors", bad], tmp_path / "node3")
    assert not (tmp_path / "node3").exists()  # refused before anything was downloaded
    remote.delete_files(3, ["shards/rank_1.json", "never-there.bin"])
    assert remote.list_files(3) == {"model.safetensors": 300_000}
    assert remote.store.exists(f"{EXP}/checkpoints/step_00000003/model.safetensors")
    assert not remote.store.exists(f"{EXP}/checkpoints/step_00000003/shards/rank_1.json")


def test_a_file_store_leaves_no_empty_directories_behind(tmp_path: Path) -> None:
    share = tmp_path / "share"
    share.mkdir()
    remote, _ = remote_for(f"file://{share}")
    remote.upload(make_checkpoint(tmp_path, 1))
    remote.delete(1)
    assert remote.remote_steps() == []
    assert list(share.iterdir()) == []


def test_s3_secrets_appear_in_no_message_log_or_file(
    s3_bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{s3_bucket}/runs"
    with caplog.at_level(logging.DEBUG):  # botocore and s3fs trace their calls at DEBUG
        remote, store = remote_for(url, faulty=True)
        assert store is not None
        uploader = BackgroundUploader(remote)
        store.faults[("put", "step_00000002/" + MARKER)] = [OSError(errno.EIO, "injected")] * 3
        for step in (1, 2):
            uploader.submit(make_checkpoint(tmp_path / "out", step))
        uploader.close(timeout=60)
        remote.download(1, tmp_path / "fresh" / "checkpoints")
        with pytest.raises(RemoteSyncError) as info:
            RemoteCheckpoints.from_url(f"s3://missing-{s3_bucket}/runs", EXP)
    out, err = capfd.readouterr()
    seen = [caplog.text, out, err, repr(remote), repr(store.inner), str(info.value), *uploader.errors]
    assert uploader.errors
    assert all(SECRET_KEY not in text for text in seen)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 8
    assert all(SECRET_KEY.encode() not in p.read_bytes() for p in files)


# -- at start: one sentence -----------------------------------------------------------------------


def test_a_missing_bucket_stops_the_run_at_start_in_one_sentence(s3_bucket: str, tmp_path: Path) -> None:
    reset_accelerate()
    try:
        rc, _, err = run_cli(
            "train", "--cfg", CFG, "--opts",
            "ENV.OUTPUT.BASE_DIR", str(tmp_path),
            "ENV.OUTPUT.BUCKET.URL", f"s3://no-such-{s3_bucket}/runs",
        )  # fmt: skip
    finally:
        reset_accelerate()
    assert rc == 2, err
    line = next(line for line in err.splitlines() if "ENV.OUTPUT.BUCKET.URL" in line)
    assert f"s3://no-such-{s3_bucket}/runs does not exist" in line
    assert "create the bucket" in line
    assert not list(tmp_path.rglob("step_*"))


def test_an_unreachable_endpoint_is_one_sentence(
    s3_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    use_endpoint(monkeypatch, "http://127.0.0.1:9", tmp_path)  # the discard port: nothing listens
    with pytest.raises(RemoteSyncError) as info:
        RemoteCheckpoints.from_url("s3://ckpt/runs", EXP, retry=FAST)
    message = str(info.value)
    assert message.startswith("s3://ckpt/runs is not reachable (EndpointConnectionError")
    assert message.endswith("check the endpoint, the network and the credentials")
    assert "\n" not in message


def test_a_file_url_whose_directory_is_missing_is_refused(tmp_path: Path) -> None:
    """An unmounted share is not an empty bucket: writing under its mount point would fill the
    node's own disk with checkpoints no other node sees."""
    with pytest.raises(RemoteSyncError, match=f"file://{tmp_path}/nfs does not exist"):
        RemoteCheckpoints.from_url(f"file://{tmp_path}/nfs", EXP)


def test_a_file_url_naming_a_file_says_it_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "hostname").write_text("node-7\n", encoding="utf-8")
    with pytest.raises(RemoteSyncError, match=f"file://{tmp_path}/hostname is a file, not a directory"):
        RemoteCheckpoints.from_url(f"file://{tmp_path}/hostname", EXP)


def test_an_upload_sends_each_file_once_and_leaves_only_the_checkpoints_own(url: str, tmp_path: Path) -> None:
    """Uploaded again (a rerun's catch-up), a checkpoint the bucket holds whole sends nothing; any
    object under its prefix that is not its own (a stray, a file of an earlier version) goes, the
    marker staying up; a checkpoint whose marker changed (saved again) is replaced, marker first."""
    remote, store = remote_for(url, faulty=True)
    assert store is not None
    local = make_checkpoint(tmp_path, 7)
    assert remote.upload(local)
    remote.put_bytes(7, "stray.bin", b"someone else's")
    store.log.clear()
    assert not remote.upload(local)  # whole already
    assert store.log == [("delete", f"{EXP}/checkpoints/step_00000007/stray.bin")]
    assert set(remote.list_files(7)) == {
        p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()
    }
    (local / MARKER).write_text(json.dumps({"global_step": 7, "saved": "again"}), encoding="utf-8")
    (local / "optimizer.bin").unlink()  # the new version has no such file
    store.log.clear()
    assert remote.upload(local)
    assert store.log[0] == ("delete", f"{EXP}/checkpoints/step_00000007/{MARKER}")
    assert store.log[-1] == ("put", f"{EXP}/checkpoints/step_00000007/{MARKER}")
    assert "optimizer.bin" not in remote.list_files(7)
    assert remote.complete_steps() == [7]


def test_a_missing_library_names_the_extra() -> None:
    """In a fresh interpreter where s3fs and gcsfs cannot be imported (as without the extras)."""
    script = (
        "import sys; sys.modules['s3fs'] = sys.modules['gcsfs'] = None\n"
        "from linnaeus_accel.checkpoint.bucket.remote import RemoteCheckpoints, RemoteSyncError\n"
        "for url in ('s3://ckpt/runs', 'gs://ckpt/runs'):\n"
        "    try:\n"
        "        RemoteCheckpoints.from_url(url, 'exp1')\n"
        "    except RemoteSyncError as e:\n"
        "        print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines() == [
        "s3:// buckets need the s3 extra: pip install 'linnaeus-accel[s3]'",
        "gs:// buckets need the gcs extra: pip install 'linnaeus-accel[gcs]'",
    ], result.stderr


# -- config ---------------------------------------------------------------------------------------


def bucket_error(*opts: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT_CONFIG, list(opts))
    return str(info.value)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://host/path", "must start with one of s3://, gs://, file://, b2://"),
        ("/mnt/share", "must start with one of s3://, gs://, file://, b2://"),
        ("s3:///runs", "names no bucket: write s3://<bucket>/<prefix>"),
        ("gs://", "names no bucket: write gs://<bucket>/<prefix>"),
        ("file://relative/dir", "names no absolute directory: write file:///abs/path"),
        ("s3://key:secret@bucket/runs", "credentials and endpoints come from the environment"),
    ],
)
def test_an_unusable_url_is_a_config_error(url: str, says: str) -> None:
    text = bucket_error("ENV.OUTPUT.BUCKET.URL", url)
    assert "ENV.OUTPUT.BUCKET.URL" in text
    assert says in text
    assert "secret" not in text  # a URL holding credentials is not echoed


def test_url_and_the_older_bucket_keys_together_are_refused() -> None:
    text = bucket_error("ENV.OUTPUT.BUCKET.URL", "s3://ckpt/runs", "ENV.OUTPUT.BUCKET.BUCKET", "ckpt")
    assert "ENV.OUTPUT.BUCKET.URL and ENV.OUTPUT.BUCKET.BUCKET name the bucket twice: keep only URL" in text


def test_which_url_a_config_copies_to() -> None:
    def target(*opts: str) -> str | None:
        return load_config(DEFAULT_CONFIG, list(opts)).ENV.OUTPUT.BUCKET.target_url

    assert target() is None
    assert target("ENV.OUTPUT.BUCKET.URL", "gs://ckpt/team") == "gs://ckpt/team"  # URL alone turns it on
    assert target("ENV.OUTPUT.BUCKET.URL", "gs://ckpt/team", "ENV.OUTPUT.BUCKET.ENABLED", "false") is None
    older = ["ENV.OUTPUT.BUCKET.ENABLED", "true", "ENV.OUTPUT.BUCKET.BUCKET", "ckpt"]
    assert target(*older, "ENV.OUTPUT.BUCKET.PREFIX", "/team/runs/") == "b2://ckpt/team/runs"
    assert target(*older) == "b2://ckpt"
    assert target("ENV.OUTPUT.BUCKET.BUCKET", "ckpt") is None  # as before: ENABLED turns BUCKET on


def test_every_scheme_opens_its_store(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert open_store(f"s3://{s3_bucket}/a/b").describe == f"s3://{s3_bucket}/a/b"
    assert open_store(f"file://{tmp_path}/").describe == f"file://{tmp_path}"
    monkeypatch.delenv("B2_APPLICATION_KEY_ID", raising=False)
    monkeypatch.setenv("B2_APPLICATION_KEY", "k")
    with pytest.raises(
        RemoteSyncError,
        match=r"b2:// buckets need B2 credentials in the environment: set B2_APPLICATION_KEY_ID$",
    ):
        open_store("b2://ckpt/runs")
