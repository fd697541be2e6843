"""A refusal under `accelerate launch --multi_gpu --num_processes 2`, as docs/guides/multi-process.md describes it.

Every process meets the bad value; the local main process says it, once, and exits 2. The
launcher then does what Accelerate and torchelastic do with any failed worker, which no worker can
change: a ``ChildFailedError`` traceback and exit status 1. Its root cause is the main process
(exit code 2), shown as a refusal explained on that process's stderr instead of torch's pointer to
a page on recording tracebacks, and without repeating the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launches import accelerate_launch

from linnaeus_accel.process.launcher import REFUSED


@pytest.mark.slow
def test_a_refusal_is_said_once_and_the_launchers_report_calls_it_one(tmp_path: Path) -> None:
    run = accelerate_launch("refused", ["EXPERIMENT.SEED", "4294967296"], tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 1, run.tail()  # the launcher's, whatever the worker's
    reason = "EXPERIMENT.SEED: must be at most 4,294,967,295 (got 4,294,967,296)"
    assert output.count(reason) == 1, run.tail()  # once: not per process, not again in the report
    assert output.count("linnaeus-accel: invalid config (1 problem):") == 1, run.tail()
    root_cause = output.partition("Root Cause (first observed failure):")[2]
    assert "rank      : 0 (local_rank: 0)" in root_cause, run.tail()
    assert "exitcode  : 2 " in root_cause, run.tail()
    assert f"traceback : {REFUSED}" in root_cause, run.tail()
    assert "To enable traceback" not in output, run.tail()
    assert not run.dir.exists(), run.tail()
