"""``docs/reference/cli.md``, the command-line reference, generated from the argparse parser of
``cli.py``: every command, every flag with its help, and the exit statuses. Regenerate after
changing the parser::

    python -m linnaeus_accel.cli_reference > docs/reference/cli.md

(``tests/test_cli_reference.py`` fails while the file is stale.)
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys

from . import cli

COMMAND = "python -m linnaeus_accel.cli_reference > docs/reference/cli.md"
USAGE_WIDTH = 96  # fits the site's code blocks without scrolling

# Read from cli.py's own lines (``EXIT_X = n  # meaning``): one place says what each status means.
_EXIT_LINE = re.compile(r"^(EXIT_\w+) = (\d+)\s+# (.+)$", re.MULTILINE)


def _markdown(text: str) -> str:
    """Help text as Markdown: what is outside `code spans` cannot open HTML tags or emphasis."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*").replace("|", r"\|")
    return "`".join(parts)


def _synopsis(action: argparse.Action) -> str:
    """How the argument is written: ``--world-size N``, ``--text-unit {file,line}``, ``INPUT ...``."""
    if action.choices is not None:
        value = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        value = str(action.metavar or action.dest.upper())
    if action.nargs in ("+", "*"):
        value = f"{value} ..."
    elif action.nargs == "?":
        value = f"[{value}]"
    if not action.option_strings:
        return value
    flags = ", ".join(action.option_strings)
    return f"{flags} {value}" if action.nargs != 0 else flags


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _usage(parser: argparse.ArgumentParser) -> str:
    """The command's synopsis, wrapped between arguments (never inside one) under its name."""
    lines = [parser.prog]
    for action in _arguments(parser):
        text = _synopsis(action).split(", ")[-1] if action.option_strings else _synopsis(action)
        word = text if action.required or not action.option_strings else f"[{text}]"
        if len(lines[-1]) + 1 + len(word) > USAGE_WIDTH:
            lines.append(" " * len(parser.prog))
        lines[-1] += " " + word
    return "\n".join(lines)


def _item(action: argparse.Action) -> str:
    notes = " (required)" if action.required and action.option_strings else ""
    help_text = _markdown(action.help or "")
    default = action.default
    shown = default not in (None, [], argparse.SUPPRESS) and not isinstance(default, bool)
    if shown and "default" not in help_text:
        help_text += f" (default: `{default}`)"
    return f"- `{_synopsis(action)}`{notes}: {help_text}"


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """Each command's name, one-line help and parser, in the order ``--help`` lists them."""
    found = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in found._choices_actions}
    return [(name, helps[name], command) for name, command in found.choices.items()]


def exit_statuses() -> list[tuple[int, str]]:
    """Every exit status of the command line and what it means, 0 first."""
    found = [(int(number), meaning) for _, number, meaning in _EXIT_LINE.findall(inspect.getsource(cli))]
    return [(0, "done: the command did what it was asked (a run completed, stopped early or was preempted, or was already finished)"), *sorted(found)]  # fmt: skip


def render() -> str:
    parser = cli.build_parser()
    commands = _commands(parser)
    lines = [
        "# Command line",
        "",
        "<!-- Generated from the argparse parser of linnaeus_accel/cli.py: edit the parser, then run",
        f"     {COMMAND}",
        "     (tests/test_cli_reference.py fails while this file is stale). -->",
        "",
        f"`{parser.prog} COMMAND ...`, also `python -m linnaeus_accel COMMAND ...` and, on several processes,",
        "`accelerate launch -m linnaeus_accel COMMAND ...`. Every command takes `-h`/`--help`;",
        f"`{parser.prog} --version` prints the version.",
        "",
        "| command | what it does |",
        "|---|---|",
        *(f"| [`{name}`](#{name}) | {_markdown(help_text)} |" for name, help_text, _ in commands),
    ]
    for name, _, command in commands:
        lines += ["", f"## `{name}` {{#{name}}}", "", _markdown(command.description or ""), ""]
        lines += ["```text", _usage(command), "```", ""]
        lines += [_item(action) for action in _arguments(command)]
    lines += ["", "## Exit statuses", "", "| status | meaning |", "|---|---|"]
    lines += [f"| {number} | {_markdown(meaning)} |" for number, meaning in exit_statuses()]
    lines += [
        "",
        "These are each process's own. Under `accelerate launch --multi_gpu` (or `torchrun`) the launcher",
        "exits 1 for any of 1, 2 and 3, after torchelastic's `ChildFailedError` traceback and its table of",
        "failed processes; with one process (no `--multi_gpu`), `accelerate launch` ends with a",
        "`CalledProcessError` traceback instead (none with `--quiet`), also status 1.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
