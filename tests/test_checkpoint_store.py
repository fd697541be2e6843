"""Checkpoint store: atomic commit, verification and fallback, kill -9 safety, retention.

Everything runs on the real filesystem under tmp_path; nothing is mocked. A crash between commit
steps is simulated by calling the commit's internal steps (_seal, _publish, _mark) one at a time,
and for real by SIGKILL-ing a subprocess that commits in a loop.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.checkpoints import save, stage
from helpers.configs import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from linnaeus_accel.checkpoint.directory import (
    MARKER,
    CheckpointStore,
    EarlySeal,
    EarlyWriteback,
    file_digest,
    read_marker,
    retained,
)
from linnaeus_accel.digests import hash_file, seal_file

# -- commit ------------------------------------------------------------------------------------------


def test_commit_publishes_a_verified_checkpoint_named_by_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    staging = stage(store, 1234)
    assert staging == tmp_path / "checkpoints" / ".staging-step_00001234"
    final = store.commit(1234, {"global_step": 1234, "epoch": 3})

    assert final == tmp_path / "checkpoints" / "step_00001234" == store.final_path(1234)
    assert not staging.exists()
    assert store.verify(final) is None
    assert store.verify(final, deep=False) is None
    assert store.complete_steps() == [1234]
    assert store.newest_valid() == (final, [])
    assert store.step_of(final) == 1234

    marker = read_marker(final)
    assert marker["version"] == 1
    assert marker["step"] == 1234
    assert marker["info"] == {"global_step": 1234, "epoch": 3}
    paths = [f["path"] for f in marker["files"]]
    assert paths == sorted(paths)
    assert "sharded/part_0.bin" in paths
    assert MARKER not in paths
    model = next(f for f in marker["files"] if f["path"] == "model.safetensors")
    data = (final / "model.safetensors").read_bytes()
    assert model == {"path": "model.safetensors", "size": len(data), **dict([file_digest(data)])}
    # The marker is the last thing written.
    marker_time = (final / MARKER).stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= marker_time for p in final.rglob("*") if p.is_file())
    assert sorted(p.name for p in final.iterdir()) == sorted(
        [MARKER, "model.safetensors", "optimizer.bin", "random_states_0.pkl", "sharded", "trainer_state.json"]
    )


def test_a_checkpoint_sealed_with_sha256_digests_still_verifies(tmp_path: Path) -> None:
    """Markers written before XXH3-128 carry SHA-256 digests: they verify, and damage shows."""
    store = CheckpointStore(tmp_path / "checkpoints")
    final = save(store, 7)
    marker = json.loads((final / MARKER).read_text())
    for entry in marker["files"]:
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((final / entry["path"]).read_bytes()).hexdigest()
    (final / MARKER).write_text(json.dumps(marker))
    assert store.verify(final) is None
    _flip_byte(final)
    assert (store.verify(final) or "").endswith(": checksum mismatch")
    # An entry with both digests (or neither) is malformed, not silently half-checked.
    marker["files"][0]["xxh3_128"] = "0" * 32
    (final / MARKER).write_text(json.dumps(marker))
    assert "malformed file entry" in (store.verify(final) or "")


def test_files_sealed_early_are_trusted_only_at_the_size_they_were_sealed(tmp_path: Path) -> None:
    """ASYNC seals the model files while the optimizer's are still being written; the commit reuses
    those entries, unless a file's size changed since (then it is hashed again)."""
    store = CheckpointStore(tmp_path / "checkpoints")
    staging = stage(store, 3)
    early = EarlySeal(staging)
    early.add([staging / "model.safetensors", staging / "optimizer.bin"])
    sealed = early.entries()
    assert sorted(sealed) == ["model.safetensors", "optimizer.bin"]
    assert sealed["model.safetensors"] == {
        "path": "model.safetensors",
        "size": (staging / "model.safetensors").stat().st_size,
        **dict([file_digest((staging / "model.safetensors").read_bytes())]),
    }
    (staging / "optimizer.bin").write_bytes(b"rewritten after sealing")
    final = store.commit(3, sealed=sealed)
    assert store.verify(final) is None  # optimizer.bin's entry was recomputed, the model's reused


@pytest.mark.parametrize("size", [0, 1, (4 << 20) + 3])  # empty (cannot be mapped), tiny, > one read
def test_sealing_a_file_gives_the_digest_verification_recomputes(tmp_path: Path, size: int) -> None:
    file = tmp_path / "optimizer.bin"
    file.write_bytes(os.urandom(size))
    assert seal_file(file) == hash_file(file, sync=False) == (size, file_digest(file.read_bytes())[1])


def test_early_writeback_leaves_files_whole_and_ends_with_its_block(tmp_path: Path) -> None:
    """ASYNC pushes files to the disk while they are still being written: what is written is
    unchanged, a file removed meanwhile is no error (the commit's own fsync reports real ones),
    and leaving the block ends its thread and closes every file it opened."""
    opened = len(os.listdir("/proc/self/fd"))
    chunks = [os.urandom(1 << 20) for _ in range(8)]
    with EarlyWriteback(tmp_path) as writeback:
        with (tmp_path / "optimizer.bin").open("wb") as f:
            for chunk in chunks:
                f.write(chunk)
                f.flush()
                time.sleep(0.005)
        (tmp_path / "gone.bin").write_bytes(b"x" * 4096)
        time.sleep(0.03)  # the thread has opened it by now
        (tmp_path / "gone.bin").unlink()
        time.sleep(0.03)
    assert not writeback._thread.is_alive()
    assert len(os.listdir("/proc/self/fd")) == opened
    assert (tmp_path / "optimizer.bin").read_bytes() == b"".join(chunks)


def test_staging_dir_starts_empty(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    stage(store, 100)
    assert list(store.staging_dir(100).iterdir()) == []


def test_a_commit_interrupted_before_the_marker_is_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    first = save(store, 100)
    staging, final = stage(store, 200), store.final_path(200)

    manifest = store._seal(staging)  # killed here: only a staging directory
    assert store.newest_valid() == (first, [])
    store._publish(staging, final)  # killed here: the full directory, but no marker
    assert final.is_dir()
    assert not staging.exists()
    assert store.complete_steps() == [100]
    assert store.newest_valid() == (
        first,
        ["step_00000200: COMMITTED.json missing (incomplete write?); using step_00000100"],
    )
    store._mark(final, 200, manifest, {})
    assert store.newest_valid() == (final, [])


def test_a_leftover_without_marker_is_moved_aside_and_a_committed_step_is_never_overwritten(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    staging = stage(store, 200, {"stale.bin": b"from the killed run"})
    store._seal(staging)
    store._publish(staging, store.final_path(200))  # killed before the marker

    final = save(store, 200)  # the resumed run reaches step 200 again
    assert store.verify(final) is None
    assert not (final / "stale.bin").exists()
    # The leftover was a whole checkpoint but for its marker: moved aside, not deleted.
    leftover = store.rejected_root / "step_00000200"
    assert (leftover / "stale.bin").read_bytes() == b"from the killed run"
    assert "COMMITTED.json missing" in (leftover / "REJECTED.txt").read_text()
    assert store.rejected_checkpoints() == []  # it never had a marker

    stage(store, 200)
    with pytest.raises(FileExistsError):
        store.commit(200, {})
    assert store.verify(final) is None
    assert store.commit(200, {"again": True}, replace=True) == final  # resumed on purpose from older
    assert read_marker(final)["info"] == {"again": True}


def test_a_corrupt_checkpoint_that_resume_skipped_does_not_block_saving_that_step_again(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    save(store, 100)
    corrupt = save(store, 200)
    _flip_byte(corrupt)  # sizes still match: only the deep check sees it
    damaged = (corrupt / "optimizer.bin").read_bytes()
    assert store.newest_valid()[0] == store.final_path(100)
    assert store.verify(save(store, 200)) is None
    # The corrupt one is kept, byte for byte, with its marker: it may hold the only good weights.
    kept = store.rejected_root / "step_00000200"
    assert (kept / "optimizer.bin").read_bytes() == damaged
    assert store.rejected_checkpoints() == [kept]
    assert "optimizer.bin: checksum mismatch" in (kept / "REJECTED.txt").read_text()


def test_what_a_crash_leaves_behind_is_removed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.remove_stale_staging() == []  # no root yet
    assert store.remove_incomplete() == []
    save(store, 100)
    stage(store, 200)
    stage(store, 300)
    half_deleted = store.root / ".deleting-step_00000050"  # killed while delete() removed the tree
    (half_deleted / "sub").mkdir(parents=True)
    assert store.remove_stale_staging() == [half_deleted, store.staging_path(200), store.staging_path(300)]
    assert sorted(p.name for p in store.root.iterdir()) == ["step_00000100"]

    staging = stage(store, 400)
    store._seal(staging)
    store._publish(staging, store.final_path(400))  # killed before the marker
    assert store.remove_incomplete() == [store.final_path(400)]
    assert sorted(p.name for p in store.root.iterdir()) == ["step_00000100"]


def test_commit_refuses_what_would_publish_a_broken_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    store.staging_dir(100)
    with pytest.raises(ValueError, match="empty"):
        store.commit(100, {})
    stage(store, 100, {MARKER: b"{}"})  # would look committed the instant it is renamed
    with pytest.raises(ValueError, match=MARKER):
        store.commit(100, {})
    stage(store, 100)
    with pytest.raises(TypeError):
        store.commit(100, {"not json": object()})
    assert not store.final_path(100).exists()
    assert store.staging_path(100).is_dir()


def test_only_the_named_journal_may_be_added_after_the_commit(tmp_path: Path) -> None:
    # The validation journal is appended to the committed checkpoint; it is not in the manifest.
    # Anything else that is not is never read: the checkpoint fails verification, naming it.
    store = CheckpointStore(tmp_path / "checkpoints", journal="validation_journal.jsonl")
    final = save(store, 100)
    (final / "validation_journal.jsonl").write_text('{"pass": "standard"}\n')
    assert store.verify(final) is None
    assert store.verify(final, deep=False) is None
    assert CheckpointStore(store.root).verify(final) == (
        "validation_journal.jsonl: not in COMMITTED.json (nothing but what was committed is read)"
    )

    (final / "custom_checkpoint_0.pkl").write_bytes(b"stray")
    assert store.verify(final, deep=False) == (
        "custom_checkpoint_0.pkl: not in COMMITTED.json (nothing but what was committed is read)"
    )
    (final / "custom_checkpoint_0.pkl").unlink()
    (final / "sharded" / "extra.bin").write_bytes(b"stray")
    assert store.verify(final).startswith("sharded/extra.bin: not in COMMITTED.json")  # type: ignore[union-attr]
    (final / "sharded" / "extra.bin").unlink()
    (final / "pytorch_model_fsdp_0").mkdir()  # an empty directory Accelerate would look into
    assert store.verify(final).startswith("pytorch_model_fsdp_0/: not in COMMITTED.json")  # type: ignore[union-attr]
    (final / "pytorch_model_fsdp_0").rmdir()
    (final / "sub" / "validation_journal.jsonl").parent.mkdir()
    (final / "sub" / "validation_journal.jsonl").write_text("")  # only at the top
    assert store.verify(final).startswith("sub/: not in COMMITTED.json")  # type: ignore[union-attr]


def test_the_owners_check_decides_too(tmp_path: Path) -> None:
    def check(path: Path) -> str | None:
        state = json.loads((path / "trainer_state.json").read_text())
        return None if state["global_step"] == int(path.name[5:]) else "trainer_state.json: wrong step"

    store = CheckpointStore(tmp_path / "checkpoints", check=check)
    first = save(store, 100)
    newest = save(store, 200)
    state = newest / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 999}))
    _reseal(newest)
    assert CheckpointStore(store.root).verify(newest) is None  # the files are as sealed ...
    assert store.verify(newest) == "trainer_state.json: wrong step"  # ... but the owner refuses them
    assert store.verify(newest, deep=False) == "trainer_state.json: wrong step"
    assert store.newest_valid() == (
        first,
        ["step_00000200: trainer_state.json: wrong step; using step_00000100"],
    )
    assert store.newest_verified() == (first, [(newest, "trainer_state.json: wrong step")])


def _reseal(d: Path) -> None:
    """Recompute COMMITTED.json for the files as they are now (as someone who edited them would)."""
    marker = json.loads((d / MARKER).read_text())
    for entry in marker["files"]:
        data = (d / entry["path"]).read_bytes()
        entry.update(dict([file_digest(data)]), size=len(data))
    (d / MARKER).write_text(json.dumps(marker))


def test_reject_moves_a_checkpoint_aside_intact_and_says_why(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    before = {}
    for _ in range(2):
        final = save(store, 100)
        before = {p.relative_to(final): p.read_bytes() for p in final.rglob("*") if p.is_file()}
        moved = store.reject(final, "optimizer.bin: checksum mismatch")
        assert not final.exists()
        after = {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*") if p.is_file()}
        note = after.pop(Path("REJECTED.txt")).decode()
        assert after == before  # nothing changed, nothing lost
        assert "optimizer.bin: checksum mismatch" in note
        assert "step_00000100" in note
    # The same step rejected twice: both kept.
    assert sorted(p.name for p in store.rejected_root.iterdir()) == ["step_00000100", "step_00000100.2"]
    assert store.rejected_checkpoints() == [
        store.rejected_root / n for n in ("step_00000100", "step_00000100.2")
    ]
    assert store.complete_steps() == []
    assert store.step_dirs() == []


class Killed(BaseException):
    """A kill -9 at that instant: nothing after it runs."""


def test_a_reject_killed_before_its_move_leaves_the_reason_and_the_next_start_finishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    save(store, 100)
    corrupt = save(store, 200)
    _flip_byte(corrupt)
    real_replace = os.replace

    def killed_at_the_move(src: Any, dst: Any) -> None:
        if Path(src) == corrupt:  # the directory's move; the note's own rename goes through
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_move)
    with pytest.raises(Killed):
        store.reject(corrupt, "optimizer.bin: checksum mismatch")
    monkeypatch.setattr(os, "replace", real_replace)
    # Still in checkpoints/, with the reason in it (durably: the note is fsynced before the move).
    assert (
        "because it failed verification: optimizer.bin: checksum mismatch"
        in (corrupt / "REJECTED.txt").read_text()
    )
    assert not (corrupt / ".REJECTED.txt.tmp").exists()
    # Never resumed from, and what verification says of it is the reason it was rejected for.
    reason = "REJECTED.txt: rejected before, because optimizer.bin: checksum mismatch"
    assert store.verify(corrupt, deep=False) == reason
    assert store.newest_valid() == (store.final_path(100), [f"step_00000200: {reason}; using step_00000100"])
    # The next start finishes the move, the first reason kept (not "REJECTED.txt: not in ...").
    assert store.remove_stale_staging() == [corrupt]
    moved = store.rejected_root / "step_00000200"
    assert store.rejected_checkpoints() == [moved]
    note = (moved / "REJECTED.txt").read_text()
    assert note.count("because it failed verification:") == 1
    assert "because it failed verification: optimizer.bin: checksum mismatch\n" in note
    assert store.step_dirs() == [(100, store.final_path(100))]
    assert store.remove_stale_staging() == []  # nothing more to finish


def test_a_note_cut_short_while_being_written_is_removed_at_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    final = save(store, 100)
    (final / ".REJECTED.txt.tmp").write_text("step_00000100 was rej")  # killed mid-write: no note yet
    assert store.verify(final) is not None
    assert store.remove_stale_staging() == []
    assert store.verify(final) is None  # its own problem (none here) is found again, and said then


def test_retention_moves_a_checkpoint_that_fails_verification_aside(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    for step in (100, 200, 300):
        save(store, step)
    _truncate(store.final_path(100))
    messages: list[str] = []
    assert store.apply_retention({}, keep_top=0, keep_last=1, mode="min", rejected=messages) == [100, 200]
    assert store.complete_steps() == [300]
    assert [p.name for p in store.rejected_checkpoints()] == ["step_00000100"]
    assert len(messages) == 1
    assert messages[0].startswith(
        "step_00000100: model.safetensors: size 100 != 2048; retention moved it to "
    )


def test_delete_and_step_of_a_renamed_copy(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    save(store, 100)
    final = save(store, 200)
    copy = tmp_path / "my_checkpoint"
    final.rename(copy)
    assert store.step_of(copy) == 200
    assert store.verify(copy) is None
    assert store.step_of(tmp_path) is None
    store.delete(100)
    store.delete(100)  # already gone: nothing to do
    assert store.complete_steps() == []
    assert list(store.root.iterdir()) == []


# -- corruption --------------------------------------------------------------------------------------


def _truncate(d: Path) -> None:
    with (d / "model.safetensors").open("r+b") as f:
        f.truncate(100)


def _flip_byte(d: Path) -> None:
    data = bytearray((d / "optimizer.bin").read_bytes())
    data[5] ^= 0xFF
    (d / "optimizer.bin").write_bytes(bytes(data))


def _cut_marker(d: Path) -> None:
    (d / MARKER).write_text('{"version": 1, "st')


def _rewrite_marker(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        marker = json.loads((d / MARKER).read_text())
        change(marker)
        (d / MARKER).write_text(json.dumps(marker))

    return corrupt


CORRUPTIONS: list[tuple[str, Callable[[Path], None], str, bool]] = [
    # (name, corruption, expected problem, also caught by the size-only check)
    ("truncated", _truncate, "model.safetensors: size 100 != 2048", True),
    ("byte changed", _flip_byte, "optimizer.bin: checksum mismatch", False),
    ("marker deleted", lambda d: (d / MARKER).unlink(), "COMMITTED.json missing (incomplete write?)", True),
    ("file deleted", lambda d: (d / "sharded" / "part_0.bin").unlink(), "sharded/part_0.bin: missing", True),
    ("marker cut", _cut_marker, "COMMITTED.json unreadable", True),
    (
        "marker for another step",
        _rewrite_marker(lambda m: m.update(step=100)),
        "is for step 100, not 200",
        True,
    ),
    ("newer marker version", _rewrite_marker(lambda m: m.update(version=2)), "version 2 is not 1", True),
    ("empty manifest", _rewrite_marker(lambda m: m.update(files=[])), "no file list", True),
    (
        "manifest escapes the directory",
        _rewrite_marker(lambda m: m["files"].append({"path": "../../secret", "size": 1, "sha256": ""})),
        "outside the checkpoint",
        True,
    ),
]


@pytest.mark.parametrize(
    ("corrupt", "problem", "shallow"), [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS]
)
def test_a_corrupt_newest_checkpoint_falls_back_and_says_why(
    tmp_path: Path, corrupt: Callable[[Path], None], problem: str, shallow: bool
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    first = save(store, 100)
    newest = save(store, 200)
    corrupt(newest)

    path, messages = store.newest_valid()
    assert path == first
    assert len(messages) == 1
    assert messages[0].startswith("step_00000200: ")
    assert messages[0].endswith("; using step_00000100")
    assert problem in messages[0]
    assert (store.verify(newest, deep=False) is not None) == shallow
    assert store.newest_valid(deep=False)[0] == (first if shallow else newest)


def test_no_valid_checkpoint_at_all(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.newest_valid() == (None, [])
    _truncate(save(store, 100))
    staging = stage(store, 200)
    store._publish(staging, store.final_path(200))
    path, messages = store.newest_valid()
    assert path is None
    assert messages == [
        "step_00000200: COMMITTED.json missing (incomplete write?); no older valid checkpoint",
        "step_00000100: model.safetensors: size 100 != 2048; no older valid checkpoint",
    ]


# -- nothing is ever unpickled -----------------------------------------------------------------------


class _Armed:
    """Unpickling this opens (creates) ``target``: proof that a pickle was loaded."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.target), "w"))


def test_a_planted_pickle_is_never_loaded(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    evil = pickle.dumps(_Armed(sentinel))
    store = CheckpointStore(tmp_path / "checkpoints")
    names = {"evil.pkl": evil, "random_states_0.pkl": evil, "optimizer.bin": evil, "trainer_state.pkl": evil}
    stage(store, 100, names)
    first = store.commit(100, {})
    stage(store, 200, names)
    second = store.commit(200, {})
    for d in (first, second):
        (d / "planted_after_commit.pkl").write_bytes(evil)
    _flip_byte(second)  # the fallback path reads the same files
    stage(store, 300, names)  # a leftover staging directory full of pickles

    planted = "planted_after_commit.pkl: not in COMMITTED.json (nothing but what was committed is read)"
    assert store.verify(first) == planted
    assert store.verify(first, deep=False) == planted
    assert store.verify(second) == planted
    assert store.newest_valid()[0] is None
    (first / "planted_after_commit.pkl").unlink()
    (second / "planted_after_commit.pkl").unlink()
    assert store.verify(first) is None
    assert store.verify(second) == "optimizer.bin: checksum mismatch"
    assert store.newest_valid()[0] == first
    assert store.newest_valid(deep=False)[0] == second
    assert store.complete_steps() == [100, 200]
    assert store.step_of(second) == 200
    assert read_marker(first)["step"] == 100
    assert store.remove_stale_staging() == [store.staging_path(300)]
    assert store.apply_retention({100: 0.5, 200: 0.1}, keep_top=1, keep_last=1, mode="min") == [100]
    store.delete(200)
    assert not sentinel.exists()

    pickle.loads(evil).close()  # the bait was live: loading it does create the file
    assert sentinel.exists()


# -- kill -9 while committing ------------------------------------------------------------------------

HELPER = """
import hashlib, json, sys
from pathlib import Path
from linnaeus_accel.checkpoint.directory import CheckpointStore

store = CheckpointStore(Path(sys.argv[1]))
store.remove_stale_staging()
steps = store.complete_steps()
step = (steps[-1] if steps else 0) + 100
print("ready", flush=True)
while True:
    staging = store.staging_dir(step)
    (staging / "sub").mkdir()
    for i, rel in enumerate(["model.safetensors", "optimizer.bin", "sub/part.bin"]):
        (staging / rel).write_bytes(hashlib.sha256(f"{step}:{i}".encode()).digest() * (1 << 16))
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    store.commit(step, {"global_step": step})
    store.apply_retention({}, keep_top=0, keep_last=3, mode="min")
    step += 100
"""


def _expected_content(step: int, rel: str) -> bytes:
    if rel == "trainer_state.json":
        return json.dumps({"global_step": step}).encode()
    i = ["model.safetensors", "optimizer.bin", "sub/part.bin"].index(rel)
    return hashlib.sha256(f"{step}:{i}".encode()).digest() * (1 << 16)


def test_kill_9_while_committing_never_leaves_a_checkpoint_that_resume_would_pick(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    store = CheckpointStore(root)
    script = tmp_path / "helper.py"
    script.write_text(HELPER)
    rng = random.Random(4)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(10):
        proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL

        complete = store.complete_steps()
        # Every directory with a marker is whole, with exactly the bytes the helper meant to write.
        for step in complete:
            final = store.final_path(step)
            assert store.verify(final, deep=True) is None
            for entry in read_marker(final)["files"]:
                assert (final / entry["path"]).read_bytes() == _expected_content(step, entry["path"])
        path, messages = store.newest_valid()
        assert path == (store.final_path(complete[-1]) if complete else None)
        assert all("COMMITTED.json missing" in m for m in messages)
    assert store.complete_steps(), "no commit ever finished: the test did not exercise anything"
    store.remove_stale_staging()
    store.remove_incomplete()
    names = sorted(p.name for p in root.iterdir() if p.name != "rejected")
    assert names == [f"step_{s:08d}" for s in store.complete_steps()]
    # A commit killed between rename and marker left a whole directory that the next run, reaching
    # the same step, moved aside rather than deleting: never one that had a marker.
    for moved in store.rejected_root.iterdir() if store.rejected_root.exists() else []:
        assert not (moved / MARKER).exists()
        assert "COMMITTED.json missing" in (moved / "REJECTED.txt").read_text()


# -- a full disk while committing --------------------------------------------------------------------

FULL_DISK_COMMIT = """
import errno, json, os, sys
from pathlib import Path
from linnaeus_accel.checkpoint.directory import CheckpointStore

disk = Path(sys.argv[1])
store = CheckpointStore(disk / "checkpoints")

def stage(step):
    staging = store.staging_dir(step)
    (staging / "model.safetensors").write_bytes(os.urandom(100_000))
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": step}))

stage(100)
store.commit(100, {})
stage(200)
fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # every page the staged files left free
try:
    while True:
        os.write(fd, bytes(4096))
except OSError as e:
    assert e.errno == errno.ENOSPC, e
try:
    store.commit(200, {})
    result = "committed"
except OSError as e:
    result = errno.errorcode[e.errno]
print(json.dumps({
    "result": result,
    "left": sorted(p.name for p in store.root.iterdir()),
    "previous": store.verify(store.final_path(100)),
}))
"""


def in_tmpfs(tmp_path: Path, size: str, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``command DISK`` in its own user and mount namespace, with a tmpfs of ``size`` mounted
    at ``DISK`` (a real full disk: no mocks). CI runs as root on this image, where it works."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    assert probe.returncode == 0, (
        f"`unshare -rm` is needed for the full-disk tests and failed here: {probe.stderr.strip()}"
    )
    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", size, str(disk), *command, str(disk)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )


def test_a_commit_that_runs_out_of_space_for_its_marker_leaves_the_previous_checkpoint_alone(
    tmp_path: Path,
) -> None:
    script = tmp_path / "full_disk_commit.py"
    script.write_text(FULL_DISK_COMMIT)
    done = in_tmpfs(tmp_path, "1m", [sys.executable, str(script)])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["result"] == "ENOSPC"
    # Neither a staging directory nor an unmarked step_00000200 is left to take the space.
    assert report["left"] == ["step_00000100"]
    assert report["previous"] is None


# -- retention ---------------------------------------------------------------------------------------

M = [100, 200, 300, 400, 500]
RETENTION_EXAMPLES: list[tuple[str, list[float | None], int, int, str, set[int], set[int]]] = [
    # (why, metrics at M, keep_top, keep_last, mode, protect, kept)
    (
        "EXAMPLES.md: best 200 plus the last two",
        [0.9, 0.5, 0.7, 0.8, 0.6],
        1,
        2,
        "min",
        set(),
        {200, 400, 500},
    ),
    ("higher is better: 100 is best", [0.9, 0.5, 0.7, 0.8, 0.6], 1, 2, "max", set(), {100, 400, 500}),
    ("top 2 and last 1 overlap at 500", [0.9, 0.5, 0.7, 0.8, 0.6], 2, 1, "min", set(), {200, 500}),
    ("0 and 0 keeps everything", [0.9, 0.5, 0.7, 0.8, 0.6], 0, 0, "min", set(), set(M)),
    ("keep_top 0 still keeps the best", [0.9, 0.5, 0.7, 0.8, 0.6], 0, 1, "min", set(), {200, 500}),
    ("keep_last 0 still keeps the newest", [0.9, 0.5, 0.7, 0.8, 0.6], 1, 0, "min", set(), {200, 500}),
    ("a tie goes to the newer step", [0.5, 0.5, 0.7, 0.8, 0.9], 1, 1, "min", set(), {200, 500}),
    ("no metric yet: only the last N", [None] * 5, 3, 2, "min", set(), {400, 500}),
    (
        "NaN and inf are never best",
        [math.nan, -math.inf, 0.7, math.inf, None],
        1,
        1,
        "min",
        set(),
        {300, 500},
    ),
    (
        "the resumed-from checkpoint is protected",
        [0.9, 0.5, 0.7, 0.8, 0.6],
        1,
        1,
        "min",
        {100},
        {100, 200, 500},
    ),
    ("protecting a deleted step changes nothing", [0.9, 0.5, 0.7, 0.8, 0.6], 1, 1, "min", {700}, {200, 500}),
    ("more to keep than exist", [0.9, 0.5, 0.7, 0.8, 0.6], 9, 9, "min", set(), set(M)),
]


@pytest.mark.parametrize(
    ("metrics", "keep_top", "keep_last", "mode", "protect", "kept"),
    [e[1:] for e in RETENTION_EXAMPLES],
    ids=[e[0] for e in RETENTION_EXAMPLES],
)
def test_retention_examples(
    tmp_path: Path,
    metrics: list[float | None],
    keep_top: int,
    keep_last: int,
    mode: Any,
    protect: set[int],
    kept: set[int],
) -> None:
    checkpoints = list(zip(M, metrics, strict=True))
    assert retained(checkpoints, keep_top, keep_last, mode, protect) == kept
    assert retained(checkpoints[::-1], keep_top, keep_last, mode, protect) == kept  # order is irrelevant

    store = CheckpointStore(tmp_path / "checkpoints")
    for step in M:
        save(store, step)
    deleted = store.apply_retention(dict(checkpoints), keep_top, keep_last, mode, protect)
    assert deleted == sorted(set(M) - kept)
    assert store.complete_steps() == sorted(kept)
    assert {p.name for p in store.root.iterdir()} == {f"step_{s:08d}" for s in kept}


def test_retention_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        retained([(100, 0.1), (100, 0.2)], 1, 1, "min")
    with pytest.raises(ValueError, match=">= 0"):
        retained([(100, 0.1)], -1, 1, "min")
    with pytest.raises(ValueError, match="mode"):
        retained([(100, 0.1)], 1, 1, "best")  # type: ignore[arg-type]
    assert retained([], 1, 1, "min") == set()


def reference_rule(
    checkpoints: list[tuple[int, float | None]], keep_top: int, keep_last: int, mode: str, protect: set[int]
) -> set[int]:
    """docs/semantics.md §6 written independently of the implementation: ranks by counting who beats whom."""
    steps = {s for s, _ in checkpoints}
    if not steps or keep_top == keep_last == 0:
        return steps

    def beats(a: tuple[int, float], b: tuple[int, float]) -> bool:
        if a[1] != b[1]:
            return a[1] < b[1] if mode == "min" else a[1] > b[1]
        return a[0] > b[0]

    ranked = [(s, m) for s, m in checkpoints if m is not None and math.isfinite(m)]
    rank = {c[0]: sum(beats(o, c) for o in ranked) for c in ranked}
    top_n = {s for s, r in rank.items() if r < keep_top}
    best = {s for s, r in rank.items() if r == 0}
    last_n = {s for s in steps if sum(o > s for o in steps) < keep_last}
    return top_n | last_n | best | {max(steps)} | (protect & steps)


metric_values = st.one_of(
    st.none(),
    st.sampled_from([0.1, 0.5, 0.9, math.nan, math.inf, -math.inf]),  # ties and non-finite values
    st.floats(-10, 10, allow_nan=False),
)
histories = st.lists(st.tuples(st.integers(1, 500), metric_values), max_size=12).map(
    # Strictly increasing steps, as a run saves them.
    lambda gaps: [(sum(g for g, _ in gaps[: i + 1]), m) for i, (_, m) in enumerate(gaps)]
)


@settings(max_examples=300, deadline=None)
@given(
    history=histories,
    keep_top=st.integers(0, 4),
    keep_last=st.integers(0, 4),
    mode=st.sampled_from(["min", "max"]),
    data=st.data(),
)
def test_retention_keeps_exactly_the_rule(
    history: list[tuple[int, float | None]], keep_top: int, keep_last: int, mode: Any, data: st.DataObject
) -> None:
    steps = [s for s, _ in history]
    protect = set(data.draw(st.lists(st.sampled_from(steps), max_size=2))) if steps else set()
    kept = retained(data.draw(st.permutations(history)), keep_top, keep_last, mode, protect)
    assert kept == reference_rule(history, keep_top, keep_last, mode, protect)
    if steps:
        assert max(steps) in kept
        assert protect <= kept
    finite = [(s, m) for s, m in history if m is not None and math.isfinite(m)]
    if finite:
        best_value = min(m for _, m in finite) if mode == "min" else max(m for _, m in finite)
        assert max(s for s, m in finite if m == best_value) in kept


@settings(max_examples=25, deadline=None)
@given(
    history=histories,
    keep_top=st.integers(0, 3),
    keep_last=st.integers(0, 3),
    mode=st.sampled_from(["min", "max"]),
    resume_at=st.integers(0, 12),
)
def test_apply_retention_during_a_run(
    history: list[tuple[int, float | None]], keep_top: int, keep_last: int, mode: Any, resume_at: int
) -> None:
    """Save, prune (metric not known yet), validate, prune again, as the trainer does; a run resumed
    from an earlier checkpoint protects it."""
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp) / "checkpoints")
        metrics: dict[int, float | None] = {}
        best: tuple[float, int] | None = None  # (value towards better, step) of the best ever saved
        protect: set[int] = set()
        for i, (step, metric) in enumerate(history):
            if i == resume_at and store.complete_steps():
                protect = {store.complete_steps()[-1]}
            save(store, step)
            for known in (None, metric):
                metrics[step] = known
                before = [(s, metrics.get(s)) for s in store.complete_steps()]
                deleted = store.apply_retention(metrics, keep_top, keep_last, mode, protect)
                expected = reference_rule(before, keep_top, keep_last, mode, protect)
                assert set(store.complete_steps()) == expected
                assert deleted == sorted({s for s, _ in before} - expected)
            if metric is not None and math.isfinite(metric):
                candidate = (metric if mode == "min" else -metric, -step)
                best = candidate if best is None or candidate < best else best
            assert step in store.complete_steps()
            assert protect <= set(store.complete_steps())
            assert best is None or -best[1] in store.complete_steps()
        if history:  # nothing left behind but committed checkpoints
            assert sorted(p.name for p in store.root.iterdir()) == [
                f"step_{s:08d}" for s in store.complete_steps()
            ]
