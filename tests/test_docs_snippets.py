"""What a user copies from the README and the documentation site runs as written: every
```python block of README.md and docs/**/*.md, in a fresh interpreter, from an empty directory,
on the CPU, offline. An excerpt is fenced with more than the language (```python title="excerpt")
or as ```text, and is not run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.configs import REPO
from helpers.markdown_blocks import CodeBlock, code_blocks, runnable_python_blocks
from helpers.processes import launch_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SNIPPETS = runnable_python_blocks(PAGES)


def snippet_id(block: CodeBlock) -> str:
    return f"{block.path.relative_to(REPO)}:{block.line}"


@pytest.mark.slow
@pytest.mark.parametrize("block", SNIPPETS, ids=snippet_id)
def test_python_snippet_runs_as_written(block: CodeBlock, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", block.code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=launch_env(tmp_path),
    )
    assert done.returncode == 0, f"{snippet_id(block)} failed:\n{block.code}\n{done.stderr[-3000:]}"


def test_only_plain_python_fences_run(tmp_path: Path) -> None:
    """The rule the pages are written to: the language alone runs; anything more, another
    language or a fence inside a list item's indentation is read as Markdown renders it."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)\n```\n\n"
        '```python title="excerpt"\nMyNet(...)\n```\n\n'
        "```py\nalso_an_excerpt()\n```\n\n"
        "- an item\n\n    ```python\n    print(2)\n    ```\n\n"
        "````text\n```python\nnot a block of its own\n```\n````\n\n"
        "```python\nprint(1)\n```\n",
        encoding="utf-8",
    )
    assert [(b.line, b.info) for b in code_blocks(page)] == [
        (1, "python"),
        (5, 'python title="excerpt"'),
        (9, "py"),
        (15, "python"),
        (19, "text"),
        (25, "python"),
    ]
    assert [b.code for b in runnable_python_blocks([page, page])] == ["print(1)\n", "print(2)\n"]


def test_the_site_has_snippets_to_run() -> None:
    assert any(b.path.is_relative_to(REPO / "docs") for b in SNIPPETS), "no runnable python block in docs/"
