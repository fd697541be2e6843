"""The documentation's timings are measured (docs/timings.md, by ``python -m benchmarks.doc_timings``),
not guessed: every example it shows has a row there, and no page promises a time in vague words."""

from __future__ import annotations

import re

from helpers.configs import REPO

from benchmarks.doc_timings import OUT, examples

# How the pages used to guess; each now quotes the table.
VAGUE = re.compile(r"in (a )?few seconds|, in seconds\b|(about|well under|under) a minute", re.IGNORECASE)


def test_every_documented_example_has_a_measured_time() -> None:
    table = OUT.read_text(encoding="utf-8")
    rows = {
        line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and " s |" in line
    }
    missing = [e.name for e in examples() if e.name not in rows]
    assert not missing, f"not in docs/timings.md: {missing}; run python -m benchmarks.doc_timings --only ..."
    assert "failed" not in table


def test_no_page_guesses_how_long_an_example_takes() -> None:
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*.md")]
    pages += [*(REPO / "configs").glob("*.yaml"), REPO / "examples" / "quickstart.ipynb"]
    pages.remove(REPO / "docs" / "config.md")  # the keys' reference: "in seconds" there is a unit
    found = [
        f"{page.relative_to(REPO)}: {match.group(0)!r}"
        for page in pages
        for match in VAGUE.finditer(page.read_text(encoding="utf-8"))
    ]
    assert not found, found
