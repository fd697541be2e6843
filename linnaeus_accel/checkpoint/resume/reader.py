"""Reading a run's checkpoints back: which one to resume from (verified first: ``find``), and
loading it (Accelerate's model, optimizer and RNG states, and our own state, decoded).

Everything a resume reads is verified first (``checkpoint.state.files.check_state`` through the store): the
files the marker lists, no file it does not list but the journal, our JSON state, and each journal
line (a line that fails is ignored with everything after it). A checkpoint that fails is moved to
``checkpoints/rejected/``, never deleted; a run whose checkpoints all fail refuses to start over
(``ResumeRefused``). ``checkpoint.save.writer.CheckpointWriter`` writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from safetensors.torch import load_file

from ...config import ConfigError
from ...config.sections import TrainConfig
from ..directory import CheckpointStore
from ..state import tensor_state
from ..state.content import (
    TENSORS_FILE,
    CheckpointLoadError,
    first_line,
    rng_problem,
    saved_processes,
    seed_new_process,
)
from ..state.files import STATE_FILE, checkpoint_store, rank_files, read_json
from ..state.journal import ValidationJournals
from .find import ResumeRefused, discard_after, find_checkpoint


class CheckpointReader:
    def __init__(
        self,
        accelerator: Accelerator,
        train: TrainConfig,
        output_dir: Path,
        store: CheckpointStore | None = None,
        remote: Any = None,
    ) -> None:
        """``train``: the TRAIN section (AUTO_RESUME); ``store``: the run's checkpoints (default: those
        of its output directory, ``output_dir``); ``remote``: the bucket a fresh machine downloads the
        newest one from (``RemoteCheckpoints``, main process)."""
        self.accelerator, self.train = accelerator, train
        self.store = store if store is not None else checkpoint_store(output_dir / "checkpoints")
        self.remote = remote
        self.journals = ValidationJournals(self.store.rejected_root)
        self.load_options: dict[str, Any] = {}  # for load_state (strict=False: frozen weights)
        self.allow_pickles = False  # --unsafe-load-pickles: a previous layout's pickled state loads

    def find_everywhere(self, explicit: str | Path | None) -> tuple[Path | None, list[str]]:
        """``find`` on the main process, its answer (or refusal) on every process (collective)."""
        found: Any = (None, [])
        if self.accelerator.is_main_process:
            try:
                found = self.find(explicit)
            except ResumeRefused as exc:  # every process stops with it: none waits at a barrier
                found = exc
        found = broadcast_object_list([found], from_process=0)[0]
        if isinstance(found, ResumeRefused):
            raise found
        path, skipped = found
        return path, skipped

    def find(self, explicit: str | Path | None) -> tuple[Path | None, list[str]]:
        """The checkpoint to resume from and what was skipped on the way (main process)."""
        auto = self.train.AUTO_RESUME
        return find_checkpoint(self.store, self.remote, auto, explicit, self.allow_pickles)

    def discard_after(self, step: int) -> list[int]:
        """Before resuming at ``step`` (main process): drop the checkpoints after it."""
        return discard_after(self.store, step)

    def read_state(self, path: Path) -> dict[str, Any]:
        """Our JSON state of the checkpoint at ``path`` (``check_state`` has passed for it), as
        written: for the trainer's own entries (progress, plan, config). The parts' state in it is
        still encoded (``tensor_state``): ``load`` decodes it, the one reader that hands it back."""
        state, problem = read_json(path / STATE_FILE)
        if problem is None and not isinstance(state, dict):
            problem = f"{STATE_FILE} is not a JSON object"
        if problem is not None:
            raise ResumeRefused([("", f"{path}: {problem}")])
        return state  # type: ignore[no-any-return]

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer, RNG states (Accelerate) and return our state, its tensors in
        place. Every file was checked to be data when the checkpoint was verified; a load that
        fails anyway (a valid file of another run's shapes), or RNG states Accelerate could not
        restore, is a ``CheckpointLoadError`` naming what."""
        try:
            self.accelerator.load_state(str(path), **self.load_options)
        except ConfigError:
            raise  # a load hook's finding about this run's config (a LoRA base that changed)
        except Exception as exc:  # Accelerate's and torch's errors do not say which file
            raise CheckpointLoadError(
                f"loading its model, optimizer and data state failed ({first_line(exc)})"
            ) from exc
        rank = self.accelerator.process_index
        written_by = saved_processes(path)
        if rank >= written_by > 0:
            # Elastic resume onto more processes than wrote the checkpoint: this process has no
            # RNG states of its own to restore (not a damaged checkpoint), so it draws from a seed
            # that the checkpoint and its rank fix, the same in every rerun.
            seed_new_process(path, rank)
        elif (problem := rng_problem(path, rank)) is not None:
            raise CheckpointLoadError(problem)
        # Checkpoints are taken between optimizer steps, where the micro-batch counter is a multiple
        # of the accumulation; the restored count is another run's when resuming elastically.
        self.accelerator.step = 0
        try:
            tensors = load_file(str(path / TENSORS_FILE)) if (path / TENSORS_FILE).is_file() else {}
        except Exception as exc:
            raise CheckpointLoadError(f"{TENSORS_FILE}: {first_line(exc)}") from exc
        try:  # tensors or not: a part's NaN, tuples and int keys are encoded too
            state: dict[str, Any] = tensor_state.join(self.read_state(path), tensors)
        except (KeyError, TypeError, ValueError) as exc:  # what split cannot have written
            raise CheckpointLoadError(f"{STATE_FILE} does not decode: {first_line(exc)}") from exc
        return state

    def journal(self, path: Path) -> list[dict[str, Any]]:
        """The passes the journal of the checkpoint at ``path`` records as complete (see
        ``ValidationJournals.read``)."""
        return self.journals.read(path, cut=self.accelerator.is_main_process)

    def rank_states(self, path: Path) -> list[dict[str, Any]]:
        """Every process's own state saved in the checkpoint at ``path``, by rank (none in a
        checkpoint written before they existed)."""
        states = [read_json(file)[0] for file in rank_files(path)]
        return [state if isinstance(state, dict) else {} for state in states]
