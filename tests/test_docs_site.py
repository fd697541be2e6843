"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, a page left
out of the nav or missing fails it), its API page carries the docstrings, and every relative link of
README.md (outside docs/, which mkdocs does not check) leads to a file of the repository."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import markdown
import pytest
from helpers.configs import REPO
from pymdownx.slugs import slugify


def test_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    command = [
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(REPO / "mkdocs.yml"),
        "--site-dir",
        str(site),
    ]
    done = subprocess.run(
        [sys.executable, "-m", *command],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # material's banner about MkDocs 2
        timeout=300,
    )
    problems = "\n".join(line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR")))
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{problems or done.stderr[-3000:]}"
    api = _text(site / "reference" / "api" / "index.html")
    for name in ["Trainer", "load_config", "Callback", "RunContext", "TaskContext", "DistributedContext"]:
        assert f"\n{name}\n" in api, name  # its heading
    # The docstrings themselves, not only the names: read from the source when the site is built.
    assert "Train model on train_data as config says" in api  # Trainer
    assert "A validated config from a YAML file" in api  # load_config
    assert "Every process, after optimizer step step" in api  # Callback.on_step_end
    assert "Optimizer steps completed." in api  # RunContext.global_step
    for decorator in ["register_model", "register_dataset", "register_task", "register_optimizer"]:
        assert f'@{decorator}("' in api, decorator
    assert "atomic commit, verification, retention" in api  # the checkpoint store
    assert "--allow-config-change" in _text(site / "reference" / "cli" / "index.html")


def _text(page: Path) -> str:
    """What a reader sees of an HTML page, one line per block."""
    body = re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8"))
    return html.unescape(re.sub(r"[ \t]*\n\s*", "\n", body))


class _Targets(HTMLParser):
    """The links (``href``, ``src``) and the anchors (``id``) of an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        self.links += [v for k, v in values.items() if k in ("href", "src") and v]
        if values.get("id"):
            self.ids.add(str(values["id"]))


def _targets(path: Path) -> _Targets:
    """As GitHub shows ``path``: its headings' anchors are GitHub's (lower case, hyphens)."""
    rendered = markdown.markdown(
        path.read_text(encoding="utf-8"),
        extensions=["tables", "fenced_code", "toc"],
        extension_configs={"toc": {"slugify": slugify(case="lower")}},
    )
    found = _Targets()
    found.feed(rendered)
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """The relative links of ``page`` that lead to no file under ``root`` (or to no heading of it)."""
    broken = []
    for link in _targets(page).links:
        parts = urlsplit(link)
        if parts.scheme or parts.netloc:
            continue  # a web address: not this repository's to check
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not target.is_relative_to(root) or not target.exists():
            broken.append(f"{link}: no such file in the repository")
        elif parts.fragment and target.suffix == ".md" and parts.fragment not in _targets(target).ids:
            broken.append(f"{link}: {target.relative_to(root)} has no heading #{parts.fragment}")
    return broken


def test_readme_relative_links_lead_to_files_of_the_repository() -> None:
    assert _targets(REPO / "README.md").links, "no link found in README.md"
    assert broken_links(REPO / "README.md", REPO) == []


@pytest.mark.parametrize(
    ("link", "why"),
    [
        ("docs/nowhere.md", "no such file"),
        ("docs/semantics.md#no-such-heading", "has no heading"),
        ("../outside.md", "no such file"),
        ("#no-such-heading", "has no heading"),
    ],
)
def test_a_broken_readme_link_is_named(tmp_path: Path, link: str, why: str) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "semantics.md").write_text("# Semantics\n\n## Steps\n", encoding="utf-8")
    (tmp_path / "outside.md").write_text("# Outside\n", encoding="utf-8")  # beside the repository
    readme = root / "README.md"
    readme.write_text(
        f"# Project\n\n## Set up\n\n[fine](docs/semantics.md#steps), [set up](#set-up), [web](https://x.org/a.md), "
        f"[broken]({link})\n\n```text\n[in code](not/a/link.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(readme, root.resolve())
    assert len(problems) == 1, problems
    assert problems[0].startswith(link)
    assert why in problems[0]
