"""Crash-safe checkpoint directories on the local filesystem: atomic commit, verification, retention.

Layout under ``root = <output_dir>/checkpoints``::

    .staging-step_00001234/   being written (save_state of every process + trainer_state.json)
    .deleting-step_00001000/  being deleted (marker already gone)
    step_00001234/            published; complete only once COMMITTED.json exists and verifies
        COMMITTED.json        {"version": 1, "step": 1234, "files": [{path, size, xxh3_128}], "info": {}}
    rejected/step_00001100/   failed verification (or never got its marker): moved aside, never
        REJECTED.txt          deleted by us; says why and when (written before the move: ``rejection``)

Named by global step, never by a save counter (accelerate issues #1601, #3306: counters restart
or collide on resume). Commit: hash and fsync every staged file, rename staging to the final name,
fsync the parent, then write the marker atomically, last. A kill -9 at any instant leaves no marker
(ignored) or a marker whose files are all there. Deletion removes the marker first.

Files are hashed with XXH3-128 (SHA-256 in markers from before it; both verify), on a few threads:
see ``digests``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from ...digests import DIGEST, FileEntry, hash_file, hash_files
from ...durable_files import fsync_directory, write_durably
from .marker import (
    MARKER,
    MARKER_TMP,
    MARKER_VERSION,
    SIGNATURE,
    MarkerError,
    checkpoint_key,
    read_marker,
    signature,
    signature_problem,
)
from .rejection import NOTE_TMP, REJECTED_DIR, note_problem, write_note
from .retention import Mode, retained

_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".deleting-"  # a checkpoint being deleted: renamed out of the way, then removed
_NAME = re.compile(r"step_(\d{8,})")


def node_part(marker: Mapping[str, Any]) -> str | None:
    """Why a committed directory is one machine's part of a checkpoint, not a checkpoint (node-local
    mode: each machine commits its own processes' files; the whole one is in the bucket), or None."""
    info = marker.get("info")
    if not isinstance(info, dict) or "node" not in info:
        return None
    return (
        f"holds only the files of machine {info['node']} of the {info.get('nodes', '?')} that took it "
        "(the whole checkpoint is in the bucket)"
    )


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step_{step:08d}"


class CheckpointStore:
    """The checkpoints of one run, in ``root`` (``<output_dir>/checkpoints``).

    ``staging_dir`` and ``commit``, ``delete``, ``reject``, ``apply_retention`` and
    ``remove_stale_staging`` change the directory and belong to the main process only; the readers
    are safe anywhere.

    ``journal``: the name of the one file allowed in a checkpoint beyond its manifest (its owner
    appends to it after the commit and verifies it itself). ``check(path)``: the owner's own
    validation of a checkpoint whose files verified (e.g. of the state it will read), None if fine,
    else what is wrong.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        journal: str | None = None,
        check: Callable[[Path], str | None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.journal = journal
        self.check = check

    # -- paths ---------------------------------------------------------------------------------------
    def final_path(self, step: int) -> Path:
        return self.root / step_name(step)

    def staging_path(self, step: int) -> Path:
        return self.root / f"{_STAGING_PREFIX}{step_name(step)}"

    @property
    def rejected_root(self) -> Path:
        return self.root / REJECTED_DIR

    def step_of(self, path: Path | str) -> int | None:
        """The step of a checkpoint directory: from its name, else from its marker (``--resume``
        may name a copy with any name), else None."""
        match = _NAME.fullmatch(Path(path).name)
        if match:
            return int(match.group(1))
        try:
            return int(read_marker(Path(path))["step"])
        except MarkerError:
            return None

    # -- writing (main process) ----------------------------------------------------------------------
    def staging_dir(self, step: int) -> Path:
        """An empty staging directory for ``step`` (a stale one from a crash is removed)."""
        staging = self.staging_path(step)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging

    def commit(
        self,
        step: int,
        info: Mapping[str, Any] | None = None,
        *,
        replace: bool = False,
        sealed: Mapping[str, FileEntry] | None = None,
    ) -> Path:
        """Publish the staged checkpoint of ``step`` atomically; call after every process saved.

        A committed checkpoint of the same step is an error (FileExistsError) unless ``replace``:
        then it is deleted first (a run resumed on purpose from an older checkpoint). ``sealed``:
        entries of files already hashed and fsynced since they were written (``EarlySeal``), by
        relative path; the others are hashed now.
        """
        staging, final = self.staging_path(step), self.final_path(step)
        info = dict(info or {})
        json.dumps(info)  # fail before publishing, not between the rename and the marker
        manifest = self._seal(staging, sealed or {})
        if replace:
            self.delete(step)
        self._publish(staging, final)
        try:
            self._mark(final, step, manifest, info)
        except OSError:
            # E.g. no space left for the marker: the directory would be an ignored leftover that
            # takes the space the previous checkpoints need; it is this commit's own, and unmarked.
            if not (final / MARKER).exists():
                shutil.rmtree(final, ignore_errors=True)
            raise
        return final

    def _seal(self, staging: Path, sealed: Mapping[str, FileEntry] | None = None) -> list[FileEntry]:
        """Hash and fsync every staged file not in ``sealed`` (whose size must still be the one it
        was hashed at); the manifest the marker will carry."""
        if (staging / MARKER).exists() or (staging / MARKER_TMP).exists():
            # It would make the directory look complete the moment it is renamed.
            raise ValueError(f"{staging} already contains {MARKER}")
        files: list[Path] = []
        dirs: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(staging):
            dirnames.sort()
            here = Path(dirpath)
            dirs.append(here)
            for name in sorted(filenames):
                file = here / name
                if file.is_symlink() or not file.is_file():
                    raise ValueError(f"{file} is not a regular file; checkpoints hold regular files only")
                files.append(file)
        if not files:
            raise ValueError(f"{staging} is empty: nothing was saved into it")
        manifest = []
        rest = []
        for file in files:
            entry = (sealed or {}).get(file.relative_to(staging).as_posix())
            if entry is not None and entry["size"] == file.stat().st_size:
                manifest.append(dict(entry))
            else:
                rest.append(file)
        manifest += hash_files(staging, rest)
        for here in dirs:
            fsync_directory(here)  # the entries of files created in it
        return sorted(manifest, key=lambda entry: str(entry["path"]))

    def _publish(self, staging: Path, final: Path) -> None:
        """Rename the sealed staging directory to its final name (no marker yet: still ignored)."""
        if final.exists():
            # Deep: a corrupt checkpoint that resume skipped must not block the run re-saving it.
            problem = self.verify(final, deep=True)
            if problem is None:
                raise FileExistsError(f"{final} is already a committed checkpoint")
            # A leftover without a valid marker (a crash between rename and marker), or corrupt:
            # moved aside, not deleted.
            self.reject(final, problem)
        os.replace(staging, final)
        fsync_directory(self.root)

    def _mark(self, final: Path, step: int, manifest: list[FileEntry], info: Mapping[str, Any]) -> None:
        """Write COMMITTED.json, last: from this instant the checkpoint counts."""
        marker: dict[str, Any] = {
            "version": MARKER_VERSION,
            "step": step,
            "files": manifest,
            "info": dict(info),
        }
        key = checkpoint_key()
        if key is not None:
            marker[SIGNATURE] = signature(marker, key)
        write_durably(final / MARKER, final / MARKER_TMP, json.dumps(marker, indent=1).encode("utf-8"))

    def delete(self, step: int) -> None:
        """Remove a checkpoint: the marker first, so a crash mid-delete leaves an ignored directory,
        then rename it to ``.deleting-`` before the slow removal, for ``remove_stale_staging``."""
        final = self.final_path(step)
        if not final.exists():
            return
        (final / MARKER).unlink(missing_ok=True)
        fsync_directory(final)
        trash = self.root / f"{_TRASH_PREFIX}{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        shutil.rmtree(trash)

    def reject(self, path: Path, reason: str) -> Path:
        """Move the checkpoint directory ``path`` (under ``root``) to ``rejected/``, with a
        ``REJECTED.txt`` saying why and when, written (durably) before the move; where it now is.
        Nothing else in it is changed or lost."""
        write_note(path, self.root, reason)
        self.rejected_root.mkdir(exist_ok=True)
        target = self.rejected_root / path.name
        n = 1
        while target.exists() or target.is_symlink():
            n += 1
            target = self.rejected_root / f"{path.name}.{n}"
        os.replace(path, target)
        fsync_directory(self.root)
        fsync_directory(self.rejected_root)
        return target

    def rejected_checkpoints(self) -> list[Path]:
        """The directories in ``rejected/`` that carry a marker: checkpoints of this run that
        failed verification (not the leftovers of a commit cut before its marker)."""
        if not self.rejected_root.is_dir():
            return []
        return sorted(p for p in self.rejected_root.iterdir() if p.is_dir() and (p / MARKER).is_file())

    def remove_stale_staging(self) -> list[Path]:
        """Delete the staging (and half-deleted) directories a crash left, and finish the
        rejections it cut short (a checkpoint holding its ``REJECTED.txt`` is moved to ``rejected/``;
        a note it was still writing is removed); call at start, on the main process, before any
        process saves. Returns what was removed from ``root``."""
        if not self.root.is_dir():
            return []
        stale = sorted(p for p in self.root.iterdir() if p.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)))
        for path in stale:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        for _, path in self._step_dirs():
            (path / NOTE_TMP).unlink(missing_ok=True)
            if (problem := note_problem(path)) is not None:
                self.reject(path, problem)  # keeps the note, and its reason
                stale.append(path)
        return stale

    def remove_incomplete(self, before: int | None = None) -> list[Path]:
        """Delete ``step_*`` directories without a marker (a crash between rename and marker, or
        early in a delete) older than step ``before`` (default: all): never used, and may be large.
        Call after ``newest_valid`` has reported them, on the main process, while no commit runs.
        Returns what was removed."""
        incomplete = [
            path
            for step, path in self._step_dirs()
            if not (path / MARKER).is_file() and (before is None or step < before)
        ]
        for path in incomplete:
            shutil.rmtree(path)
        return incomplete

    def apply_retention(
        self,
        metrics: Mapping[int, float | None],
        keep_top: int,
        keep_last: int,
        mode: Mode,
        protect: Collection[int] = (),
        rejected: list[str] | None = None,
    ) -> list[int]:
        """Delete the committed checkpoints that ``retained`` does not keep; the steps gone.
        ``metrics``: step -> ranking metric (missing: not known yet). Only marked ones take part.
        One that fails verification (size-only) is moved to ``rejected/`` instead of deleted, and
        a message saying so is appended to ``rejected``."""
        steps = self.complete_steps()
        keep = retained([(s, metrics.get(s)) for s in steps], keep_top, keep_last, mode, protect)
        gone = [s for s in steps if s not in keep]
        for step in gone:
            final = self.final_path(step)
            problem = self.verify(final, deep=False, whole=False)  # a machine's part goes as a whole one
            if problem is None:
                self.delete(step)
                continue
            moved = self.reject(final, problem)
            if rejected is not None:
                rejected.append(
                    f"{final.name}: {problem}; retention moved it to {moved} instead of deleting it"
                )
        return gone

    # -- reading -------------------------------------------------------------------------------------
    def step_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step_*`` directory, marked or not, ascending."""
        return self._step_dirs()

    def _step_dirs(self) -> list[tuple[int, Path]]:
        paths = self.root.iterdir() if self.root.is_dir() else iter(())
        matches = ((_NAME.fullmatch(p.name), p) for p in paths)
        return sorted((int(m.group(1)), p) for m, p in matches if m and p.is_dir())

    def complete_steps(self) -> list[int]:
        """Steps whose directory has a marker, ascending (presence only: cheap; see ``verify``)."""
        return [step for step, path in self._step_dirs() if (path / MARKER).is_file()]

    def is_committed(self, step: int) -> bool:
        """Whether step ``step`` has a committed checkpoint (its marker is there: presence only)."""
        return (self.final_path(step) / MARKER).is_file()

    def verify(
        self, path: Path | str, *, deep: bool = True, check_signature: bool = True, whole: bool = True
    ) -> str | None:
        """None if ``path`` is a complete checkpoint, else what is wrong with it: its marker is signed
        with the checkpoint key if one is set (unless not ``check_signature``: whether the key is all
        that stops it); it is not one machine's part of a checkpoint (unless not ``whole``); every
        manifest file exists with its size and, with ``deep`` (reads everything), its digest; no
        other file is there but the journal; and the owner's ``check`` passes."""
        path = Path(path)
        if (rejected := note_problem(path)) is not None:
            return rejected  # a rejection cut short before its move; or a rejected copy, not repaired
        try:
            marker = read_marker(path)
        except MarkerError as e:
            return str(e)
        if check_signature and (problem := signature_problem(marker, checkpoint_key())) is not None:
            return problem
        if whole and (part := node_part(marker)) is not None:
            return part
        match = _NAME.fullmatch(path.name)
        if match and int(match.group(1)) != marker["step"]:
            return f"{MARKER} is for step {marker['step']}, not {int(match.group(1))}"
        problem = self._unlisted(path, marker)
        if problem is not None:
            return problem
        inside = path.resolve()
        for entry in marker["files"]:
            file = path / entry["path"]
            if not file.is_file():
                return f"{entry['path']}: missing"
            if file.is_symlink() or not file.resolve().is_relative_to(inside):
                return f"{entry['path']}: not a regular file inside the checkpoint"
            size = file.stat().st_size
            if size != entry["size"]:
                return f"{entry['path']}: size {size} != {entry['size']}"
            algorithm = DIGEST if DIGEST in entry else "sha256"
            if deep and hash_file(file, sync=False, algorithm=algorithm)[1] != entry[algorithm]:
                return f"{entry['path']}: checksum mismatch"
        return self.check(path) if self.check is not None else None

    def _unlisted(self, path: Path, marker: Mapping[str, Any]) -> str | None:
        """The first entry of ``path`` that its manifest does not account for: a resume must read
        nothing the commit did not seal (Accelerate would load a stray ``custom_checkpoint_0.pkl``,
        or refuse to)."""
        listed = {str(entry["path"]) for entry in marker["files"]}
        files = listed | {MARKER} | ({self.journal} if self.journal else set())
        dirs = {parent.as_posix() for rel in listed for parent in PurePosixPath(rel).parents}
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            here = Path(dirpath).relative_to(path)
            for name in dirnames:
                rel = (here / name).as_posix()
                if rel not in dirs or (Path(dirpath) / name).is_symlink():
                    return f"{rel}/: not in {MARKER} (nothing but what was committed is read)"
            for name in sorted(filenames):
                rel = (here / name).as_posix()
                if rel not in files:
                    return f"{rel}: not in {MARKER} (nothing but what was committed is read)"
        return None

    def newest_valid(self, *, deep: bool = True) -> tuple[Path | None, list[str]]:
        """The newest checkpoint that verifies, and one message per newer directory skipped."""
        chosen, failed = self.newest_verified(deep=deep)
        using = f"using {chosen.name}" if chosen is not None else "no older valid checkpoint"
        return chosen, [f"{path.name}: {problem}; {using}" for path, problem in failed]

    def newest_verified(self, *, deep: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest checkpoint that verifies, and ``(path, problem)`` of each newer directory
        that does not (newest first). Reads only; see ``reject``."""
        failed: list[tuple[Path, str]] = []
        for _, path in reversed(self._step_dirs()):
            problem = self.verify(path, deep=deep)
            if problem is None:
                return path, failed
            if problem == f"{MARKER} missing":
                problem += " (incomplete write?)"
            failed.append((path, problem))
        return None, failed
