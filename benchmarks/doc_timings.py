"""``python -m benchmarks.doc_timings``: how long every example the documentation shows takes, as a
user would run it, measured on the machine it runs on; written to ``docs/timings.md``, which the
pages quote instead of guessing.

Each example runs alone, one after another, in a fresh process from an empty working directory
(its outputs in a temporary directory), with the user's own settings (torch's default thread count:
no ``OMP_NUM_THREADS``): the shipped configs as ``linnaeus-accel train --cfg FILE``, every script of
``examples/by_feature/``, and every runnable Python block of README.md and docs/ (the blocks
``tests/test_docs_snippets.py`` runs). Wall time is what the user waits; CPU time is every process's
user and system time, the DataLoader workers and launched processes included. Run it on a quiet
machine: other work on the cores lengthens both.

    python -m benchmarks.doc_timings                    # everything, ~12 minutes on 2 cores
    python -m benchmarks.doc_timings --only default     # those whose name contains a word (the other rows stay)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .common import cpu_model

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "timings.md"
CONFIGS = ("default", "digits_classification", "lm_tiny")  # the configs a page says how long they take


@dataclass(frozen=True)
class Example:
    name: str  # as the table shows it
    command: list[str]
    shown: str  # the command as the page gives it


def examples() -> list[Example]:
    """Every example the documentation shows and promises a time for, in the table's order."""
    out = [
        Example(
            f"configs/{name}.yaml",
            [
                sys.executable,
                "-m",
                "linnaeus_accel",
                "train",
                "--cfg",
                str(REPO / "configs" / f"{name}.yaml"),
            ],
            f"linnaeus-accel train --cfg configs/{name}.yaml",
        )
        for name in CONFIGS
    ]
    for script in sorted((REPO / "examples" / "by_feature").glob("*.py")):
        shown = f"python examples/by_feature/{script.name}"
        out.append(Example(f"examples/by_feature/{script.name}", [sys.executable, str(script)], shown))
    nanogpt = REPO / "examples" / "nanogpt_model.py"
    out.append(
        Example(
            "examples/nanogpt_model.py", [sys.executable, str(nanogpt)], "python examples/nanogpt_model.py"
        )
    )
    notebook = REPO / "examples" / "quickstart.ipynb"
    run_notebook = (
        "import nbclient, nbformat, sys; nb = nbformat.read(sys.argv[1], as_version=4); "
        "nbclient.NotebookClient(nb, timeout=600).execute()"
    )
    out.append(
        Example(
            "examples/quickstart.ipynb",
            [sys.executable, "-c", run_notebook, str(notebook)],
            "Run All in examples/quickstart.ipynb (here: executed headless by nbclient)",
        )
    )
    for page, number, code in snippets():
        name = f"{page}, Python block {number}"
        out.append(
            Example(name, [sys.executable, "-c", code], f"the page's Python block {number}, as written")
        )
    return out


def snippets() -> list[tuple[str, int, str]]:
    """(page, its n-th runnable block from 1, code) of every runnable ```python block of README.md
    and docs/ (the rule of tests/helpers/markdown_blocks.py: the language alone runs)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.markdown_blocks import runnable_python_blocks

    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    out, seen = [], {}
    for block in runnable_python_blocks(pages):
        page = block.path.relative_to(REPO).as_posix()
        seen[page] = seen.get(page, 0) + 1
        out.append((page, seen[page], block.code))
    return out


def measure(example: Example) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of it and its children, exit status), from an empty directory."""
    with tempfile.TemporaryDirectory(prefix="doc-timing-") as tmp:
        cwd, out = Path(tmp) / "cwd", Path(tmp) / "out"
        cwd.mkdir()
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env.update(
            EXAMPLES_OUT=str(out),
            HF_HOME=str(Path(tmp) / "hf_home"),
            WANDB_MODE="offline",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        )
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        done = subprocess.run(example.command, cwd=cwd, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        print(f"{example.name} failed ({done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
    return wall, cpu, done.returncode


def machine() -> str:
    model = cpu_model() or platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}"


def kept_rows(page: Path, names: set[str]) -> dict[str, str]:
    """The table lines of ``page`` (written before) of the entries not measured this time, by name."""
    try:
        lines = page.read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 2 and cells[1] and cells[1] not in ("example", "---") and cells[1] not in names:
            out[cells[1]] = line
    return out


def render(rows: list[tuple[Example, float, float, int]], kept: dict[str, str] | None = None) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        "# How long the examples take",
        "",
        "Measured by `python -m benchmarks.doc_timings` (generated: run it again to update this page), "
        f"each example alone, one after another, on {machine()}, on {today}. Wall time is what you wait; CPU time is every "
        "process's own, DataLoader workers included (torch uses every core by default, so it can "
        "exceed the wall time). Every page that says how long an example takes quotes this table. A "
        "busier machine, or one core, takes longer.",
        "",
        "| example | command | wall | CPU |",
        "|---|---|---|---|",
    ]
    measured = {
        example.name: f"| {example.name} | `{example.shown}` | {wall:.0f} s"
        + ("" if status == 0 else f" (failed: exit {status})")
        + f" | {cpu:.0f} s |"
        for example, wall, cpu, status in rows
    }
    kept = kept or {}
    for example in examples():  # the table's order, whichever were measured this time
        if example.name in measured or example.name in kept:
            lines.append(measured.get(example.name) or kept[example.name])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.doc_timings", description=__doc__)
    parser.add_argument(
        "--only", nargs="+", default=[], help="entries whose name contains one of these words"
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"the page to write (default: {OUT.relative_to(REPO)})"
    )
    args = parser.parse_args(argv)
    chosen = [e for e in examples() if not args.only or any(word in e.name for word in args.only)]
    rows = []
    for example in chosen:
        wall, cpu, status = measure(example)
        print(f"{example.name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        rows.append((example, wall, cpu, status))
    # With --only, the rows measured before stay (the date line is this run's).
    kept = kept_rows(args.out, {e.name for e, *_ in rows}) if args.only else {}
    args.out.write_text(render(rows, kept), encoding="utf-8")
    print(f"written to {args.out}")
    return 0 if all(status == 0 for *_, status in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
