"""Checkpoint integrity end to end: what a resume reads is verified, nothing that might be the only
copy is destroyed, and a full or read-only disk is named.

- Every checkpoint failing verification: the rerun refuses (exit 2, naming each problem) instead
  of starting over from step 0, the checkpoints are moved intact to ``checkpoints/rejected/``;
  ``--overwrite`` starts over.
- Content the manifest does not cover is never trusted: a stray file (a ``custom_checkpoint_0.pkl``
  that Accelerate would load), a journal line without metrics, with made-up values or binary junk,
  and re-sealed manifests over a ``trainer_state.json`` that is not an object, has version 99 or
  a ``global_step`` that disagrees with the directory: the checkpoint (or the journal line and
  those after it) is skipped with the reason, and the run ends exactly as an uninterrupted one.
- A corrupt ``summary.json`` and garbage lines in ``metrics.jsonl`` do not stop a rerun.
- A full disk (a small tmpfs in a user+mount namespace, with 1 and 2 processes) and a read-only one
  while checkpointing: ``CheckpointWriteError`` naming ENOSPC / EROFS and the path on every
  process, no staging directory left, the previous checkpoint still verifies. The same when the
  commit itself (the marker write) runs out of space. With the whole output directory on the
  tmpfs, filled at a fault point while checkpoints are written in the background: whatever file
  the full disk hits (metrics.jsonl, alone or with the background checkpoint write, final/,
  summary.json), one sentence naming it, no partial checkpoint or final/ left, and a rerun with
  space resumes and ends exactly as an uninterrupted run.

Real runs of ``linnaeus-accel train`` on real files; nothing of ours is mocked. A run is a
``python -m linnaeus_accel`` subprocess where the behaviour needs a process of its own (a kill at a
fault point, a launcher, the tmpfs's namespace); the others (the reference, refusals, resumes) run
in this process, whose torch is imported already: that import is most of a subprocess's cost.
The first part checks the pure validation functions (fast).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import DEFAULT_CONFIG, REPO
from helpers.in_process import run_here
from helpers.processes import read_log
from helpers.runs import (
    RUN_TIMEOUT_S,
    Result,
    TrainRun,
    assert_resumed_from,
    assert_same_run,
    committed,
    is_val,
    journal,
    read_metrics,
    read_summary,
)

from linnaeus_accel.checkpoint.directory import MARKER, CheckpointStore, file_digest
from linnaeus_accel.checkpoint.save.writer import checkpoint_store
from linnaeus_accel.checkpoint.state.files import (
    STATE_VERSION,
    decode_journal,
    encode_journal_entry,
    rank_state_problem,
    state_problem,
)
from linnaeus_accel.config import load_config
from linnaeus_accel.run_directory.outputs import output_problem

# The default config with batch 128 on one process: 12 optimizer steps per epoch, 2 epochs;
# checkpoints at steps 12 and 24 (the epoch boundaries). Validation passes: epoch 1: standard,
# mask-meta and the two whitelisted partial passes (4); epoch 2 (final): standard, mask-meta and
# the 6 exhaustive partial passes (8). A run takes about 3 s.
OPTS = [
    "TRAIN.EPOCHS", "2",
    "DATA.BATCH_SIZE", "128",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1",
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS", "1",
    "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_EPOCHS", "1",
]  # fmt: skip
EPOCH1_PASSES = ["val", "val_mask_meta", "val_mask_ROWS", "val_mask_COLS_MOMENTS"]
STEP12, STEP24 = "step_00000012", "step_00000024"
NOT_IN_MANIFEST = "not in COMMITTED.json (nothing but what was committed is read)"


# ---------------------------------------------------------------------------------------------
# The validation functions (pure)
# ---------------------------------------------------------------------------------------------


def good_state(step: int = 24) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "progress": {
            "version": 1,
            "total_epochs": 2,
            "expected_total_steps": 24,
            "current_stage": "TRAINING",
            "epoch": 2,
            "global_step": step,
            "batches_seen_in_epoch": 0,
            "samples_seen": 2876,
            "tokens_seen": 0,
            "pending_validations": ["VALIDATION_NORMAL"],
            "completed_validations": [],
            "partial_validation_indices": [0, 1],
            "completed_partial_indices": [],
            "best_metric": {"name": "val/loss", "value": 1.2, "step": 12},
        },
        "early_stopping": {"version": 1, "metric": "val/loss", "best": 1.2, "step_of_best": 12},
        "gradnorm": None,
        "boundary": {"epoch": 2, "final": True},
        "wandb_run_id": None,
        "plan": {"total_steps": 24, "world_size": 1, "accumulation": 1, "batch_size": 128},
        "checkpoint_metrics": {"12": 1.2, "24": None},
    }


def changed(path: str, value: Any) -> dict[str, Any]:
    state = good_state()
    *parents, last = path.split(".")
    target = state
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return state


STATE_PROBLEMS = [
    ("not an object", [], "trainer_state.json is not a JSON object"),
    ("version 99", changed("version", 99), "has version 99; this linnaeus-accel reads version 1"),
    ("no version", changed("version", KeyError), "has version null"),
    ("progress missing", changed("progress", KeyError), "progress must be an object, got null"),
    ("step disagrees", changed("progress.global_step", 23), "progress.global_step is 23 but the checkpoint is for step 24"),
    ("step a string", changed("progress.global_step", "24"), 'progress.global_step must be an integer >= 0, got "24"'),
    ("step a bool", changed("progress.global_step", True), "progress.global_step must be an integer >= 0, got true"),
    ("no epoch", changed("progress.epoch", KeyError), "progress.epoch is missing"),
    ("negative batches", changed("progress.batches_seen_in_epoch", -1), "batches_seen_in_epoch must be an integer >= 0"),
    ("unknown stage", changed("progress.current_stage", "NAPPING"), "progress.current_stage must be one of"),
    ("bad pending", changed("progress.pending_validations", ["X"]), "pending_validations must be a list of stages"),
    ("bad best metric", changed("progress.best_metric", {"name": 1}), "best_metric must be null or {name, value, step}"),
    ("early stopping a list", changed("early_stopping", [1]), "early_stopping must be an object or null"),
    ("early stopping best", changed("early_stopping.best", "low"), "early_stopping.best must be a number or null"),
    ("gradnorm weights", changed("gradnorm", {"weights": ["a"]}), "gradnorm.weights must be a list of numbers"),
    ("boundary without final", changed("boundary.final", KeyError), "boundary.final is missing"),
    ("boundary epoch", changed("boundary.epoch", 1.5), "boundary.epoch must be an integer >= 0"),
    ("plan batch 0", changed("plan.batch_size", 0), "plan.batch_size must be an integer >= 1"),
    ("wandb id", changed("wandb_run_id", 5), "wandb_run_id must be a string or null"),
    # The stored config is reviewed against the new one on resume: it must be an object.
    ("config", changed("config", [1]), "config must be an object or null"),
    ("plan length", changed("plan.batches_per_epoch", 0), "plan.batches_per_epoch must be an integer >= 1"),
    ("metrics keys", changed("checkpoint_metrics", {"x": 1.0}), "checkpoint_metrics must map steps to numbers"),
    ("metrics values", changed("checkpoint_metrics", {"12": "low"}), "checkpoint_metrics must map steps to numbers"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("state", "problem"), [p[1:] for p in STATE_PROBLEMS], ids=[p[0] for p in STATE_PROBLEMS]
)
def test_state_problem_names_what_is_wrong(state: Any, problem: str) -> None:
    found = state_problem(state, 24)
    assert found is not None
    assert problem in found


def test_a_state_the_trainer_wrote_is_fine() -> None:
    assert state_problem(good_state(), 24) is None
    minimal = {"version": 1, "progress": {"global_step": 0, "epoch": 0, "batches_seen_in_epoch": 0}}
    assert state_problem(minimal, 0) is None
    assert (
        rank_state_problem({"version": 1, "meter": {"sums": [1.0, 2.0], "steps": 3}, "data": None}, 0) is None
    )
    assert rank_state_problem({"version": 1}, 3) is None
    assert rank_state_problem("x", 1) == "rank_00001.json is not a JSON object"
    assert rank_state_problem({"version": 2}, 0) == (
        "rank_00000.json has version 2; this linnaeus-accel reads version 1"
    )
    assert "meter.sums must be a list of numbers" in str(
        rank_state_problem({"version": 1, "meter": {"sums": "x"}}, 0)
    )
    assert "data must be an object or null" in str(rank_state_problem({"version": 1, "data": []}, 0))


def test_journal_lines_verify_against_their_checkpoint() -> None:
    binding = hashlib.sha256(b"a marker").hexdigest()
    lines = [
        encode_journal_entry("val", {"val/loss": 0.5, "val/acc": 1}, binding),
        encode_journal_entry("val_mask_meta", {"val_mask_meta/loss": math.nan}, binding),  # a diverged model
    ]
    data = "".join(lines).encode()
    entries, valid, problem = decode_journal(data, binding)
    assert problem is None
    assert valid == len(data)
    assert entries[0] == {"prefix": "val", "metrics": {"val/loss": 0.5, "val/acc": 1.0}}
    assert entries[1]["prefix"] == "val_mask_meta"
    assert math.isnan(entries[1]["metrics"]["val_mask_meta/loss"])

    # Lines of another checkpoint (another marker) do not verify here.
    assert decode_journal(data, "another")[0:2] == ([], 0)
    # A line cut by a kill: the lines before it count.
    assert decode_journal(data[:-5], binding)[0:3:2] == (entries[:1], "line 2 is incomplete (cut by a kill?)")

    def tampered(change: Callable[[dict[str, Any]], Any]) -> tuple[list[dict[str, Any]], int, str | None]:
        first = json.loads(lines[0])
        change(first)
        return decode_journal((json.dumps(first) + "\n" + lines[1]).encode(), binding)

    for change, problem in [
        (lambda e: e.pop("metrics"), "line 1 is malformed: metrics must be an object, got null"),
        (lambda e: e["metrics"].update({"val/loss": 0.01}), "line 1 (val) does not match its sha256"),
        (
            lambda e: e["metrics"].update({"val/loss": "low"}),
            "line 1 is malformed: metric 'val/loss' must be a number",
        ),
        (lambda e: e.update(prefix=7), "line 1 is malformed: prefix must be a non-empty string, got 7"),
        (lambda e: e.pop("sha256"), "line 1 has no sha256"),
        (lambda e: e.update(extra=1), "line 1 has unexpected fields ['extra']"),
    ]:
        entries_after, valid_after, found = tampered(change)
        assert (entries_after, valid_after) == ([], 0)  # that line and every line after it are ignored
        assert found is not None
        assert found.startswith(problem), found
    for junk in (b"5\n", b"[]\n", b"\x00\xff\xfe junk\n", b'{"prefix": "val"\n'):
        assert decode_journal(junk + data, binding)[0:2] == ([], 0)
    with pytest.raises(ValueError, match="must be a number"):
        encode_journal_entry("val", {"val/loss": "x"}, binding)  # type: ignore[dict-item]


def test_a_corrupt_summary_is_moved_aside_and_does_not_stop_a_rerun(tmp_path: Path) -> None:
    config = load_config(DEFAULT_CONFIG, ["ENV.OUTPUT.BASE_DIR", str(tmp_path), "EXPERIMENT.NAME", "run"])
    out = config.output_dir
    out.mkdir(parents=True)
    for damage in (b'{"status": "compl', b"\x00\xff\xfe", b"[]", b'{"status": 5}', b"[" * 100_000):
        (out / "summary.json").write_bytes(damage)
        assert output_problem(config.output_dir, config.TRAIN, None) is None
        assert not (out / "summary.json").exists()
    kept = sorted(p.name for p in out.iterdir())
    assert kept == ["summary.json.corrupt", *[f"summary.json.corrupt.{n}" for n in range(2, 6)]]
    assert (out / "summary.json.corrupt").read_bytes() == b'{"status": "compl'
    for resumable in ("preempted", "failed"):  # failed: e.g. a full disk, freed since
        (out / "summary.json").write_text(json.dumps({"status": resumable}))
        assert output_problem(config.output_dir, config.TRAIN, None) is None
        assert (out / "summary.json").is_file()
    (out / "summary.json").write_text('{"status": "completed"}')
    problem = output_problem(config.output_dir, config.TRAIN, None)
    assert problem is not None
    assert "already holds a finished run" in problem[1]


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    result = run_here(TrainRun(tmp_path_factory.mktemp("reference"), OPTS)).check_ok()
    assert read_summary(result.dir)["global_step"] == 24
    assert committed(result.dir) == [STEP12, STEP24]
    return result


@pytest.fixture(scope="module")
def killed_after_final_commit(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    """Killed right after committing step 24 (before its validation): steps 12 (journal complete)
    and 24 are committed. Clone it."""
    run = TrainRun(tmp_path_factory.mktemp("killed_final_commit"), OPTS)
    run.run(kill_at="checkpoint_committed:2").check_killed()
    assert committed(run.dir) == [STEP12, STEP24]
    assert journal(run.dir / "checkpoints" / STEP12) == EPOCH1_PASSES
    return run


@pytest.fixture(scope="module")
def killed_mid_validation(tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    """Killed right after the 2nd validation pass of epoch 1 was journalled (of 4)."""
    run = TrainRun(tmp_path_factory.mktemp("killed_mid_validation"), OPTS)
    run.run(kill_at="validation_pass:2").check_killed()
    assert committed(run.dir) == [STEP12]
    assert journal(run.dir / "checkpoints" / STEP12) == EPOCH1_PASSES[:2]
    return run


def file_digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def flip_byte(file: Path, at: int = 100) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


def skipped_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "skipping checkpoint" in line]


def no_traceback(result: Result) -> None:
    assert "Traceback" not in result.output, result.tail()


@pytest.mark.slow
def test_every_checkpoint_failing_verification_refuses_to_start_over_and_keeps_them(
    killed_after_final_commit: TrainRun, reference: Result, tmp_path: Path
) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    checkpoints = run.dir / "checkpoints"
    for name in (STEP12, STEP24):
        flip_byte(checkpoints / name / "optimizer.bin")  # the model weights are still intact
    before = {name: file_digests(checkpoints / name) for name in (STEP12, STEP24)}
    metrics_before = (run.dir / "metrics.jsonl").read_bytes()

    refused = run_here(run)
    assert refused.returncode == 2, refused.tail()
    no_traceback(refused)
    assert f"none of the 2 checkpoints in {checkpoints} verifies" in refused.output
    for name in (STEP12, STEP24):
        assert f"{name}: optimizer.bin: checksum mismatch" in refused.output
    assert f"moved to {checkpoints / 'rejected'}" in refused.output
    assert "--overwrite" in refused.output
    assert "removed checkpoints" not in refused.output
    # Nothing deleted, nothing changed: every byte is in rejected/, with a note saying why.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["rejected"]
    for name in (STEP12, STEP24):
        moved = checkpoints / "rejected" / name
        after = file_digests(moved)
        note = after.pop("REJECTED.txt")
        assert after == before[name]
        assert note
        assert "optimizer.bin: checksum mismatch" in (moved / "REJECTED.txt").read_text()
    assert (run.dir / "metrics.jsonl").read_bytes() == metrics_before
    assert not (run.dir / "summary.json").exists()

    # Asking again does not start over either.
    again = run_here(run)
    assert again.returncode == 2, again.tail()
    assert "failed verification before" in again.output
    assert sorted(p.name for p in (checkpoints / "rejected").iterdir()) == [STEP12, STEP24]

    # --overwrite starts over (and removes them).
    fresh = run_here(run, args=["--overwrite"])
    assert not any(line.startswith("resumed from") for line in fresh.output.splitlines())
    assert_same_run(fresh, reference)
    assert not (checkpoints / "rejected").exists()


class _Planted:
    """Unpickling this creates ``path``: proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_file_outside_the_manifest_skips_that_checkpoint(
    killed_after_final_commit: TrainRun, reference: Result, tmp_path: Path
) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    flag = tmp_path / "PWNED"
    payload = pickle.dumps(_Planted(str(flag)), protocol=2)
    newest = run.dir / "checkpoints" / STEP24
    # What Accelerate's load_state would unpickle, or refuse with an error (a crash loop).
    (newest / "custom_checkpoint_0.pkl").write_bytes(payload)

    resumed = run_here(run)
    assert not flag.exists(), f"a planted pickle was executed\n{resumed.tail()}"
    (line,) = skipped_lines(resumed.output)
    assert f"{STEP24}: custom_checkpoint_0.pkl: {NOT_IN_MANIFEST}; using {STEP12}; moved to " in line
    assert_resumed_from(resumed.output, 12)
    assert_same_run(resumed, reference)
    kept = run.dir / "checkpoints" / "rejected" / STEP24
    assert (kept / "custom_checkpoint_0.pkl").read_bytes() == payload
    assert (kept / MARKER).is_file()


def _drop_metrics(lines: list[bytes]) -> int:
    entry = json.loads(lines[0])
    del entry["metrics"]
    lines[0] = json.dumps(entry).encode()
    return 1


def _made_up_values(lines: list[bytes]) -> int:
    entry = json.loads(lines[1])
    entry["metrics"] = dict.fromkeys(entry["metrics"], 0.001)  # a better loss than the truth
    lines[1] = json.dumps(entry).encode()
    return 2


def _binary_junk(lines: list[bytes]) -> int:
    lines[1] = b"\x00\xff\xfe\x80 junk"
    return 2


JOURNAL_DAMAGE = [
    pytest.param(_drop_metrics, "line 1 is malformed: metrics must be an object, got null", id="no-metrics"),
    pytest.param(_made_up_values, "line 2 (val_mask_meta) does not match its sha256", id="made-up-values"),
    pytest.param(_binary_junk, "line 2 is not JSON", id="binary-junk"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("damage", "problem"), JOURNAL_DAMAGE)
def test_a_journal_line_that_does_not_verify_is_ignored_and_its_pass_run_again(
    damage: Callable[[list[bytes]], int],
    problem: str,
    killed_mid_validation: TrainRun,
    reference: Result,
    tmp_path: Path,
) -> None:
    run = killed_mid_validation.clone(tmp_path)
    boundary = run.dir / "checkpoints" / STEP12
    path = boundary / "validation_journal.jsonl"
    lines = path.read_bytes().splitlines()
    bad = damage(lines)
    path.write_bytes(b"\n".join(lines) + b"\n")

    resumed = run_here(run)
    no_traceback(resumed)
    assert f"validation journal of {STEP12}: {problem}" in resumed.output, resumed.tail()
    assert_resumed_from(resumed.output, 12)
    # The passes from the bad line on ran again: the journal now holds each pass once, all valid.
    assert journal(boundary) == EPOCH1_PASSES
    assert "validation journal" not in "".join(skipped_lines(resumed.output))
    records = [r for r in read_metrics(run.dir) if r["global_step"] == 12 and is_val(r)]
    (ref_record,) = [r for r in read_metrics(reference.dir) if r["global_step"] == 12 and is_val(r)]
    assert records == [ref_record]  # the real values, not the made-up ones
    assert_same_run(resumed, reference)
    if bad == 2:  # a line that is not a kill's half line is kept for whoever investigates
        dropped = run.dir / "checkpoints" / "rejected" / f"{STEP12}.validation_journal.jsonl.dropped"
        assert dropped.read_bytes() == lines[1] + b"\n"


def reseal(checkpoint: Path) -> None:
    """Recompute COMMITTED.json for the files as they are now (someone who edited them on purpose)."""
    marker = json.loads((checkpoint / MARKER).read_text(encoding="utf-8"))
    for entry in marker["files"]:
        data = (checkpoint / entry["path"]).read_bytes()
        entry.update(dict([file_digest(data)]), size=len(data))
    (checkpoint / MARKER).write_text(json.dumps(marker), encoding="utf-8")


def _set_state(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        file = checkpoint / "trainer_state.json"
        state = json.loads(file.read_text(encoding="utf-8"))
        state = change(state) or state
        file.write_text(json.dumps(state), encoding="utf-8")

    return edit


RESEALED = [
    pytest.param(_set_state(lambda s: [s]), "trainer_state.json is not a JSON object", id="not-an-object"),
    pytest.param(
        _set_state(lambda s: s.update(version=99)),
        "trainer_state.json has version 99; this linnaeus-accel reads version 1",
        id="version-99",
    ),
    pytest.param(
        _set_state(lambda s: s["progress"].update(global_step=23)),
        "trainer_state.json: progress.global_step is 23 but the checkpoint is for step 24",
        id="global-step-disagrees",
    ),
    pytest.param(
        lambda c: (c / "rank_00000.json").write_text('{"version": 1, "meter": "x"}'),
        "rank_00000.json: meter must be an object or null",
        id="rank-file",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("edit", "problem"), RESEALED)
def test_a_resealed_checkpoint_with_a_state_we_did_not_write_is_skipped(
    edit: Callable[[Path], None],
    problem: str,
    killed_after_final_commit: TrainRun,
    reference: Result,
    tmp_path: Path,
) -> None:
    run = killed_after_final_commit.clone(tmp_path)
    newest = run.dir / "checkpoints" / STEP24
    edit(newest)
    reseal(newest)
    # Its files are all as (re)sealed: only our own validation of the state can refuse it.
    assert CheckpointStore(newest.parent, journal="validation_journal.jsonl").verify(newest) is None

    resumed = run_here(run)
    no_traceback(resumed)
    (line,) = skipped_lines(resumed.output)
    assert f"{STEP24}: {problem}" in line, line
    assert f"using {STEP12}" in line
    assert_resumed_from(resumed.output, 12)
    assert_same_run(resumed, reference)
    assert (run.dir / "checkpoints" / "rejected" / STEP24 / MARKER).is_file()


@pytest.mark.slow
def test_a_corrupt_summary_and_garbage_metrics_lines_do_not_stop_a_rerun(
    reference: Result, tmp_path: Path
) -> None:
    run = TrainRun(tmp_path, OPTS)
    shutil.copytree(reference.dir.parent, run.base, symlinks=True)
    corrupt = b'{"global_step": 24, "status": "compl\x00\xff'
    (run.dir / "summary.json").write_bytes(corrupt)
    lines = (run.dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    garbage = [b"5\n", b"[]\n", b'{"global_step": "x"}\n', b"\x00\xff\xfe\x80 junk\n", b"{}\n"]
    (run.dir / "metrics.jsonl").write_bytes(b"".join(lines[:1] + garbage + lines[1:]))

    rerun = run_here(run)
    no_traceback(rerun)
    assert (run.dir / "summary.json.corrupt").read_bytes() == corrupt
    assert "summary.json is unreadable" in rerun.output
    assert "dropped line(s) 2, 3, 4, 5, 6" in rerun.output
    assert_resumed_from(rerun.output, 24)
    assert_same_run(rerun, reference)


# ---------------------------------------------------------------------------------------------
# A full or read-only disk while checkpointing
# ---------------------------------------------------------------------------------------------

# Runs "$@" with a tmpfs of size $1 mounted at $2 (read-only if $3 is "ro"), then copies what is
# on it to $4 (the tmpfs disappears with the namespace) and exits with the command's status.
NAMESPACE_SCRIPT = """
size=$1 disk=$2 mode=$3 copy=$4
shift 4
mount -t tmpfs -o size="$size" tmpfs "$disk" || exit 97
if [ "$mode" = ro ]; then mount -o remount,ro "$disk" || exit 98; fi
"$@"
status=$?
cp -a "$disk"/. "$copy"/ || exit 99
exit $status
"""


def require_unshare() -> None:
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    # CI runs as root on this machine image, where it works: a failure here is a broken image.
    assert probe.returncode == 0, (
        f"`unshare -rm` (a user and mount namespace for a small tmpfs) is needed for the full-disk "
        f"tests and failed: {probe.stderr.strip()}"
    )


def run_on_small_disk(
    run: TrainRun,
    size: str,
    mode: str = "rw",
    disk: Path | None = None,
    python_code: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[Result, Path]:
    """Train with ``disk`` (default: ``<output dir>/checkpoints``) on a tmpfs of ``size``; (result,
    a copy of what ``disk`` held at the end)."""
    require_unshare()
    disk = disk or run.dir / "checkpoints"
    disk.mkdir(parents=True)
    copy = run.root / f"{disk.name}_after"
    copy.mkdir()
    log = run.root / f"small-disk-{mode}.log"
    command = [
        "unshare", "-rm", "sh", "-c", NAMESPACE_SCRIPT, "sh", size, str(disk), mode, str(copy),
        *run.command([], python_code),
    ]  # fmt: skip
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.run(
            command,
            cwd=run.root,
            env=run.env(None, extra_env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=RUN_TIMEOUT_S,
            start_new_session=True,
        )
    result = Result(proc.returncode, read_log(log), run.dir, time.monotonic() - started)
    assert proc.returncode not in (97, 98, 99), f"setting up the tmpfs failed\n{result.tail()}"
    return result, copy


def failure_line(result: Result, code: str, path: Path) -> str:
    """Exit status 1 (under a launcher: its own non-zero status), no traceback, and our one line,
    naming the cause and the path."""
    assert result.returncode != 0, result.tail()
    assert "Traceback" not in result.output, result.tail()
    lines = [line for line in result.output.splitlines() if line.startswith("linnaeus-accel: ")]
    assert lines, f"no message from us\n{result.tail()}"
    named = [line for line in lines if code in line and str(path) in line]
    assert named, lines
    return named[0]


def assert_write_failed(result: Result, code: str, path: Path) -> None:
    """``failure_line``, and ``summary.json`` saying ``status: failed``."""
    failure_line(result, code, path)
    data = json.loads((result.dir / "summary.json").read_text(encoding="utf-8"))
    assert data["status"] == "failed", data
    assert code in data["error"], data


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [],
        # the write fails on the background thread; every process stops at the end of the run
        ["SCHEDULE.CHECKPOINT.ASYNC", "true"],
    ],
    ids=["default", "async"],
)
def test_a_full_disk_names_enospc_and_keeps_the_previous_checkpoint(tmp_path: Path, extra: list[str]) -> None:
    run = TrainRun(tmp_path, [*OPTS, *extra])
    # A checkpoint takes about 1.5 MB: step 12 fits in 2 MB, step 24 does not.
    result, after = run_on_small_disk(run, "2m")
    assert_write_failed(result, "ENOSPC", run.dir / "checkpoints" / f".staging-{STEP24}")
    assert f"the resume point is still {run.dir / 'checkpoints' / STEP12}" in result.output
    assert "inline_container" not in "".join(
        line for line in result.output.splitlines() if "CheckpointWriteError" in line
    )
    # The partial checkpoint is gone (its space is free again) and the previous one is whole.
    assert sorted(p.name for p in after.iterdir()) == [STEP12]
    assert checkpoint_store(after).verify(after / STEP12) is None


@pytest.mark.slow
def test_a_full_disk_stops_two_processes_together(tmp_path: Path) -> None:
    # 2 processes: 6 steps per epoch, checkpoints at steps 6 and 12; the second does not fit.
    run = TrainRun(tmp_path, OPTS, processes=2)
    result, after = run_on_small_disk(run, "2m")
    assert result.returncode != 0, result.tail()
    errors = [line for line in result.output.splitlines() if "linnaeus-accel: process " in line]
    # Both processes stopped (neither waits at a barrier for the other), each naming the cause.
    assert len(errors) == 2, f"{errors}\n{result.tail()}"
    assert all("ENOSPC" in line for line in errors), errors
    # Each names the resume point the main process committed (only the main process commits).
    assert all(
        line.rstrip().endswith("the resume point is still " + str(run.dir / "checkpoints" / "step_00000006"))
        for line in errors
    ), errors
    # (the launcher prints its own traceback for a worker that exited 1; none goes through our code)
    assert "linnaeus_accel/training" not in result.output, result.tail()
    assert sorted(p.name for p in after.iterdir()) == ["step_00000006"]
    assert checkpoint_store(after).verify(after / "step_00000006") is None


@pytest.mark.slow
def test_a_read_only_checkpoint_directory_names_erofs(tmp_path: Path) -> None:
    run = TrainRun(tmp_path, OPTS)
    result, after = run_on_small_disk(run, "2m", mode="ro")
    assert_write_failed(result, "EROFS", run.dir / "checkpoints" / f".staging-{STEP12}")
    assert "there is no earlier checkpoint to resume from" in result.output
    assert list(after.iterdir()) == []


# The commit itself (the marker write) runs out of space: the disk is filled up to exactly the pages
# the staged files of the second checkpoint take (same sizes as the first's), so staging succeeds
# and writing COMMITTED.json fails.
COMMIT_ENOSPC = """
import json, math, os, sys, traceback
from pathlib import Path

import torch
from accelerate import Accelerator

from linnaeus_accel.config import load_config
from linnaeus_accel.checkpoint.save.writer import CheckpointWriter, CheckpointWriteError

disk = Path(sys.argv[1])
config = load_config(sys.argv[2], ["ENV.OUTPUT.BASE_DIR", str(disk), "EXPERIMENT.NAME", "run"])
acc = Accelerator(cpu=True)
model, optimizer = acc.prepare(torch.nn.Linear(64, 64), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()))
writer = CheckpointWriter(
    acc, config.ENV, config.EXPERIMENT, config.SCHEDULE, config.ranking_metric, config.output_dir
)

def state(step):
    return {"progress": {"global_step": step, "epoch": 0, "batches_seen_in_epoch": step}}

first = writer.save(1, state(1), {"meter": None, "data": None})
writer.settle()  # committed in the background: wait for it
pages = sum(math.ceil(p.stat().st_size / 4096) for p in first.iterdir() if p.name != "COMMITTED.json")
free = os.statvfs(disk).f_bavail
with (disk / "filler").open("wb") as f:
    f.write(bytes((free - pages) * 4096))
try:
    writer.save(2, state(2), {"meter": None, "data": None})
    writer.settle()  # the background commit's failure is raised here, on every process
    report = {"error": None}
except CheckpointWriteError as e:
    frames = [frame.name for frame in traceback.extract_tb(e.__cause__.__traceback__)]
    report = {"error": str(e), "in_mark": "_mark" in frames}
report["left"] = sorted(p.name for p in writer.store.root.iterdir())
report["previous"] = writer.store.verify(first)
print(json.dumps(report))
"""


@pytest.mark.slow
def test_a_commit_that_runs_out_of_space_behaves_the_same(tmp_path: Path) -> None:
    require_unshare()
    script = tmp_path / "commit_enospc.py"
    script.write_text(COMMIT_ENOSPC)
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    copy.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LINNAEUS_ACCEL_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        "unshare", "-rm", "sh", "-c", NAMESPACE_SCRIPT, "sh", "4m", str(disk), "rw", str(copy),
        sys.executable, str(script), str(disk), str(DEFAULT_CONFIG),
    ]  # fmt: skip
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["error"] is not None, "the second checkpoint was committed: the disk was not full"
    assert report["in_mark"], report  # it was the marker write that failed
    assert "could not write checkpoint step 2: ENOSPC" in report["error"]
    assert "the resume point is still" in report["error"]
    assert report["left"] == ["step_00000001"]
    assert report["previous"] is None


# The disk (a tmpfs holding the whole output directory) fills at a fault point, all but
# FILL_LEAVE_PAGES of its pages taken: the file the run writes next finds it full, at the same
# moment in every try (a size alone races the background checkpoint write against the loop's own
# writes: metrics.jsonl was hit in 3 tries of 7).
FILL_DISK_AT = """
import os, sys, threading
from pathlib import Path
from linnaeus_accel.cli import main
from linnaeus_accel.process import faults

def fill():
    for thread in threading.enumerate():  # the schedule plot's write would race the run's
        if thread.name == "linnaeus-accel schedule plot":
            thread.join()
    disk = Path(os.environ["FILL_DISK"])
    info = os.statvfs(disk)
    pages = info.f_bavail - int(os.environ["FILL_LEAVE_PAGES"])
    with (disk / "filler").open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, pages * info.f_frsize)

point, _, count = os.environ["FILL_DISK_AT"].partition(":")
faults._ARMED[point] = (int(count), fill)
sys.exit(main(sys.argv[1:]))
"""


def pages(path: Path) -> int:
    return math.ceil(path.stat().st_size / 4096)


def last_record_pages(ref: Result) -> int:
    """The pages metrics.jsonl's last record (the final boundary's validation) adds to it."""
    text = (ref.dir / "metrics.jsonl").read_bytes()
    before = len(b"".join(text.splitlines(keepends=True)[:-1]))
    return math.ceil(len(text) / 4096) - math.ceil(before / 4096)


# (fault point, pages left free (from the reference run), the file that finds the disk full,
# the checkpoints left, whether the run's end finds the space to write summary.json)
FULL_AT: dict[str, tuple[str, Callable[[Result], int], str, list[str], bool]] = {
    # After the 4 passes of step 12 are journalled: the validation record is metrics.jsonl's first
    # line, so its first page.
    "metrics.jsonl": ("validation_pass:4", lambda ref: 0, "metrics.jsonl", [STEP12], False),
    # Before checkpoint step 12: its write fails on the background thread, and the loop's next
    # write, the validation record, in metrics.jsonl.
    "checkpoint and metrics.jsonl": ("optimizer_step:12", lambda ref: 0, "metrics.jsonl", [], False),
    # After the last pass of step 24 is journalled (its metrics line fits metrics.jsonl's page),
    # with 16 pages left: the final weights take them, and give them back to summary.json.
    "final": ("validation_pass:12", lambda ref: 16, "final", [STEP12, STEP24], True),
    # The same, with room for final/ alone (and for the pages the boundary's validation record,
    # written after the last pass, adds to metrics.jsonl).
    "summary.json": (
        "validation_pass:12",
        lambda ref: pages(ref.dir / "final" / "model.safetensors") + last_record_pages(ref),
        "summary.json",
        [STEP12, STEP24],
        False,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("hit", list(FULL_AT))
def test_a_disk_that_fills_at_any_write_ends_the_run_in_one_sentence(
    hit: str, reference: Result, tmp_path: Path
) -> None:
    point, leave, path, kept, summary_written = FULL_AT[hit]
    # The checkpoints are written in the background, racing the loop's own writes.
    run = TrainRun(tmp_path, [*OPTS, "SCHEDULE.CHECKPOINT.ASYNC", "true"])
    env = {"FILL_DISK": str(run.dir), "FILL_DISK_AT": point, "FILL_LEAVE_PAGES": str(leave(reference))}
    result, after = run_on_small_disk(run, "8m", disk=run.dir, python_code=FILL_DISK_AT, extra_env=env)
    line = failure_line(result, "ENOSPC", run.dir / path)
    resume = run.dir / "checkpoints" / kept[-1] if kept else None
    assert ("the resume point is still " + str(resume) if resume else "no earlier checkpoint") in line, line
    if hit == "checkpoint and metrics.jsonl":
        assert "checkpoint step 12 was not written either (ENOSPC" in line, line
    # No staging directory or partial checkpoint is left; the committed ones verify.
    shutil.copytree(after, run.dir, dirs_exist_ok=True, symlinks=True)
    assert sorted(p.name for p in (run.dir / "checkpoints").iterdir()) == kept
    for name in kept:
        assert checkpoint_store(run.dir / "checkpoints").verify(run.dir / "checkpoints" / name) is None
    assert not (run.dir / "final").exists() or hit == "summary.json"
    if summary_written:
        data = read_summary(run.dir)
        assert data["status"] == "failed", data
        assert data["error"] == line.removeprefix("linnaeus-accel: "), data
    else:  # the disk is still full: the sentence says so
        assert not (run.dir / "summary.json").exists()
        assert "; summary.json does not record the failure" in line, line
    if hit in ("metrics.jsonl", "final"):  # with space again, the rerun resumes and ends identically
        (run.dir / "filler").unlink()
        rerun = run_here(run)
        no_traceback(rerun)
        assert_resumed_from(rerun.output, int(kept[-1].removeprefix("step_")))
        assert_same_run(rerun, reference)
