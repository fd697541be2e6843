"""The promises the repository makes to a new user hold: CI runs the README's test command."""

from __future__ import annotations

import re

from helpers.configs import REPO


def _bash_blocks(markdown: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = _bash_blocks(setup)
    assert len(blocks) == 2, blocks
    run_command, test_command = blocks
    assert "linnaeus-accel" in run_command
    assert test_command.split(" && ")[-1].startswith("pytest"), test_command
    ci_lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci_lines


def test_package_ships_type_information() -> None:
    assert (REPO / "linnaeus_accel" / "py.typed").exists()
