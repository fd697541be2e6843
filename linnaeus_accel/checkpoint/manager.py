"""The run's checkpoints as the loop sees them (``CheckpointManager``): ``save`` writes what every
registered part holds (``checkpoint.state.registry.StateRegistry``) with the boundary it was taken at;
``resume`` finds the newest usable checkpoint, checks it fits this run (layout, effective batch,
config changes), and hands each part its state back. The loop asks; what a checkpoint holds is
decided here. Beneath it: ``checkpoint.save.writer.CheckpointWriter`` writes checkpoints,
``checkpoint.resume.reader.CheckpointReader`` reads them, both in the ``checkpoint.directory.CheckpointStore``."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from ..config import Config, ConfigError
from ..process.failures import RunFailed
from ..progress import TrainingProgress
from ..schedule import ResolvedPlan
from .directory import MarkerError, Mode, read_marker
from .directory.marker import KEY_ENV, SIGNATURE, checkpoint_key, key_disagreement, key_setting
from .resume.config_changes import resume_notes, review_changes
from .resume.elastic import check_resume, compatible_position, own_rank_state, plan_identity
from .resume.find import ResumeRefused
from .resume.optimizer import changed_group_keys, group_settings, put_back, regrouping_problems
from .resume.reader import CheckpointReader
from .save.nonfinite import NonFiniteGuard
from .save.writer import CheckpointWriter
from .state import tensor_state
from .state.content import LAYOUT, LAYOUT_KEY, CheckpointLoadError, legacy_pickles
from .state.frozen_weights import STATE_KEY as FROZEN_KEY
from .state.frozen_weights import frozen_weights_for
from .state.registry import REGISTERED, StateRegistry

RESUME_NOTE = "at the resume step: "  # what a new run length changes there (config_changes.resume_notes)


class CheckpointManager:
    def __init__(
        self,
        accelerator: Accelerator,
        config: Config,
        plan: ResolvedPlan,
        registry: StateRegistry,
        progress: TrainingProgress,
        nonfinite: NonFiniteGuard,
        take_tokens: Callable[[], int],
        optimizer: torch.optim.Optimizer,
        *,
        remote: Any = None,
        mode: Mode | None = None,
    ) -> None:
        """``remote``: a ``RemoteCheckpoints`` (default: ENV.OUTPUT.BUCKET's); ``mode``: whether the
        ranking metric is better lower or higher (the task says)."""
        self.accelerator, self.config, self.plan = accelerator, config, plan
        self.writer = CheckpointWriter(accelerator, config, remote, mode)
        self.reader = CheckpointReader(accelerator, config, self.writer.store, self.writer.remote)
        # Its groups as built: what a resume whose OPTIMIZER changed puts back after loading.
        self.optimizer, self.built_groups = optimizer, group_settings(optimizer)
        self.registry, self.progress = registry, progress
        self.nonfinite, self.take_tokens = nonfinite, take_tokens
        self.after_save: list[Callable[[int], None]] = []  # told the step of each checkpoint saved
        self.before_save: list[Callable[[int], None]] = []  # asked first (a rollback may be due)
        # What the checkpoint resumed from says (None: a fresh start).
        self.resumed_from: Path | None = None
        self.boundary: dict[str, Any] | None = None  # the event point it was taken at
        self.wandb_run_id: str | None = None
        self._verified: tuple[Path | None, list[str]] | None = None  # an explicit --resume, checked
        frozen = frozen_weights_for(accelerator, config, self.reader.load_options)  # a LoRA model's base
        if frozen is not None:
            registry.register(FROZEN_KEY, frozen)

    def save(self, boundary: dict[str, Any] | None) -> None:
        """A checkpoint of the current step; ``boundary``: the event point (None: a preemption)."""
        step = self.progress.global_step
        for ask in self.before_save:
            ask(step)
        parameters_finite = self.nonfinite.start_parameters_check()  # read while the state is saved
        resume_point = self.writer.current
        self.progress.tokens_seen += self.take_tokens()
        # Registered state may hold tensors (an EMA): JSON with references, the tensors safetensors.
        parts, tensors = tensor_state.split(self.registry.state(per_rank=False), "state")
        state = {
            **parts,
            LAYOUT_KEY: LAYOUT,
            "boundary": boundary,
            "wandb_run_id": wandb_run_id(self.accelerator),
            "plan": plan_identity(self.plan),
            "config": self.config.model_dump(mode="json"),
        }
        self.writer.save(
            step,
            state,
            self.registry.state(per_rank=True),
            before_commit=lambda: self.nonfinite.check(
                step, f"the checkpoint of step {step}", resume_point, parameters_finite
            ),
            tensors=tensors,
        )
        for tell in self.after_save:
            tell(step)

    def restore_training(self, path: Path, keep: Collection[str]) -> dict[str, Any]:
        """A rollback (``recovery``), every process: the model, optimizer and RNG states of the
        checkpoint at ``path`` (verified), and every registered part's state but ``keep``'s; the
        checkpoint's progress is returned as saved. A load that fails on any process fails the run."""
        saved = self.reader.read_state(path)
        problem: str | None = None
        try:
            state = self.reader.load(path)
        except CheckpointLoadError as exc:
            problem, state = str(exc), {}
        problems = [p for p in gather_object([problem]) if p]
        if problems:
            raise RunFailed(f"rolling back to {path} failed: {problems[0]}")
        put_back(self.optimizer, self.built_groups, changed_group_keys(saved.get("config"), self.config))
        self.registry.load({k: v for k, v in state.items() if k not in keep}, per_rank=False)
        return dict(saved["progress"])

    def verify_explicit(self, resume_from: str | Path | None) -> None:
        """Before the output directory is written to (collective): the checkpoint key is usable and
        the same on every process (compared as a digest), and an explicit ``--resume`` verifies
        (digests, content). A refusal stops every process alike and leaves the run's files as
        they were."""
        agree_on_key()
        if resume_from is not None:
            self._verified = self.reader.find_everywhere(resume_from)

    def resume(
        self,
        resume_from: str | Path | None,
        out: Any,
        data_problem: Callable[[int], tuple[str, str] | None],
        allow_config_change: bool,
    ) -> None:
        """Resume from ``resume_from`` or the newest usable checkpoint, if any (every process).
        ``data_problem(batches_seen)``: why the data cannot continue at that position (a sharded
        stream under another layout), checked before any pass or step runs. A checkpoint that
        verifies but fails to load (on any process) stops an explicit resume (exit 2); when
        resuming on its own, it is moved to ``rejected/`` and the previous one is tried."""
        acc, reader = self.accelerator, self.reader
        while True:
            # A refusal stops every process. An explicit --resume was verified already.
            path, skipped = self._verified or reader.find_everywhere(resume_from)
            self._verified = None
            for message in skipped:
                out.say(f"skipping checkpoint {message}")
            resume_step = reader.store.step_of(path) if path is not None else 0
            if acc.is_main_process:
                dropped = reader.discard_after(resume_step or 0)
                if dropped:
                    out.say(f"removed checkpoints after the resume point: steps {dropped}")
            acc.wait_for_everyone()
            if path is None:
                out.truncate_metrics(after_step=0)  # killed before its first checkpoint: start over
                return
            path = Path(path)
            loaded = self._load(path, allow_config_change)
            problems = [p for p in gather_object([loaded if isinstance(loaded, str) else None]) if p]
            if not problems:
                assert not isinstance(loaded, str)
                break
            problem = problems[0]
            if resume_from is not None:
                raise ResumeRefused([("--resume", f"{path} could not be loaded: {problem}")], "arguments")
            if acc.is_main_process:
                moved = reader.store.reject(path, f"could not be loaded: {problem}")
                out.say(f"skipping checkpoint {path.name}: could not be loaded: {problem}; moved to {moved}")
            acc.wait_for_everyone()
        state, changes, batches_seen = loaded
        self.writer.resumed_at(path, state)
        progress = self.progress
        notes = self.registry.load(state, per_rank=False)
        progress.batches_seen_in_epoch = batches_seen  # in this run's layout
        own = own_rank_state(reader.rank_states(path), acc.process_index, acc.num_processes)
        notes += self.registry.load(own, per_rank=True)
        problem = data_problem(batches_seen)
        if problem is not None:  # before any pass or step of the resumed run
            raise ConfigError([problem], source="resume")
        self.resumed_from, self.boundary = path, state.get("boundary")
        self.wandb_run_id = state.get("wandb_run_id")
        # The run's length is this config's (more epochs may have been asked for).
        progress.total_epochs, progress.expected_total_steps = self.plan.epochs or 0, self.plan.total_steps
        step = progress.global_step
        # A finished run trained longer: what it validated at its end stays in its history.
        extended = bool(self.boundary and self.boundary.get("final")) and step < self.plan.total_steps
        out.truncate_metrics(after_step=step, keep_validation=extended)
        out.say(f"resumed from {path} (global step {step}, epoch {progress.current_epoch})")
        if acc.is_main_process and (unchecked := unchecked_signature(path)) is not None:
            out.say(unchecked)
        for line in changes:
            note = line.startswith(RESUME_NOTE)
            out.say(
                line.removeprefix(RESUME_NOTE)
                if note
                else f"config changed since the checkpoint, applied: {line}"
            )
        for line in notes:
            out.say(line)

    def _load(self, path: Path, allow_config_change: bool) -> tuple[dict[str, Any], list[str], int] | str:
        """The checkpoint's state (tensors in place), the config changes applied, and the data
        position in this run's layout; or, when its files cannot be loaded, why (the caller agrees
        with the other processes). A checkpoint that does not fit this run raises ``ConfigError``."""
        acc, reader = self.accelerator, self.reader
        saved = reader.read_state(path)
        check_resume(acc, saved.get("plan"))
        batches_seen = compatible_position(  # first: another effective batch cannot resume at all
            saved.get("plan"),
            plan_identity(self.plan),
            int(saved["progress"].get("batches_seen_in_epoch", 0)),
            same_length=saved.get("config") is None,
        )
        done = int(saved["progress"]["global_step"])
        if done > self.plan.total_steps:  # flag or not: the steps trained cannot be undone
            raise ConfigError(
                [
                    (
                        self.config.TRAIN.length_key,
                        f"this config ends the run at step {self.plan.total_steps}, but {path.name} has trained "
                        f"{done} steps: a run cannot be shortened (ask for at least {done} steps, or start a new run)",
                    )
                ],
                source="resume",
            )
        if regrouped := regrouping_problems(saved.get("config"), self.config):  # flag or not
            raise ConfigError(regrouped, source="resume")
        changes = review_changes(
            saved.get("config"), saved.get("plan"), self.config, self.plan, done, allow_config_change
        )
        pickles = legacy_pickles(path)  # allowed (--unsafe-load-pickles): find refuses them otherwise
        names = self._pickled_state_names(path, len(pickles))
        collected = [_Collected() for _ in pickles]
        acc._custom_objects[:] = collected  # Accelerate loads them, as it wrote them (weights_only=False)
        try:
            state = reader.load(path)
        except CheckpointLoadError as exc:
            return str(exc)
        finally:
            acc._custom_objects.clear()
        # load_state_dict took the groups' settings from the checkpoint: the changed ones are this run's.
        put_back(self.optimizer, self.built_groups, changed_group_keys(saved.get("config"), self.config))
        state = {**state, **{name: c.state for name, c in zip(names, collected, strict=True)}}
        changes += [
            f"{RESUME_NOTE}{line}"
            for line in resume_notes(saved.get("config"), saved.get("plan"), self.plan, done)
        ]
        return state, changes, batches_seen

    def _pickled_state_names(self, path: Path, count: int) -> list[str]:
        """A previous layout's checkpoint: its ``custom_checkpoint_<i>.pkl`` were the registered
        parts holding tensors, in the order they registered; their names here."""
        names = [name for name in self.registry.names(per_rank=False) if name.startswith(REGISTERED)]
        if count and count != len(names):
            raise ConfigError(
                [
                    (
                        "CALLBACKS",
                        f"the checkpoint {path.name} holds {count} pickled state(s) (custom_checkpoint_*.pkl) and this "
                        f"run registers {len(names)} ({', '.join(names) or 'none'}): list the CALLBACKS the "
                        "checkpoint's run had",
                    )
                ],
                source="resume",
            )
        return names[:count]


class _Collected:
    """Takes what Accelerate loads from a previous layout's ``custom_checkpoint_<i>.pkl``."""

    def __init__(self) -> None:
        self.state: Any = None

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def agree_on_key() -> None:
    """Stop every process alike (``ConfigError``) unless the checkpoint key is set and not empty on
    all of them, the same, or unset on all (collective; a digest is compared, never the key): the
    main process signs and every process verifies, so a key exported on one machine only would
    be ignored on the others without a word."""
    problem = key_disagreement(gather_object([key_setting()]))
    if problem is not None:
        raise ConfigError([(KEY_ENV, problem)], source="environment")


def unchecked_signature(path: Path) -> str | None:
    """What to say when a signed checkpoint resumes without the key (its run stops being signed)."""
    if checkpoint_key() is not None:
        return None
    try:
        signed = SIGNATURE in read_marker(path)
    except MarkerError:
        return None
    if not signed:
        return None
    return (
        f"{path.name} is signed, but {KEY_ENV} is not set: its signature was not checked, and the checkpoints "
        f"this run writes are unsigned (set {KEY_ENV} to the key it was signed with, to check and sign them)"
    )


def wandb_run_id(accelerator: Accelerator) -> str | None:
    """The W&B run this run logs to (main process), so that a resumed run logs to the same one."""
    if not accelerator.is_main_process:
        return None
    wandb = next((t.tracker for t in accelerator.trackers if t.name == "wandb"), None)
    run = getattr(wandb, "id", None)
    return str(run) if run else None
