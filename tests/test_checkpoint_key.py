"""The checkpoint key (``LINNAEUS_CHECKPOINT_KEY``) never strands a run.

- A key that none of the run's checkpoints is signed with (mistyped, or set for a run whose
  checkpoints were written without one) is refused in one sentence (exit 2) and moves nothing: the
  rerun with the right key resumes. Locally and from the bucket (b2sdk's simulator).
- A checkpoint that fails on the key while others verify is still moved to ``rejected/``.
- A signed run resumed without the key resumes, and says that nothing was checked or signed.
- A key set but empty, or not the same on every process (2 gloo processes), is refused before
  anything is written, on every process alike.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from accelerate import debug_launcher
from b2sdk.v2 import B2Api, B2HttpApiConfig, InMemoryAccountInfo, RawSimulator
from helpers.checkpoints import save
from helpers.in_process import run_cli
from helpers.runs import TrainRun, assert_resumed_from

from linnaeus_accel.checkpoint.bucket.remote import KEY_ID_VAR, KEY_VAR, RemoteCheckpoints, RetryPolicy
from linnaeus_accel.checkpoint.directory import MARKER, CheckpointStore, read_marker
from linnaeus_accel.checkpoint.directory.marker import KEY_ENV, SIGNATURE
from linnaeus_accel.checkpoint.resume.find import ResumeRefused, find_checkpoint
from linnaeus_accel.config import ConfigError

KEY = "the secret the run's jobs hold"
TYPO = "the secret the run's jobs hold "
STEP_12 = "step_00000012"
DIGITS = [
    *("TRAIN.EPOCHS", "3", "DATA.BATCH_SIZE", "256", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"),
    *("SCHEDULE.CHECKPOINT.KEEP_LAST_N", "3", "SCHEDULE.CHECKPOINT.KEEP_TOP_N", "0"),
]  # 6 steps an epoch: checkpoints at 6, 12, 18


def use_key(monkeypatch: pytest.MonkeyPatch, key: str | None) -> None:
    if key is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, key)


def listing(root: Path) -> list[str]:
    """Every path under ``root``: what a refusal must leave as it was."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def refusal(refused: pytest.ExceptionInfo[ResumeRefused]) -> str:
    [(key, message)] = refused.value.problems
    assert key == KEY_ENV
    return message


# -- which checkpoint resumes (no training) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("written_with", "set_now", "how"),
    [
        (KEY, TYPO, "their signature does not match it"),
        (None, KEY, "they carry no signature"),
    ],
    ids=["mistyped", "set-for-unsigned"],
)
def test_a_key_that_signed_none_of_the_checkpoints_is_refused_and_moves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written_with: str | None, set_now: str, how: str
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    use_key(monkeypatch, written_with)
    for step in (6, 12, 18):
        save(store, step)
    before = listing(store.root)
    use_key(monkeypatch, set_now)
    with pytest.raises(ResumeRefused) as refused:
        find_checkpoint(store, None, True, None)
    assert refusal(refused) == (
        f"{KEY_ENV} is set but none of the 3 checkpoints in {store.root} is signed with it ({how}): set "
        f"{KEY_ENV} to the key they were written with, or unset it if they were written without one "
        "(nothing was moved)"
    )
    assert listing(store.root) == before
    use_key(monkeypatch, written_with)
    assert find_checkpoint(store, None, True, None) == (store.final_path(18), [])


def test_when_the_key_signed_one_of_them_the_others_are_rejected_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    use_key(monkeypatch, KEY)
    save(store, 6)
    save(store, 12)
    use_key(monkeypatch, None)
    save(store, 18)  # written without the key: by someone who does not hold it
    use_key(monkeypatch, KEY)
    path, skipped = find_checkpoint(store, None, True, None)
    assert path == store.final_path(12)
    assert "step_00000018: COMMITTED.json is not signed" in skipped[0]
    assert (store.rejected_root / "step_00000018" / MARKER).is_file()

    # None verifies, but the one signed with the key is damaged: the key is right, and the
    # unsigned one is not trusted.
    store = CheckpointStore(tmp_path / "other" / "checkpoints")
    (save(store, 6) / "optimizer.bin").write_bytes(b"cut")
    use_key(monkeypatch, None)
    save(store, 12)
    use_key(monkeypatch, KEY)
    with pytest.raises(ResumeRefused) as refused:
        find_checkpoint(store, None, True, None)
    assert f"none of the 2 checkpoints in {store.root} verifies" in str(refused.value)
    assert not store.complete_steps()
    assert len(store.rejected_checkpoints()) == 2


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> RemoteCheckpoints:
    """A bucket in b2sdk's in-memory simulator, its credentials in the environment."""
    api = B2Api(InMemoryAccountInfo(), api_config=B2HttpApiConfig(_raw_api_class=RawSimulator))
    account_id, master_key = api.session.raw_api.create_account()
    api.authorize_account("production", account_id, master_key)
    api.create_bucket("runs", "allPrivate")
    key = api.create_key(["listBuckets", "listFiles", "readFiles", "writeFiles", "deleteFiles"], "jobs")
    monkeypatch.setenv(KEY_ID_VAR, key.id_)
    monkeypatch.setenv(KEY_VAR, key.application_key)
    return RemoteCheckpoints.from_environment("runs", "team", "exp", api=api, retry=RetryPolicy(2, 0.0, 0.0))


def test_checkpoints_from_the_bucket_that_fail_only_on_the_key_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bucket: RemoteCheckpoints
) -> None:
    machine_a = CheckpointStore(tmp_path / "a" / "checkpoints")
    use_key(monkeypatch, KEY)
    for step in (6, 12):
        bucket.upload(save(machine_a, step))
    use_key(monkeypatch, None)
    bucket.upload(save(machine_a, 18))  # put there by someone who does not hold the key

    # A fresh machine with a mistyped key: refused, nothing rejected, the downloads kept.
    machine_b = CheckpointStore(tmp_path / "b" / "checkpoints")
    use_key(monkeypatch, TYPO)
    with pytest.raises(ResumeRefused) as refused:
        find_checkpoint(machine_b, bucket, True, None)
    assert refusal(refused).startswith(f"{KEY_ENV} is set but none of the 3 checkpoints in {machine_b.root}")
    assert not machine_b.rejected_root.exists()
    assert machine_b.complete_steps() == [6, 12, 18]

    # With the right key on another fresh machine: the unsigned one is rejected, 12 resumes.
    machine_c = CheckpointStore(tmp_path / "c" / "checkpoints")
    use_key(monkeypatch, KEY)
    path, skipped = find_checkpoint(machine_c, bucket, True, None)
    assert path == machine_c.final_path(12)
    assert skipped[0].startswith(
        "step_00000018 from the bucket does not verify: COMMITTED.json is not signed"
    )
    assert skipped[-1] == "none locally; downloaded step 12 from the bucket"
    assert (machine_c.rejected_root / "step_00000018" / MARKER).is_file()
    # And the first machine's downloads, with the right key: resumed without downloading again.
    assert find_checkpoint(machine_b, None, True, None)[0] == machine_b.final_path(12)
    assert [p.name for p in machine_b.rejected_checkpoints()] == ["step_00000018"]


# -- every process agrees ----------------------------------------------------------------------------


def _agree(out: str, keys: list[str | None]) -> None:
    """On each of the debug launcher's gloo processes: its own key, then the start's check."""
    import torch.distributed as dist
    from accelerate import PartialState

    from linnaeus_accel.checkpoint.signing import agree_on_key

    rank = dist.get_rank()
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    PartialState._reset_state()  # forked from this test process
    PartialState(cpu=True)
    if keys[rank] is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = str(keys[rank])
    try:
        agree_on_key()
        said = "agreed"
    except ConfigError as exc:
        said = str(exc)
    Path(out, f"rank{rank}").write_text(said, encoding="utf-8")


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ([KEY, None], "(process 0 has it set and process 1 does not: exported on one machine only?)"),
        ([None, KEY], "(process 1 has it set and process 0 does not: exported on one machine only?)"),
        ([KEY, TYPO], "(processes 0 and 1 hold different keys)"),
        ([KEY, ""], f"{KEY_ENV} is set but empty on process 1"),
        ([KEY, KEY], None),
        ([None, None], None),
    ],
    ids=["main-only", "other-only", "different", "empty", "same", "none"],
)
def test_the_key_is_the_same_on_every_process_or_every_process_stops(
    tmp_path: Path, fresh_accelerate_state: None, keys: list[str | None], problem: str | None
) -> None:
    debug_launcher(_agree, args=(str(tmp_path), keys), num_processes=2)
    said = [(tmp_path / f"rank{rank}").read_text(encoding="utf-8") for rank in (0, 1)]
    assert said[0] == said[1]  # the same error everywhere: none waits for the other
    if problem is None:
        assert said[0] == "agreed"
    else:
        assert problem in said[0]


# -- the command line --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    """The run uninterrupted, signed."""
    run = TrainRun(tmp_path_factory.mktemp("reference"), DIGITS)
    run.run(extra_env={KEY_ENV: KEY}).check_ok()
    return run


@pytest.fixture(scope="module")
def signed_killed(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    """The run signed with ``KEY`` and killed -9 right after its checkpoint at step 12."""
    run = TrainRun(tmp_path_factory.mktemp("signed"), DIGITS)
    run.run(kill_at="checkpoint_committed:2", extra_env={KEY_ENV: KEY}).check_killed()
    return run


def train(run: TrainRun) -> tuple[int, str]:
    """``linnaeus-accel train`` of ``run``, in this process (a refusal needs no new interpreter)."""
    rc, _, err = run_cli(*run.command([], None)[3:])
    return rc, err


@pytest.mark.slow
def test_a_mistyped_key_exits_2_moving_nothing_and_the_right_key_resumes(
    signed_killed: TrainRun,
    reference: TrainRun,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_accelerate_state: None,
) -> None:
    run = signed_killed.clone(tmp_path / "run")
    before = listing(run.dir / "checkpoints")
    use_key(monkeypatch, TYPO)
    rc, err = train(run)
    assert rc == 2, err
    assert err == (
        f"linnaeus-accel: invalid resume (1 problem):\n  {KEY_ENV} is set but none of the 2 checkpoints in "
        f"{run.dir / 'checkpoints'} is signed with it (their signature does not match it): set {KEY_ENV} to "
        "the key they were written with, or unset it if they were written without one (nothing was moved)\n"
    )
    assert listing(run.dir / "checkpoints") == before

    resumed = run.run(extra_env={KEY_ENV: KEY}).check_ok()
    assert_resumed_from(resumed.output, 12)
    assert (run.dir / "final" / "model.safetensors").read_bytes() == (
        reference.dir / "final" / "model.safetensors"
    ).read_bytes()


@pytest.mark.slow
def test_without_the_key_a_signed_run_resumes_and_says_so(
    signed_killed: TrainRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = signed_killed.clone(tmp_path / "run")
    use_key(monkeypatch, None)  # the run inherits the test's environment
    resumed = run.run().check_ok()
    assert_resumed_from(resumed.output, 12)
    assert (
        f"{STEP_12} is signed, but {KEY_ENV} is not set: its signature was not checked, and the checkpoints "
        f"this run writes are unsigned (set {KEY_ENV} to the key it was signed with, to check and sign them)"
    ) in resumed.output.splitlines()
    assert SIGNATURE not in read_marker(run.dir / "checkpoints" / "step_00000018")


@pytest.mark.slow
def test_a_key_set_on_a_run_written_without_one_is_refused_moving_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_accelerate_state: None
) -> None:
    run = TrainRun(tmp_path, DIGITS)
    use_key(monkeypatch, None)
    run.run(kill_at="checkpoint_committed:1").check_killed()
    before = listing(run.dir / "checkpoints")
    use_key(monkeypatch, KEY)
    rc, err = train(run)
    assert rc == 2, err
    assert (
        f"{KEY_ENV} is set but the checkpoint in {run.dir / 'checkpoints'} is not signed with it (it carries "
        f"no signature): set {KEY_ENV} to the key it was written with, or unset it if it was written without "
        "one (nothing was moved)"
    ) in err
    assert listing(run.dir / "checkpoints") == before


@pytest.mark.slow
def test_an_empty_key_is_refused_before_anything_is_written(
    signed_killed: TrainRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_accelerate_state: None
) -> None:
    run = signed_killed.clone(tmp_path / "run")
    before = {p: p.stat().st_mtime_ns for p in run.dir.rglob("*") if p.name != ".lock"}
    use_key(monkeypatch, "")
    rc, err = train(run)
    assert rc == 2, err
    assert err == (
        f"linnaeus-accel: invalid environment (1 problem):\n  {KEY_ENV} is set but empty (a secret the job "
        f"script could not read?): set it to the key the run's checkpoints are signed with, or unset it for "
        "unsigned checkpoints\n"
    )
    assert {p: p.stat().st_mtime_ns for p in run.dir.rglob("*") if p.name != ".lock"} == before
