"""`python -m benchmarks --smoke`: every benchmark runs end to end in seconds and reports numbers,
so that none of them rots between full runs (which take minutes and are not part of the suite).

The command runs in a subprocess from the repository root, as its README says to run it: the
benchmarks pin their process to one core and start workers of their own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.configs import REPO

MODULES = (
    "step_overhead",
    "nanogpt_step",
    "hf_trainer",
    "resume",
    "checkpoint",
    "lora_checkpoint",
    "plan",
    "data_loading",
    "data_scale",
    "sharded_streams",
    "resume_data",
    "species",
    "muon",
)


@pytest.mark.slow
def test_smoke_run_of_every_benchmark_reports_finite_numbers(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LINNAEUS_ACCEL_", "ACCELERATE_"))}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,  # a guard against a hang only: this test is about every benchmark running, not speed
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-5000:]}"
    results = json.loads(out.read_text())
    assert results["smoke"] is True
    assert results["failed"] == []
    assert results["machine"]["nproc"] >= 1
    assert results["machine"]["torch"]
    rows = results["rows"]
    # Every benchmark the README lists ran (a missing module is a failure, not a skip) ...
    assert sorted({r["benchmark"] for r in rows}) == sorted(MODULES)
    for r in rows:
        # ... and measured something: a time, and for a comparison its reference, difference and ratio.
        assert isinstance(r["ours"], float), r
        assert math.isfinite(r["ours"]), r
        assert r["ours"] > 0, r
        if r.get("reference") is not None:
            for key in ("reference", "diff", "ratio"):
                assert math.isfinite(r[key]), r
            assert r["n"] >= 1, r
    # The printed table has one line per row, each naming its benchmark and case.
    for r in rows:
        assert any(r["benchmark"] in line and r["case"] in line for line in done.stdout.splitlines()), r
