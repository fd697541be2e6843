"""The validation journal of a checkpoint: one verified line per validation pass completed after
it, so that a run killed mid-validation runs only the passes still missing. Each line is bound to
its checkpoint's marker (``state_files.encode_journal_entry``); appended by the main process
once the checkpoint is committed, read back on resume up to the first line that does not verify."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from ..directory import MARKER
from .files import JOURNAL_FILE, decode_journal, encode_journal_entry

log = logging.getLogger(__name__)


class ValidationJournals:
    def __init__(self, rejected_root: Path) -> None:
        """``rejected_root``: where lines dropped for another reason than a kill are kept."""
        self.rejected_root = rejected_root
        self._bindings: dict[Path, str] = {}  # checkpoint -> sha256 of its marker

    def append(self, checkpoint: Path, entry: dict[str, Any]) -> None:
        """One completed pass ``{"prefix", "metrics"}`` (main process, checkpoint committed)."""
        line = encode_journal_entry(entry["prefix"], entry["metrics"], self._binding(checkpoint))
        with (checkpoint / JOURNAL_FILE).open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def _binding(self, checkpoint: Path) -> str:
        """What a journal line is bound to: the sha256 of its checkpoint's marker."""
        if checkpoint not in self._bindings:
            try:
                self._bindings[checkpoint] = hashlib.sha256((checkpoint / MARKER).read_bytes()).hexdigest()
            except OSError:
                return ""  # no marker: no line verifies
        return self._bindings[checkpoint]

    def read(self, path: Path, cut: bool) -> list[dict[str, Any]]:
        """The passes the journal of the checkpoint at ``path`` records as complete, each
        ``{"prefix", "metrics"}``, up to its first line that does not verify: that line and the
        ones after it are ignored (their passes run again) and, with ``cut`` (the main process),
        cut off, so that the passes journalled next follow a valid line."""
        journal = path / JOURNAL_FILE
        try:
            data = journal.read_bytes()
        except FileNotFoundError:
            return []
        entries, valid, problem = decode_journal(data, self._binding(path))
        if problem is None:
            return entries
        dropped = data[valid:]
        lines = dropped.count(b"\n") + (not dropped.endswith(b"\n"))
        if cut:
            log.warning(
                "validation journal of %s: %s; ignoring it%s: those passes run again",
                path.name,
                problem,
                f" and the {lines - 1} line(s) after it" if lines > 1 else "",
            )
            self._cut(path, journal, valid, dropped, cut_by_kill="incomplete" in problem)
        return entries

    def _cut(self, path: Path, journal: Path, valid: int, dropped: bytes, cut_by_kill: bool) -> None:
        if not cut_by_kill:  # not a kill's half line: kept for whoever investigates
            keep = self.rejected_root / f"{path.name}.{JOURNAL_FILE}.dropped"
            try:
                keep.parent.mkdir(parents=True, exist_ok=True)
                with keep.open("ab") as f:
                    f.write(dropped)
            except OSError as exc:
                log.warning("could not keep the dropped journal lines in %s: %s", keep, exc)
        os.truncate(journal, valid)
