"""``python -m benchmarks [--smoke] [--only NAME ...] [--json PATH]``, from the repository root.

Runs each benchmark module in turn (``benchmarks.MODULES``), prints one table and writes the rows
with the machine they were measured on to a JSON file. A module that cannot be imported, raises,
or returns a row with a number that is not finite is recorded as one failed row, the others still
run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from . import MODULES
from .common import Row, cpu_model
from .lockstep import shared_pair

REPO = Path(__file__).resolve().parents[1]
# The checked-in results are the latest full run of every benchmark; a smoke or partial run
# writes beside them instead of over them.
RESULTS = REPO / "benchmarks" / "results.json"
SMOKE_RESULTS = REPO / "benchmarks" / "results_smoke.json"
PARTIAL_RESULTS = REPO / "benchmarks" / "results_partial.json"
NUMBERS = ("ours", "reference", "diff", "ratio")
COLUMNS = ("benchmark", "case", "ours", "reference", "diff", "ratio", "n", "target", "ok")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "--smoke", action="store_true", help="the seconds-long run of every benchmark the test suite makes"
    )
    parser.add_argument(
        "--only", nargs="+", choices=MODULES, metavar="NAME", help=f"run only these: {', '.join(MODULES)}"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="where to write the results (default benchmarks/results.json for a full run of every "
        "benchmark, results_smoke.json with --smoke, results_partial.json with --only)",
    )
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = SMOKE_RESULTS if args.smoke else PARTIAL_RESULTS if args.only else RESULTS
    return args


def row_problem(item: Any) -> str | None:
    """What is wrong with a row a module returned, or None."""
    if not isinstance(item, dict) or not item.get("case"):
        return f"not a row: {item!r}"
    for key in NUMBERS:
        value = item.get(key)
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            return f"row {item['case']!r}: {key} is {value!r}"
    if item.get("ours") is None and not str(item.get("note", "")).startswith("skipped"):
        return f"row {item['case']!r} has no measurement and does not say why it was skipped"
    return None


def run_module(name: str, smoke: bool) -> tuple[list[Row], str | None]:
    """The module's rows, or one failed row and the error."""
    import torch  # imported already (``main``): its thread count is restored below

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        module = importlib.import_module(f"benchmarks.{name}")
        rows = list(module.run(smoke))
        problems = [p for p in map(row_problem, rows) if p is not None]
        if not rows:
            problems.append("returned no row")
        if problems:
            raise ValueError("; ".join(problems))
        return rows, None
    except Exception as exc:
        traceback.print_exc()
        # One line for the table: the error's first line and, for a worker's traceback, its last.
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
        error = f"{type(exc).__name__}: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")
        failed: Row = {"benchmark": name, "case": "FAILED", "ok": False, "target": None, "note": error}
        return [failed], error
    finally:  # a module pins itself to one core with one torch thread: the next one starts afresh
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


# -- the table ---------------------------------------------------------------------------------
def seconds_text(value: float | None, signed: bool = False) -> str:
    """A time to 3 significant digits in the unit that reads best: 12.3 µs, 4.56 ms, 1.23 s."""
    if value is None:
        return ""
    size = abs(value)
    scale, unit = (1e6, "µs") if size < 1e-3 else (1e3, "ms") if size < 1 else (1.0, "s")
    number = value * scale
    sign = "+" if signed else ""
    text = f"{number:{sign}.0f}" if abs(number) >= 1000 else f"{number:{sign}.3g}"
    return f"{text} {unit}"


def mib_text(value: float | None, signed: bool = False) -> str:
    """A memory size (rows whose unit starts with "MiB")."""
    return "" if value is None else f"{value:{'+' if signed else ''}.1f} MiB"


def number_text(value: float | None, signed: bool = False) -> str:
    """A count or a fraction (rows whose unit is neither seconds nor MiB)."""
    return "" if value is None else f"{value:{'+' if signed else ''}.4g}"


def cells(item: Row) -> list[str]:
    ok = item.get("ok")
    ratio = item.get("ratio")
    unit = str(item.get("unit", "s"))
    text = (
        seconds_text
        if unit.startswith("s ") or unit == "s"
        else mib_text
        if unit.startswith("MiB")
        else number_text
    )
    return [
        item.get("benchmark", ""),
        item.get("case", ""),
        text(item.get("ours")),
        text(item.get("reference")),
        text(item.get("diff"), signed=True),
        "" if ratio is None else f"{ratio:.3f}",
        str(item.get("n", "")),
        item.get("target") or "",
        "" if ok is None else "yes" if ok else "NO",
    ]


def table(rows: list[Row]) -> str:
    lines = [list(COLUMNS), *(cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    numeric = {2, 3, 4, 5, 6}
    out = []
    for k, line in enumerate(lines):
        out.append(
            "  ".join(
                c.rjust(w) if i in numeric and k else c.ljust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    notes = [f"  {r.get('benchmark')} / {r.get('case')}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(out + (["", "notes:", *notes] if notes else []))


# -- the machine -------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """Where the rows were measured."""
    model = cpu_model()
    versions: dict[str, str | None] = {}
    for package in ("torch", "accelerate", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "nproc": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model or platform.processor(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [m for m in MODULES if args.only is None or m in args.only]
    import torch  # noqa: F401  (before any module: the thread count it starts with is the default)

    rows: list[Row] = []
    failed: list[str] = []
    durations: dict[str, float] = {}
    # A smoke run's lock-steps share one pair of workers (their imports paid once); a full run's
    # take fresh pairs, as its statistics need.
    with shared_pair() if args.smoke else contextlib.nullcontext():
        for name in names:
            print(f"-- {name}{' (smoke)' if args.smoke else ''} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            module_rows, error = run_module(name, args.smoke)
            durations[name] = round(time.perf_counter() - started, 2)
            rows += module_rows
            if error is not None:
                failed.append(name)
            print(
                f"   {name}: {durations[name]:.1f} s{' FAILED: ' + error if error else ''}", file=sys.stderr
            )
    print(table(rows))
    result = {
        "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
        "smoke": args.smoke,
        "machine": machine(),
        "seconds_per_benchmark": durations,
        "failed": failed,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    missed = [r for r in rows if r.get("ok") is False and r.get("case") != "FAILED"]
    print(f"\n{len(rows)} rows, {len(missed)} targets missed; written to {args.json}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
