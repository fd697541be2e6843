"""The fenced code blocks of a Markdown page, and which of them are runnable Python.

A block runs when its fence's info string is the language alone (```` ```python ````); one with more
(```` ```python title="excerpt" ````) is an excerpt, and so is any other language. Fences indented
inside a list item are read with their indentation removed, as Markdown renders them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

OPENING = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int  # of the opening fence, from 1
    info: str  # the fence's info string, stripped: "python", 'python title="excerpt"', ""
    code: str

    @property
    def runnable_python(self) -> bool:
        return self.info == "python"


def code_blocks(path: Path) -> list[CodeBlock]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = OPENING.match(lines[i])
        # A backtick fence's info string holds no backtick (that line is inline code instead).
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip(" "))
            j += 1
        blocks.append(CodeBlock(path, i + 1, opening["info"].strip(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def runnable_python_blocks(paths: list[Path]) -> list[CodeBlock]:
    """Every runnable Python block of ``paths``, each code once (a snippet the README and a page
    share runs once, under its first place)."""
    seen: set[str] = set()
    blocks = []
    for path in paths:
        for block in code_blocks(path):
            if block.runnable_python and block.code not in seen:
                seen.add(block.code)
                blocks.append(block)
    return blocks
