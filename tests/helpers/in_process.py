"""Running the package inside the test's own process: the command line, a ``TrainRun`` trained
here, and Accelerate's process-wide state, forgotten between runs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from helpers.configs import CFG
from helpers.processes import LAUNCHER_VARIABLES, OWN_PREFIXES
from helpers.runs import Result, TrainRun


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``linnaeus-accel ARGS`` in-process; (exit status, stdout, stderr).

    Works inside hypothesis tests too (no function-scoped fixture needed)."""
    from linnaeus_accel.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state, so that the next Accelerator starts fresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train_in_process(opts: list[str], cfg: str = CFG) -> int:
    """``linnaeus-accel train --cfg CFG --opts OPTS`` in this process, Accelerate's state forgotten
    before and after; the exit status. Its console goes where the test's does (capsys reads it)."""
    from linnaeus_accel.cli import main

    reset_accelerate()
    try:
        return main(["train", "--cfg", cfg, "--opts", *opts])
    finally:
        reset_accelerate()


def plan_json(*args: str, cfg: str = CFG) -> dict[str, Any]:
    """What ``linnaeus-accel plan --cfg CFG --json ARGS`` says: one JSON object on one line."""
    rc, out, err = run_cli("plan", "--cfg", cfg, "--json", *args)
    assert rc == 0, err
    assert out.endswith("\n")
    assert out.count("\n") == 1, "the JSON must be one object on one line"
    data = json.loads(out)
    assert isinstance(data, dict)
    return data


def plan_text(*args: str, cfg: str = CFG) -> str:
    """What ``linnaeus-accel plan --cfg CFG ARGS`` prints."""
    rc, out, err = run_cli("plan", "--cfg", cfg, *args)
    assert rc == 0, err
    return out


def timeline_rows(text: str) -> dict[str, str]:
    """Of ``plan``'s text: timeline row label -> the cells between the outer bars (the epochs row
    uses '|' as its mark)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Timeline"))
    rows: dict[str, str] = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  ") or "|" not in line:
            break
        first, last = line.index("|"), line.rindex("|")
        rows[line[:first].strip()] = line[first + 1 : last]
    return rows


@contextlib.contextmanager
def as_own_process(extra_env: Mapping[str, str] | None = None) -> Iterator[io.StringIO]:
    """What a process of its own would have, for code run here: the environment as ``launch_env``
    leaves it for the package (the launchers' and our own variables dropped, ``extra_env`` set) and
    put back after, Accelerate's state forgotten before and after, and one console (stdout, stderr
    and the package's warnings, in the order written) yielded. A process configures no logging, so
    its warnings reach stderr through logging's last resort (WARNING and up); here pytest's handler
    on the root logger would take them."""
    console = io.StringIO()
    warnings = logging.StreamHandler(console)
    warnings.setLevel(logging.WARNING)
    saved = dict(os.environ)
    for name in [k for k in os.environ if k in LAUNCHER_VARIABLES or k.startswith(OWN_PREFIXES)]:
        del os.environ[name]
    os.environ.update(extra_env or {})
    reset_accelerate()
    logging.getLogger().addHandler(warnings)
    try:
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            yield console
    finally:
        logging.getLogger().removeHandler(warnings)
        reset_accelerate()
        os.environ.clear()
        os.environ.update(saved)


def run_here(run: TrainRun, args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None) -> Result:
    """``run.run(args=args, extra_env=extra_env)`` (one process) in this process: the same command
    line into the same directory, and a ``Result`` of what that process's console would hold. A
    process of its own spends most of a short run importing torch; use ``run.run`` where the
    behaviour needs one (a kill, a launcher, a namespace). The environment is as ``launch_env``
    leaves it for the package (the launchers' and our own variables dropped, ``extra_env`` set),
    and put back after."""
    from linnaeus_accel.cli import main

    assert run.processes == 1, "a run of several processes needs a launcher: run.run()"
    command = run.command(args, None)[3:]  # what follows `python -m linnaeus_accel`
    started = time.monotonic()
    with as_own_process(extra_env) as console:
        try:
            rc = main(command)
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code if isinstance(exc.code, int) else 1
    return Result(rc, console.getvalue(), run.dir, time.monotonic() - started)


def end_loader_workers() -> None:
    """Shut down the DataLoader workers that runs in this process left running. A process of its
    own leaves them to die with it; here a loader keeps its last iterator, and the workers, until
    the trainer's reference cycles are collected, in an order that can close the iterator's queues
    before it tells its workers to stop: each then waits out a 5 s join before it is terminated
    (seen as tens of seconds in a later test). Shut down while everything is alive, they stop at once."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter

    kinds = (_MultiProcessingDataLoaderIter, _StatefulMultiProcessingDataLoaderIter)
    for obj in gc.get_objects():
        if issubclass(type(obj), kinds):  # type() alone: some objects warn when asked for __class__
            obj._shutdown_workers()


def run_here_ending_workers(
    run: TrainRun, args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
) -> Result:
    """``run_here``, then its DataLoader workers shut down (``end_loader_workers``): for a run with
    ``DATA.NUM_WORKERS`` above 0."""
    try:
        return run_here(run, args, extra_env)
    finally:
        end_loader_workers()


def call_here(
    directory: Path, call: Callable[[], object], extra_env: Mapping[str, str] | None = None
) -> Result:
    """``call()`` (a user's script's ``main``) in this process, as ``run_here`` runs the command
    line: the environment as a process of its own would have it, Accelerate's state forgotten
    before and after, and a ``Result`` (``directory``: the run's output directory) of what its
    console would hold; exit status 0, or 1 after an exception (its traceback in the output). Its
    DataLoader workers are shut down after (``end_loader_workers``)."""
    import traceback

    started = time.monotonic()
    try:
        with as_own_process(extra_env) as console:
            try:
                call()
                rc = 0
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        end_loader_workers()
    return Result(rc, console.getvalue(), directory, time.monotonic() - started)
