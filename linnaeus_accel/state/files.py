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

from ..checkpoint import CheckpointStore, MarkerError, read_marker
from ..checkpoint.layout import JOURNAL_FILE as JOURNAL_FILE
from ..checkpoint.layout import RANK_FILE as RANK_FILE
from ..checkpoint.layout import STATE_FILE as STATE_FILE
from ..progress import TrainingStage
from .content import content_problem

STATE_VERSION = 1

_STAGES = {stage.value for stage in TrainingStage}


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is no step count


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # numpy floats are floats


def _count(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _number_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_number(v) for v in value)


def _fields(
    data: Mapping[str, Any], where: str, rules: Mapping[str, tuple[str, Any]], required: tuple[str, ...] = ()
) -> str | None:
    """The first field of ``data`` that breaks its rule (``name: (what it must be, test)``)."""
    for name in required:
        if name not in data:
            return f"{where}.{name} is missing"
    for name, (what, test) in rules.items():
        if name in data and not test(data[name]):
            return f"{where}.{name} must be {what}, got {_shown(data[name])}"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


_OPT_COUNT = ("an integer >= 0 or null", lambda v: v is None or _count(v))
_PROGRESS = {
    "global_step": ("an integer >= 0", _count),
    "epoch": ("an integer >= 0", _count),
    "batches_seen_in_epoch": ("an integer >= 0", _count),
    "total_epochs": _OPT_COUNT,
    "samples_seen": _OPT_COUNT,
    "tokens_seen": _OPT_COUNT,
    "expected_total_steps": _OPT_COUNT,
    "epoch_start_step": _OPT_COUNT,
    "version": ("an integer", _is_int),
    "current_stage": (f"one of {sorted(_STAGES)}", lambda v: isinstance(v, str) and v in _STAGES),
    "pending_validations": (
        "a list of stages",
        lambda v: isinstance(v, list) and all(isinstance(s, str) and s in _STAGES for s in v),
    ),
    "completed_validations": (
        "a list of stages",
        lambda v: isinstance(v, list) and all(isinstance(s, str) and s in _STAGES for s in v),
    ),
    "partial_validation_indices": (
        "a list of integers",
        lambda v: isinstance(v, list) and all(_is_int(i) for i in v),
    ),
    "completed_partial_indices": (
        "a list of integers",
        lambda v: isinstance(v, list) and all(_is_int(i) for i in v),
    ),
    "best_metric": (
        "null or {name, value, step}",
        lambda v: (
            v is None
            or (
                isinstance(v, dict)
                and isinstance(v.get("name"), str)
                and _is_number(v.get("value"))
                and _is_int(v.get("step"))
            )
        ),
    ),
}
_EARLY_STOPPING = {
    "metric": ("a string", lambda v: isinstance(v, str)),
    "best": ("a number or null", lambda v: v is None or _is_number(v)),
    "step_of_best": ("an integer or null", lambda v: v is None or _is_int(v)),
}
_GRADNORM = {
    "version": ("an integer", _is_int),
    "num_tasks": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "step": ("an integer >= 0", _count),
    **{
        key: ("a list of numbers or null", lambda v: v is None or _number_list(v))
        for key in ("weights", "initial_losses", "exp_avg", "exp_avg_sq")
    },
}
_BOUNDARY = {
    "epoch": ("an integer >= 0", _count),
    "final": ("true or false", lambda v: isinstance(v, bool)),
}
_BOUNDARY_OPTIONAL = {  # written since events may happen mid-epoch and epochs may have unknown length
    "step": ("an integer >= 0", _count),
    "previous_step": ("an integer >= 0", _count),
    "mid": ("true or false", lambda v: isinstance(v, bool)),
}
_PLAN = {
    "total_steps": ("an integer >= 0", _count),
    **{key: ("an integer >= 1", lambda v: _is_int(v) and v >= 1) for key in ("world_size", "accumulation")},
    "batch_size": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
}
_PLAN_OPTIONAL = {  # written since configs are stored in checkpoints; null: a stream without __len__
    "batches_per_epoch": ("an integer >= 1 or null", lambda v: v is None or (_is_int(v) and v >= 1)),
}
_METER = {
    "sums": ("a list of numbers or null", lambda v: v is None or _number_list(v)),
    "steps": ("an integer >= 0", _count),
    "samples_at_last_flush": ("an integer >= 0", _count),
    "tokens_at_last_flush": ("an integer >= 0", _count),
    "nonfinite_skipped": ("an integer >= 0", _count),
    "skipped_steps": ("an integer >= 0", _count),
}


def _version_problem(state: Any, what: str) -> str | None:
    if not isinstance(state, dict):
        return f"{what} is not a JSON object"
    version = state.get("version")
    if not _is_int(version) or version != STATE_VERSION:
        return f"{what} has version {_shown(version)}; this linnaeus-accel reads version {STATE_VERSION}"
    return None


def state_problem(state: Any, step: int) -> str | None:
    """None if ``state`` (parsed ``trainer_state.json``) is one the trainer can resume from at
    ``step`` (the checkpoint's step, from its directory name and marker), else what is wrong."""
    problem = _version_problem(state, STATE_FILE)
    if problem is not None:
        return problem
    where = STATE_FILE
    progress = state.get("progress")
    if not isinstance(progress, dict):
        return f"{where}: progress must be an object, got {_shown(progress)}"
    problem = _fields(
        progress,
        f"{where}: progress",
        _PROGRESS,
        required=("global_step", "epoch", "batches_seen_in_epoch"),
    )
    if problem is not None:
        return problem
    if progress["global_step"] != step:
        return f"{where}: progress.global_step is {progress['global_step']} but the checkpoint is for step {step}"
    boundary_rules = {**_BOUNDARY, **_BOUNDARY_OPTIONAL}
    for key, rules in (
        ("early_stopping", _EARLY_STOPPING),
        ("gradnorm", _GRADNORM),
        ("boundary", boundary_rules),
    ):
        value = state.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            return f"{where}: {key} must be an object or null, got {_shown(value)}"
        required = tuple(_BOUNDARY) if key == "boundary" else ()
        problem = _fields(value, f"{where}: {key}", rules, required)
        if problem is not None:
            return problem
    plan = state.get("plan")
    if plan is not None:
        if not isinstance(plan, dict):
            return f"{where}: plan must be an object or null, got {_shown(plan)}"
        problem = _fields(plan, f"{where}: plan", {**_PLAN, **_PLAN_OPTIONAL}, required=tuple(_PLAN))
        if problem is not None:
            return problem
    config = state.get("config")  # the resolved config it was trained with (reviewed on resume)
    if config is not None and not isinstance(config, dict):
        return f"{where}: config must be an object or null, got {_shown(config)}"
    callbacks = state.get("callbacks")  # each callback's own JSON state, by its label
    if callbacks is not None and not isinstance(callbacks, dict):
        return f"{where}: callbacks must be an object or null, got {_shown(callbacks)}"
    run_id = state.get("wandb_run_id")
    if run_id is not None and not isinstance(run_id, str):
        return f"{where}: wandb_run_id must be a string or null, got {_shown(run_id)}"
    metrics = state.get("checkpoint_metrics", {})
    if not isinstance(metrics, dict):
        return f"{where}: checkpoint_metrics must be an object, got {_shown(metrics)}"
    for key, value in metrics.items():
        if not (key.isascii() and key.isdigit()) or not (value is None or _is_number(value)):
            return (
                f"{where}: checkpoint_metrics must map steps to numbers or null, got {_shown({key: value})}"
            )
    return None


def rank_state_problem(state: Any, rank: int) -> str | None:
    """None if ``state`` (parsed ``rank_XXXXX.json`` of process ``rank``) is usable, else what is
    wrong."""
    name = RANK_FILE.format(rank)
    problem = _version_problem(state, name)
    if problem is not None:
        return problem
    meter = state.get("meter")
    if meter is not None:
        if not isinstance(meter, dict):
            return f"{name}: meter must be an object or null, got {_shown(meter)}"
        problem = _fields(meter, f"{name}: meter", _METER)
        if problem is not None:
            return problem
    data = state.get("data")
    if data is not None and not isinstance(data, dict):
        return f"{name}: data must be an object or null, got {_shown(data)}"
    return None


# -- the validation journal ----------------------------------------------------------------------


def _canonical(prefix: str, metrics: Mapping[str, float]) -> str:
    return json.dumps(
        {"prefix": prefix, "metrics": dict(metrics)}, sort_keys=True, separators=(",", ":"), allow_nan=True
    )


def _entry_digest(binding: str, prefix: str, metrics: Mapping[str, float]) -> str:
    return hashlib.sha256(f"{binding}\n{_canonical(prefix, metrics)}".encode()).hexdigest()


def entry_problem(entry: Any) -> str | None:
    """The schema of one completed pass: ``{"prefix": str, "metrics": {str: number}}``. Non-finite
    numbers are allowed: a diverged model's validation loss is NaN, and that is its result."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    prefix, metrics = entry.get("prefix"), entry.get("metrics")
    if not isinstance(prefix, str) or not prefix:
        return f"prefix must be a non-empty string, got {_shown(prefix)}"
    if not isinstance(metrics, dict):
        return f"metrics must be an object, got {_shown(metrics)}"
    for key, value in metrics.items():
        if not _is_number(value):
            return f"metric {key!r} must be a number, got {_shown(value)}"
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
