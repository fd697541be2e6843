"""examples/by_feature/: every script runs as its docstring says and checks its own result, and both
tables that list the scripts (its README and docs/examples.md) list every one of them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # an Accelerate dependency
import pytest
from helpers.configs import REPO
from helpers.processes import accelerate_launch_command, launch_env

BY_FEATURE = REPO / "examples" / "by_feature"
SCRIPTS = sorted(BY_FEATURE.glob("*.py"))
TIMEOUT_S = 180  # each takes under 10 s alone on 2 cores; the suite's load can make that several times longer


def run_example(command: list[str], tmp_path: Path) -> tuple[Path, float]:
    """Run ``command`` from an empty working directory with ``EXAMPLES_OUT`` under ``tmp_path``; past
    the timeout, kill it and every process it started (the multi-process example's workers). Where
    it wrote, and how long it took."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    out.mkdir()
    env = launch_env(tmp_path, extra={"EXAMPLES_OUT": str(out)})
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{command[-1]} ran past {TIMEOUT_S} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, f"{command[-1]} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert not any(cwd.iterdir()), f"{command[-1]} wrote into its working directory: {list(cwd.iterdir())}"
    assert any(out.iterdir()), f"{command[-1]} wrote nothing under EXAMPLES_OUT"
    return out, elapsed


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_example_runs_and_checks_its_result(script: Path, tmp_path: Path) -> None:
    """``python examples/by_feature/<name>.py`` exits 0: the script asserts what it shows (an exact
    resume, the mixture's shares, the adapter loaded back, ...), so a broken feature fails here."""
    _, elapsed = run_example([sys.executable, str(script)], tmp_path)
    print(f"{script.name}: {elapsed:.1f} s")  # shown with -s: the budget is about 10 s alone


@pytest.mark.slow
def test_multi_process_example_under_accelerate_launch(tmp_path: Path) -> None:
    """The command its docstring gives: 2 CPU processes (gloo) started by ``accelerate launch`` write
    one run, into the directory the main process picked."""
    out, _ = run_example([*accelerate_launch_command(2), str(BY_FEATURE / "multi_process.py")], tmp_path)
    (picked,) = out.iterdir()
    assert (picked / "processes_2" / "summary.json").is_file()


def test_every_script_says_what_it_shows_and_how_to_run_it() -> None:
    for script in SCRIPTS:
        docstring = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8")))
        assert docstring, f"{script.name} has no docstring"
        assert f"python examples/by_feature/{script.name}" in docstring, script.name


@pytest.mark.parametrize(
    "table", [BY_FEATURE / "README.md", REPO / "docs" / "examples.md"], ids=["readme", "docs"]
)
def test_the_tables_list_every_script(table: Path) -> None:
    """A new script is listed (a script removed is unlisted) in both tables, with its command."""
    text = table.read_text(encoding="utf-8")
    listed = set(re.findall(r"`examples/by_feature/(\w+\.py)`", text))
    assert listed == {script.name for script in SCRIPTS}
    for script in SCRIPTS:
        assert f"python examples/by_feature/{script.name}" in text, script.name
