"""What our JSON files in a checkpoint must look like before a resume believes them.

``trainer_state.json`` (the run's state), ``rank_XXXXX.json`` (each process's own) and the
validation journal are plain data; a checkpoint may come from an untrusted place (a bucket, a
colleague, a disk that flipped a bit), so everything the trainer reads from them is checked here
first: a problem is a sentence saying what is wrong (the checkpoint is then skipped, or the journal
line ignored), never a traceback halfway through a resume. Pure functions: no files, no Accelerate.

Journal lines carry the sha256 of their canonical JSON payload bound to the checkpoint's marker
(the sha256 of its ``COMMITTED.json``): an edited value, or a line copied from another checkpoint,
no longer matches. (Anyone can recompute a sha256: this detects damage and careless edits, it is
no signature.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ...state_fields import error_line, schema_problem, shown
from ..directory import CheckpointStore, MarkerError, read_marker
from ..directory.layout import JOURNAL_FILE as JOURNAL_FILE
from ..directory.layout import RANK_FILE as RANK_FILE
from ..directory.layout import STATE_FILE as STATE_FILE
from .content import content_problem
from .schemas import STATE_VERSION as STATE_VERSION
from .schemas import RankStateFile, TrainerStateFile


def _version_problem(state: Any, what: str) -> str | None:
    if not isinstance(state, dict):
        return f"{what} is not a JSON object"
    version = state.get("version")
    if type(version) is not int or version != STATE_VERSION:
        return f"{what} has version {shown(version)}; this linnaeus-accel reads version {STATE_VERSION}"
    return None


def state_problem(state: Any, step: int) -> str | None:
    """None if ``state`` (parsed ``trainer_state.json``) is one the trainer can resume from at
    ``step`` (the checkpoint's step, from its directory name and marker), else what is wrong: each
    part is checked against its format (``schemas.TrainerStateFile``)."""
    problem = _version_problem(state, STATE_FILE)
    if problem is not None:
        return problem
    # Where the run is comes first: a problem there, then a step of another checkpoint, then the
    # first problem of the other parts (pydantic lists problems in field order).
    try:
        TrainerStateFile.model_validate(state)
    except ValidationError as exc:
        errors = exc.errors()
        if errors[0]["loc"][0] == "progress":
            return error_line(errors[0], TrainerStateFile, state, STATE_FILE)
    else:
        errors = []
    if (saved := state["progress"]["global_step"]) != step:
        return f"{STATE_FILE}: progress.global_step is {saved} but the checkpoint is for step {step}"
    return error_line(errors[0], TrainerStateFile, state, STATE_FILE) if errors else None


def rank_state_problem(state: Any, rank: int) -> str | None:
    """None if ``state`` (parsed ``rank_XXXXX.json`` of process ``rank``) is usable, else what is
    wrong (``schemas.RankStateFile``)."""
    name = RANK_FILE.format(rank)
    return _version_problem(state, name) or schema_problem(RankStateFile, state, name)


# -- the validation journal ----------------------------------------------------------------------


def _canonical(prefix: str, metrics: Mapping[str, float]) -> str:
    return json.dumps(
        {"prefix": prefix, "metrics": dict(metrics)}, sort_keys=True, separators=(",", ":"), allow_nan=True
    )


def _entry_digest(binding: str, prefix: str, metrics: Mapping[str, float]) -> str:
    return hashlib.sha256(f"{binding}\n{_canonical(prefix, metrics)}".encode()).hexdigest()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # numpy floats are floats


def entry_problem(entry: Any) -> str | None:
    """The schema of one completed pass: ``{"prefix": str, "metrics": {str: number}}``. Non-finite
    numbers are allowed: a diverged model's validation loss is NaN, and that is its result."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    prefix, metrics = entry.get("prefix"), entry.get("metrics")
    if not isinstance(prefix, str) or not prefix:
        return f"prefix must be a non-empty string, got {shown(prefix)}"
    if not isinstance(metrics, dict):
        return f"metrics must be an object, got {shown(metrics)}"
    for key, value in metrics.items():
        if not _is_number(value):
            return f"metric {key!r} must be a number, got {shown(value)}"
    return None


def encode_journal_entry(prefix: str, metrics: Mapping[str, float], binding: str) -> str:
    """One journal line (with its newline) for a completed pass; ``binding``: the sha256 of the
    checkpoint's marker."""
    problem = entry_problem({"prefix": prefix, "metrics": dict(metrics)})
    if problem is not None:
        raise ValueError(f"cannot journal validation pass {prefix!r}: {problem}")
    values = {str(k): float(v) for k, v in metrics.items()}
    line = {"prefix": prefix, "metrics": values, "sha256": _entry_digest(binding, prefix, values)}
    return json.dumps(line, allow_nan=True) + "\n"


def decode_journal(data: bytes, binding: str) -> tuple[list[dict[str, Any]], int, str | None]:
    """The entries of a journal up to its first line that fails (``{"prefix", "metrics"}`` each),
    the number of bytes they take, and what is wrong with that line (None if none). A line that
    fails is treated as a line cut by a kill: it and everything after it are ignored."""
    entries: list[dict[str, Any]] = []
    offset = 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        number = len(entries) + 1
        if end < 0:
            return entries, offset, f"line {number} is incomplete (cut by a kill?)"
        problem = _line_problem(data[offset:end], binding, entries)
        if problem is not None:
            return entries, offset, f"line {number} {problem}"
        offset = end + 1
    return entries, offset, None


def _line_problem(raw: bytes, binding: str, entries: list[dict[str, Any]]) -> str | None:
    try:
        line = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "is not JSON"
    problem = entry_problem(line)
    if problem is not None:
        return f"is malformed: {problem}"
    assert isinstance(line, dict)
    if not isinstance(line.get("sha256"), str):
        return "has no sha256"
    if set(line) != {"prefix", "metrics", "sha256"}:
        return f"has unexpected fields {sorted(set(line) - {'prefix', 'metrics', 'sha256'})}"
    prefix, metrics = line["prefix"], {k: float(v) for k, v in line["metrics"].items()}
    if line["sha256"] != _entry_digest(binding, prefix, metrics):
        return f"({prefix}) does not match its sha256 (edited, or not from this checkpoint)"
    entries.append({"prefix": prefix, "metrics": metrics})
    return None


def checkpoint_store(root: Path) -> CheckpointStore:
    """The store of a run's checkpoints, verifying our own files too (``check_state``)."""
    return CheckpointStore(root, journal=JOURNAL_FILE, check=check_state)


def check_state(path: Path) -> str | None:
    """What is wrong with our JSON state in the checkpoint at ``path`` (None: nothing): the state
    the trainer reads must be what this version wrote, for the checkpoint's own step; and every
    file a resume would unpickle must be data (``checkpoint_content``)."""
    try:
        step = int(read_marker(path)["step"])
    except MarkerError as exc:
        return str(exc)
    state, problem = read_json(path / STATE_FILE)
    if problem is not None:
        return problem
    problem = state_problem(state, step)
    if problem is not None:
        return problem
    files = rank_files(path)
    for rank, file in enumerate(files):
        rank_state, problem = read_json(file)
        problem = problem or rank_state_problem(rank_state, rank)
        if problem is not None:
            return problem
    names = sorted(p.name for p in path.glob("rank_*.json"))
    if len(names) != len(files):
        return f"the per-process files are not numbered from 0 without gaps: {names}"
    return content_problem(path, state)  # every file a resume unpickles: data, never code


def rank_files(path: Path) -> list[Path]:
    """The per-process state files of the checkpoint at ``path``, by rank: rank_00000.json up to
    the first missing number (none in a checkpoint written before they existed)."""
    files: list[Path] = []
    while (file := path / RANK_FILE.format(len(files))).is_file():
        files.append(file)
    return files


def read_json(file: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(file.read_bytes().decode("utf-8")), None
    except FileNotFoundError:
        return None, f"{file.name} missing"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{file.name} unreadable ({type(exc).__name__}: {str(exc)[:100]})"
