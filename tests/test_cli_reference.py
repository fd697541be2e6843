"""docs/reference/cli.md is the command-line reference generated from the parser, current and complete."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.configs import REPO

from linnaeus_accel import cli
from linnaeus_accel.cli_reference import COMMAND, render

DOC = REPO / "docs" / "reference" / "cli.md"


def test_docs_reference_cli_md_is_current() -> None:
    assert DOC.exists(), f"docs/reference/cli.md is missing: run `{COMMAND}`"
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/reference/cli.md is stale: run `{COMMAND}`"


def test_every_command_and_flag_that_help_shows_is_in_the_reference() -> None:
    text = render()
    commands = cli._build_parsers()[1]
    assert set(commands) == {"plan", "train", "evaluate", "tokenize"}
    for name, command in commands.items():
        assert f"## `{name}`" in text
        section = text.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        # What `linnaeus-accel <name> --help` lists, read from its own output, not from the parser.
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", command.format_help())) - {"--help"}
        assert flags, name
        for flag in flags:
            assert f"`{flag}" in section, f"{name} {flag} is not in its section of the reference"
        description = " ".join((command.description or "").split())
        assert description[:40] in " ".join(section.split()).replace("&lt;", "<").replace("&gt;", ">")
    assert "`linnaeus-accel --version`" in text
    assert "- `--cfg FILE` (required): YAML config" in text
    assert "- `--text-unit {file,line}`:" in text
    assert "- `INPUT ...`: a text file or a glob pattern" in text


def test_every_exit_status_is_in_the_reference() -> None:
    text = render()
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", text, flags=re.M))
    statuses = {0} | {value for key, value in vars(cli).items() if key.startswith("EXIT_")}
    assert set(map(int, rows)) == statuses
    assert rows[str(cli.EXIT_CONFIG_ERROR)].startswith("config, arguments or output directory refused")
    assert "ENV.OUTPUT.BUCKET" in rows[str(cli.EXIT_NOT_SYNCED)]


def test_help_text_cannot_open_html_in_the_page() -> None:
    # `<ENV.OUTPUT.BASE_DIR>` outside a code span would be an (invisible) HTML tag on the site.
    text = render()
    assert "&lt;ENV.OUTPUT.BASE_DIR&gt;/&lt;EXPERIMENT.NAME&gt;" in text
    assert "&lt;\\|endoftext\\|&gt;" in text
    outside_code = re.sub(r"```.*?```|`[^`]*`|<!--.*?-->", "", text, flags=re.S)
    assert "<" not in outside_code


def test_the_documented_command_writes_the_reference(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "linnaeus_accel.cli_reference"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert out == render()
    assert COMMAND in out
