"""How a data path of the config is read, for messages: a relative path is resolved against the
working directory the command runs from (``BASE`` paths, alone, are relative to their config file),
so a file that is not found is named with the directory it was looked for in."""

from __future__ import annotations

import os
from pathlib import Path


def resolved(pattern: str) -> str:
    """'' for an absolute path; else where a relative one was looked for, in words."""
    expanded = os.path.expanduser(pattern)
    if os.path.isabs(expanded):
        return ""
    return (
        f" (a relative path is read from the working directory, {Path.cwd()}: this is "
        f"{Path(expanded).absolute()}; run from the directory it is relative to, or give an absolute path)"
    )
