"""Inputs an adversarial tester found escaping validation: each must be a clean config error.

For every row, `linnaeus-accel train` (in-process, as a user runs it) must exit with status 2, name
the key (or the file) at fault on stderr, show no traceback, and write nothing: the output
directory does not exist afterwards, or holds exactly what was there before. Most rows fail while
the config is read; the ones that need the data or the model (model options, loss weights against
the task, metric names) build the small digits data and model, about a second each.

One slow test launches two real worker processes: the error is printed once and both exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.configs import REPO
from helpers.in_process import run_cli
from helpers.processes import free_port

DEFAULT = str(REPO / "configs" / "default.yaml")
CLASSIFICATION = str(REPO / "configs" / "digits_classification.yaml")

# A row: (id, what the config file holds (None: default.yaml), --opts, what stderr must name).
# The config text may name {default}: the absolute path of configs/default.yaml.
Row = tuple[str, str | bytes | None, list[str], str]

ROWS: list[Row] = [
    # BASE must name files: an int, or a list holding one, used to crash while joining paths.
    ("base-int", "BASE: 5\nTRAIN:\n  EPOCHS: 1\n", [], "BASE"),
    ("base-list-of-int", "BASE: [5]\nTRAIN:\n  EPOCHS: 1\n", [], "BASE"),
    # A config saved as UTF-16 (bytes that are not UTF-8) used to raise UnicodeDecodeError.
    ("not-utf8", b"\xff\xfeT\x00R\x00A\x00I\x00N\x00", [], "not UTF-8"),
    # An empty file, or one of comments only, used to train silently with every default.
    ("empty-file", "", [], "sets nothing"),
    ("only-comments", "# TRAIN:\n#   EPOCHS: 3\n", [], "sets nothing"),
    # numpy and torch take 32-bit seeds: 2**32 used to fail inside numpy's seeding.
    ("seed-2**32", None, ["EXPERIMENT.SEED", "4294967296"], "EXPERIMENT.SEED"),
    # A huge batch used to fail in islice() after metrics.jsonl and assets/ were written.
    ("batch-1e20-float", None, ["DATA.BATCH_SIZE", "1e20"], "DATA.BATCH_SIZE"),
    ("batch-10**20", None, ["DATA.BATCH_SIZE", str(10**20)], "DATA.BATCH_SIZE"),
    ("val-batch-10**9", None, ["DATA.BATCH_SIZE_VAL", str(10**9)], "DATA.BATCH_SIZE_VAL"),
    # 10**8 DataLoader workers used to hang while forking them.
    ("num-workers-10**8", None, ["DATA.NUM_WORKERS", "100000000"], "DATA.NUM_WORKERS"),
    # An accumulation beyond a C int used to fail with OverflowError after writing the assets.
    ("accumulation-10**21", None, ["TRAIN.ACCUMULATION_STEPS", str(10**21)], "TRAIN.ACCUMULATION_STEPS"),
    # A collective timeout beyond a C int used to fail with OverflowError inside torch.
    ("dist-timeout-10**20", None, ["ENV.DIST_TIMEOUT_S", str(10**20)], "ENV.DIST_TIMEOUT_S"),
    # 10**20 epochs is more steps than the schedules count exactly: refused, not trained forever.
    ("epochs-10**20", None, ["TRAIN.EPOCHS", str(10**20)], "TRAIN.EPOCHS"),
    # A value starting with '-' that is not a plain negative number used to be read by argparse as
    # an unknown option ("unrecognized arguments: -1e-8"), naming neither the key nor the fix.
    ("eps-negative-exponent", None, ["OPTIMIZER.EPS", "-1e-8"], "OPTIMIZER.EPS: must be a finite number > 0"),
    # Model options are checked by the builder, each named by its full key (torch used to fail
    # on a negative dimension).
    ("mlp-hidden-negative", None, ["MODEL.OPTIONS.hidden", "-5"], "MODEL.OPTIONS.hidden"),
    ("mlp-dropout-1.5", None, ["MODEL.OPTIONS.dropout", "1.5"], "MODEL.OPTIONS.dropout"),
    (
        "convnet-channels-negative",
        "classification",
        ["MODEL.OPTIONS.channels", "-1"],
        "MODEL.OPTIONS.channels",
    ),
    # Loss weights against the task's two levels: a ConfigError, exit 2.
    ("task-weights-short", None, ["LOSS.TASK_WEIGHTS", "[1.0]"], "LOSS.TASK_WEIGHTS"),
    ("task-weights-long", None, ["LOSS.TASK_WEIGHTS", "[1.0, 1.0, 1.0]"], "LOSS.TASK_WEIGHTS"),
    # GradNorm with a zero weight used to raise ValueError from GradNorm's constructor.
    (
        "task-weight-0-with-gradnorm",
        None,
        ["LOSS.TASK_WEIGHTS", "[0.0, 1.0]", "LOSS.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED", "true"],
        "LOSS.TASK_WEIGHTS",
    ),
    # All weights 0 used to train a model that learns nothing.
    ("task-weights-all-0", None, ["LOSS.TASK_WEIGHTS", "[0.0, 0.0]"], "LOSS.TASK_WEIGHTS"),
    # A metric the task never reports, even with MODE given, used to be accepted without a word.
    (
        "early-stop-metric-unknown",
        None,
        ["TRAIN.EARLY_STOP.METRIC", "val/bogus", "TRAIN.EARLY_STOP.MODE", "min"],
        "TRAIN.EARLY_STOP.METRIC",
    ),
    # ... and so did a known name under a validation pass the run never makes.
    ("early-stop-pass-unknown", None, ["TRAIN.EARLY_STOP.METRIC", "bogus/loss"], "TRAIN.EARLY_STOP.METRIC"),
    # The checkpoint-ranking metric is checked too, also when it equals the (inactive) early-stop one.
    (
        "ranking-metric-unknown",
        None,
        ["SCHEDULE.CHECKPOINT.METRIC", "val/bogus", "TRAIN.EARLY_STOP.METRIC", "val/bogus"],
        "SCHEDULE.CHECKPOINT.METRIC",
    ),
]


def _config_file(tmp_path: Path, content: str | bytes | None) -> str:
    if content is None:
        return DEFAULT
    if content == "classification":
        return CLASSIFICATION
    path = tmp_path / "config.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


def assert_clean_config_error(rc: int, out: str, err: str, names: str) -> None:
    assert rc == 2, f"exit status {rc}\n{err}"
    assert names in err, err
    assert "Traceback" not in err, err
    assert err.count("linnaeus-accel:") == 1, err  # one message


@pytest.mark.parametrize(("content", "opts", "names"), [pytest.param(*r[1:], id=r[0]) for r in ROWS])
def test_bad_input_is_a_clean_config_error(
    tmp_path: Path, content: str | bytes | None, opts: list[str], names: str
) -> None:
    base = tmp_path / "out"
    cfg = _config_file(tmp_path, content)
    rc, out, err = run_cli(
        "train", "--cfg", cfg, "--opts", "ENV.OUTPUT.BASE_DIR", str(base), "TRAIN.EPOCHS", "1", *opts
    )
    assert_clean_config_error(rc, out, err, names)
    assert not base.exists() or not any(base.iterdir()), sorted(base.rglob("*"))


# Every command that takes --opts: the value after a key is its value, whatever it starts with;
# a key followed by one of the command's flags has no value, and the error names it.
OPTS_COMMANDS = [["plan", "--json"], ["train", "--overwrite"], ["evaluate", "--checkpoint", "nowhere"]]


@pytest.mark.parametrize("command", OPTS_COMMANDS, ids=lambda c: c[0])
def test_opts_values_starting_with_a_dash_are_values(tmp_path: Path, command: list[str]) -> None:
    name, *flags = command
    opts = ["ENV.OUTPUT.BASE_DIR", str(tmp_path / "out"), "EXPERIMENT.NAME", "-run", "OPTIMIZER.EPS", "-1e-8"]
    rc, out, err = run_cli(name, "--cfg", DEFAULT, "--opts", *opts, *flags)
    assert_clean_config_error(rc, out, err, "OPTIMIZER.EPS: must be a finite number > 0 (got -1e-08)")
    assert "EXPERIMENT.NAME: '-run' is not a usable directory name" in err, err  # a value too
    rc, out, err = run_cli(name, "--cfg", DEFAULT, "--opts", "TRAIN.EPOCHS", *flags)
    assert_clean_config_error(rc, out, err, "'TRAIN.EPOCHS' has no value")


# An output directory that cannot be one: a regular file, or a path below one. Checked before the
# data and the model are built (it used to fail with NotADirectoryError at the first write).
OUTPUT_DIRS: list[tuple[str, Callable[[Path], Path], str]] = [
    ("base-dir-is-a-file", lambda f: f, "ENV.OUTPUT.BASE_DIR"),
    ("base-dir-under-a-file", lambda f: f / "sub", "ENV.OUTPUT.BASE_DIR"),
    ("run-dir-is-a-file", lambda f: f.parent, "EXPERIMENT.NAME"),
]


@pytest.mark.parametrize(("where", "names"), [pytest.param(*r[1:], id=r[0]) for r in OUTPUT_DIRS])
def test_output_dir_that_cannot_be_created_is_a_config_error(
    tmp_path: Path, where: Callable[[Path], Path], names: str
) -> None:
    blocker = tmp_path / "run"  # EXPERIMENT.NAME below is "run" too
    blocker.write_text("not a directory\n", encoding="utf-8")
    opts = ["ENV.OUTPUT.BASE_DIR", str(where(blocker)), "EXPERIMENT.NAME", "run", "TRAIN.EPOCHS", "1"]
    rc, out, err = run_cli("train", "--cfg", DEFAULT, "--opts", *opts)
    assert_clean_config_error(rc, out, err, names)
    assert blocker.read_text(encoding="utf-8") == "not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing else was written


@pytest.mark.slow
def test_config_error_under_two_processes_is_printed_once_and_every_worker_exits_2(tmp_path: Path) -> None:
    # Two workers started as a launcher starts them (RANK, LOCAL_RANK, WORLD_SIZE), without the
    # launcher, so that each worker's own exit status and output can be read.
    base = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "LOCAL_"))}
    env.update(
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        ACCELERATE_USE_CPU="true",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
    )
    command = [sys.executable, "-m", "linnaeus_accel", "train", "--cfg", DEFAULT, "--opts"]
    command += ["ENV.OUTPUT.BASE_DIR", str(base), "EXPERIMENT.SEED", "4294967296"]
    workers = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [w.communicate(timeout=120) for w in workers]
    assert [w.returncode for w in workers] == [2, 2], outputs
    errs = [err for _, err in outputs]
    assert "EXPERIMENT.SEED" in errs[0], errs
    assert errs[1] == "", errs  # only the local main process prints
    assert not any("Traceback" in err for err in errs), errs
    assert not base.exists()
