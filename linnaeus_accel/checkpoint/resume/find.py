"""Which checkpoint a run resumes from (main process): the newest that verifies locally, else the
newest in the bucket; and what is cleared before resuming. Checkpoints that fail verification are
moved to ``rejected/``, never deleted (one may hold the only copy of the weights); a run whose
checkpoints all fail refuses to start over from step 0 (``ResumeRefused``). When the checkpoint key
is all that fails them (mistyped, or set for a run written without one), nothing is moved: the run
is refused until the key is right."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...config import ConfigError
from ..bucket.remote import HostileKey
from ..directory import MARKER, CheckpointStore, MarkerError, read_marker, step_name
from ..directory.marker import KEY_ENV, SIGNATURE, checkpoint_key, signature_problem
from ..state.content import UNSAFE_FLAG, legacy_pickles

log = logging.getLogger(__name__)


class ResumeRefused(ConfigError):
    """No checkpoint to resume from although the run has some (every one failed verification), or
    ``--resume`` names one that does not verify. Picklable, so that every process can raise it."""

    def __init__(self, problems: Sequence[tuple[str, str]], source: str = "resume") -> None:
        super().__init__(problems, source)
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source))


def find_checkpoint(
    store: CheckpointStore,
    remote: Any,
    auto_resume: bool,
    explicit: str | Path | None,
    allow_pickles: bool = False,
) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and what was skipped on the way (main process).

    Checkpoints that fail verification are moved to ``rejected/`` (never deleted: one of them
    may hold the only copy of the weights). If the run has checkpoints but none verifies, this
    raises ``ResumeRefused`` rather than start over from step 0 by surprise. A checkpoint of the
    previous layout, whose registered state is pickled, is refused unless ``allow_pickles``."""
    if explicit is not None:
        given = Path(explicit)
        problem = store.verify(given, deep=True)
        if problem is not None:  # the user's own path: reported, never moved
            raise ResumeRefused([("--resume", f"{given} is not a usable checkpoint: {problem}")], "arguments")
        _refuse_pickles(given, allow_pickles, "--resume")
        return given, []
    path, skipped = _find_newest(store, remote, auto_resume)
    if path is not None:
        _refuse_pickles(path, allow_pickles, "")
    return path, skipped


def _refuse_pickles(path: Path, allow: bool, key: str) -> None:
    """A checkpoint of the previous layout (its registered state in ``custom_checkpoint_<i>.pkl``,
    which only unpickling with code execution can load) resumes only when its owner says so."""
    pickles = legacy_pickles(path)
    if pickles and not allow:
        names = ", ".join(p.name for p in pickles)
        raise ResumeRefused(
            [
                (
                    key,
                    f"{path} was written by an earlier linnaeus-accel and keeps registered state (an EMA of the "
                    f"weights, a callback's tensors) in {names}, a pickle: loading it can run any code its "
                    f"writer put in it. If you trust whoever could write {path}, pass {UNSAFE_FLAG} to load it "
                    "once (the next checkpoint is written without pickles); else start over with --overwrite, "
                    "or resume from a checkpoint written by this version",
                )
            ],
            "arguments" if key else "resume",
        )


def _find_newest(store: CheckpointStore, remote: Any, auto_resume: bool) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, locally or in the bucket (see ``find_checkpoint``)."""
    if not auto_resume:
        return None, []
    path, failed = store.newest_verified(deep=True)
    key = checkpoint_key()
    signed = path is None and _signed_with(key, failed)  # read before they are moved
    if path is None and not signed and (wrong_key := _wrong_key(store, key, failed)) is not None:
        raise wrong_key  # before anything is moved: with the right key they verify
    using = f"using {path.name}" if path is not None else "no older valid checkpoint"
    skipped: list[str] = []
    refused: list[str] = []  # committed checkpoints that failed: not a kill's leftovers
    for bad, problem in failed:
        committed = (bad / MARKER).is_file()
        moved = store.reject(bad, problem)
        skipped.append(f"{bad.name}: {problem}; {using}; moved to {moved}")
        if committed:
            refused.append(f"{bad.name}: {problem}")
    if path is None and remote is not None:
        # A fresh node after preemption: the bucket has what the local disk lost.
        path, downloads_failed, passed_over = _download_newest(store, remote)
        for step, problem in passed_over:  # rejected in the bucket, like a damaged file: nothing downloaded
            skipped.append(f"{step_name(step)} in the bucket: {problem}; not downloaded")
            refused.append(f"{step_name(step)} (in the bucket): {problem}")
        signed = signed or _signed_with(key, downloads_failed)
        if (
            path is None
            and not signed
            and (wrong_key := _wrong_key(store, key, downloads_failed)) is not None
        ):
            raise wrong_key  # the downloads stay in place, for the rerun with the right key
        for downloaded, remote_problem in downloads_failed:
            moved = store.reject(downloaded, remote_problem)
            skipped.append(
                f"{downloaded.name} from the bucket does not verify: {remote_problem}; moved to {moved}"
            )
            refused.append(f"{downloaded.name} (from the bucket): {remote_problem}")
        if path is not None:
            skipped.append(f"none locally; downloaded step {store.step_of(path)} from the bucket")
    if path is None:
        earlier = [p for p in store.rejected_checkpoints() if p.name not in {n.name for n, _ in failed}]
        if refused or earlier:
            raise ResumeRefused([("", _refusal(store, refused, earlier))])
    return path, skipped


def _download_newest(
    store: CheckpointStore, remote: Any
) -> tuple[Path | None, list[tuple[Path, str]], list[tuple[int, str]]]:
    """The newest checkpoint in the bucket that verifies once downloaded; the newer ones that do
    not, left where they were downloaded to (moved aside only if the key is not to blame); and the
    newer ones not downloaded at all, with why (an object whose key leaves the checkpoint)."""
    failed: list[tuple[Path, str]] = []
    passed_over: list[tuple[int, str]] = []
    for step in reversed(remote.complete_steps()):
        try:
            downloaded = remote.download(step, store.root)
        except HostileKey as exc:
            log.warning("passing over %s in the bucket: %s", step_name(step), exc)
            passed_over.append((step, str(exc)))
            continue
        problem = store.verify(downloaded, deep=True)
        if problem is None:
            return downloaded, failed, passed_over
        failed.append((downloaded, problem))
    return None, failed, passed_over


def _markers(failed: Sequence[tuple[Path, str]]) -> dict[Path, dict[str, Any]]:
    """The readable markers of the checkpoints that failed (not a kill's leftovers)."""
    markers = {}
    for path, _ in failed:
        try:
            markers[path] = read_marker(path)
        except MarkerError:
            continue
    return markers


def _signed_with(key: bytes | None, failed: Sequence[tuple[Path, str]]) -> bool:
    """Whether a checkpoint that failed is signed with the key nonetheless (then it is damaged,
    and the key is not what stops the others)."""
    return key is not None and any(signature_problem(m, key) is None for m in _markers(failed).values())


def _wrong_key(
    store: CheckpointStore, key: bytes | None, failed: Sequence[tuple[Path, str]]
) -> ResumeRefused | None:
    """When none of the run's checkpoints verifies and none is signed with the key: the refusal if
    one of them fails only on its signature (the key is mistyped, or set for checkpoints written
    without one). Moving them aside would leave the run nothing to resume with the right key."""
    if key is None:
        return None
    markers = _markers(failed)
    if not any(
        problem == signature_problem(markers[path], key) and store.verify(path, check_signature=False) is None
        for path, problem in failed
        if path in markers
    ):
        return None
    signed, n = sum(SIGNATURE in marker for marker in markers.values()), len(markers)
    if n == 1:
        what, they = f"the checkpoint in {store.root} is not", "it was"
        how = "its signature does not match it" if signed else "it carries no signature"
    else:
        what, they = f"none of the {n} checkpoints in {store.root} is", "they were"
        how = (
            "their signature does not match it"
            if signed == n
            else "they carry no signature"
            if not signed
            else f"the signature does not match it on {signed}, {n - signed} carry none"
        )
    return ResumeRefused(
        [
            (
                KEY_ENV,
                f"{KEY_ENV} is set but {what} signed with it ({how}): set {KEY_ENV} to the key {they} "
                f"written with, or unset it if {they} written without one (nothing was moved)",
            )
        ]
    )


def _refusal(store: CheckpointStore, refused: list[str], earlier: list[Path]) -> str:
    root, rejected = store.root, store.rejected_root
    if refused:
        noun = "checkpoint" if len(refused) == 1 else f"{len(refused)} checkpoints"
        what = f"none of the {noun} in {root} verifies: {'; '.join(refused)}; they were moved to {rejected}"
    else:
        names = ", ".join(p.name for p in earlier)
        what = (
            f"no checkpoint in {root} verifies; {rejected} holds the run's checkpoints that failed "
            f"verification before ({names}; REJECTED.txt in each says why)"
        )
    return (
        f"{what}. Nothing was deleted and training did not start over from step 0: pass --overwrite to "
        "start over (deleting them), or --resume PATH to resume from a checkpoint you trust"
    )


def discard_after(store: CheckpointStore, step: int) -> list[int]:
    """Before resuming at ``step`` (main process): drop checkpoints newer than ``step``, whose
    futures the resumed run recomputes (and would otherwise collide with), and what an
    interrupted delete left. Newer ones that fail verification are moved to ``rejected/``."""
    store.remove_incomplete(before=step)  # deletes cut short: their markers were already gone
    deleted = []
    for s, path in store.step_dirs():
        if s <= step:
            continue
        problem = store.verify(path, deep=True)
        if problem is None:
            store.delete(s)
            deleted.append(s)
        else:
            moved = store.reject(path, problem)
            log.warning("%s: %s; moved to %s", path.name, problem, moved)
    return deleted
