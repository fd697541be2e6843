"""The run's checkpoints as the loop sees them: ``CheckpointManager``, the one door of this room.
``open`` readies the directory before anything is written; ``save`` writes what every registered
part holds (``checkpoint.state.registry.StateRegistry``) with the boundary it was taken at;
``resume`` finds the newest usable checkpoint, checks it fits this run (layout, effective batch,
config changes), and hands each part its state back; ``rollback_target`` and ``restore_training``
take a rollback back to one; the rest tells the loop what it needs of the writer (the newest
checkpoint, the journal of validation passes, the bucket at the end). Behind it:
``checkpoint.save.writer.CheckpointWriter`` writes checkpoints, ``checkpoint.resume.reader.CheckpointReader``
reads them, both in the ``checkpoint.directory.CheckpointStore``; nothing outside ``checkpoint/``
holds those three."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from ..config import ConfigError
from ..config.run import EnvConfig, ExperimentConfig
from ..config.schedule import ScheduleConfig
from ..config.sections import ModelConfig, TrainConfig
from ..process.failures import RunFailed
from ..progress import TrainingProgress
from ..run_directory.shared_storage import check_shared_output
from ..schedule import ResolvedPlan
from .bucket.from_bucket import complete_from_bucket
from .directory import Mode
from .resume.config_changes import resume_notes, review_changes
from .resume.elastic import check_resume, compatible_position, own_rank_state, plan_identity
from .resume.find import ResumeRefused
from .resume.load import load_state
from .resume.optimizer import changed_group_keys, group_settings, put_back, regrouping_problems
from .resume.reader import CheckpointReader
from .save.nonfinite import NonFiniteGuard
from .save.writer import CheckpointWriter
from .signing import agree_on_key, unchecked_signature
from .state import tensor_state
from .state.content import LAYOUT, LAYOUT_KEY, CheckpointLoadError
from .state.frozen_weights import STATE_KEY as FROZEN_KEY
from .state.frozen_weights import frozen_weights_for
from .state.registry import REGISTERED, StateRegistry

RESUME_NOTE = "at the resume step: "  # what a new run length changes there (config_changes.resume_notes)


class CheckpointManager:
    def __init__(
        self,
        accelerator: Accelerator,
        run_config: dict[str, Any],
        plan: ResolvedPlan,
        registry: StateRegistry,
        progress: TrainingProgress,
        nonfinite: NonFiniteGuard,
        optimizer: torch.optim.Optimizer,
        *,
        env: EnvConfig,
        experiment: ExperimentConfig,
        model_config: ModelConfig,
        train: TrainConfig,
        schedule: ScheduleConfig,
        ranking_metric: str,
        output_dir: Path,
        remote: Any = None,
        mode: Mode | None = None,
    ) -> None:
        """``run_config``: the run's config as JSON data (``Config.model_dump(mode="json")``), saved in
        every checkpoint and compared with a checkpoint's on resume; ``env``, ``experiment``,
        ``model_config``, ``train``, ``schedule``: the config's sections the checkpoints read (the
        bucket, the run's name and seed, a LoRA base, AUTO_RESUME and the run's length, retention);
        ``ranking_metric``: ``Config.ranking_metric``; ``output_dir``: the run directory. ``remote``:
        a ``RemoteCheckpoints`` (default: ENV.OUTPUT.BUCKET's); ``mode``: whether the ranking metric
        is better lower or higher (the task says)."""
        self.accelerator, self.run_config, self.train, self.plan = accelerator, run_config, train, plan
        self.writer = CheckpointWriter(
            accelerator, env, experiment, schedule, ranking_metric, output_dir, remote, mode
        )
        self.reader = CheckpointReader(accelerator, train, output_dir, self.writer.store, self.writer.remote)
        # Its groups as built: what a resume whose OPTIMIZER changed puts back after loading.
        self.optimizer, self.built_groups = optimizer, group_settings(optimizer)
        self.registry, self.progress = registry, progress
        self.nonfinite, self.output_dir = nonfinite, output_dir
        self.after_save: list[Callable[[int], None]] = []  # told the step of each checkpoint saved
        self.before_save: list[Callable[[int], None]] = []  # asked first (a rollback may be due)
        # What the checkpoint resumed from says (None: a fresh start).
        self.resumed_from: Path | None = None
        self.boundary: dict[str, Any] | None = None  # the event point it was taken at
        self.wandb_run_id: str | None = None
        self._verified: tuple[Path | None, list[str]] | None = None  # an explicit --resume, checked
        # A LoRA model's base.
        frozen = frozen_weights_for(accelerator, model_config, experiment.SEED, self.reader.load_options)
        if frozen is not None:
            registry.register(FROZEN_KEY, frozen)

    def save(self, boundary: dict[str, Any] | None) -> None:
        """A checkpoint of the current step; ``boundary``: the event point (None: a preemption)."""
        step = self.progress.global_step
        for ask in self.before_save:
            ask(step)
        parameters_finite = self.nonfinite.start_parameters_check()  # read while the state is saved
        resume_point = self.writer.current
        self.progress.settle_tokens()
        # Registered state may hold tensors (an EMA): JSON with references, the tensors safetensors.
        parts, tensors = tensor_state.split(self.registry.state(per_rank=False), "state")
        state = {
            **parts,
            LAYOUT_KEY: LAYOUT,
            "boundary": boundary,
            "wandb_run_id": wandb_run_id(self.accelerator),
            "plan": plan_identity(self.plan),
            "config": self.run_config,
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
        put_back(self.optimizer, self.built_groups, changed_group_keys(saved.get("config"), self.run_config))
        self.registry.load({k: v for k, v in state.items() if k not in keep}, per_rank=False)
        return dict(saved["progress"])

    # -- the loop's door: nothing outside this room holds the writer, the reader or the store -------
    def open(
        self,
        resume_from: str | Path | None,
        *,
        allow_pickles: bool,
        refuse_node_local: tuple[str, str] | None,
    ) -> None:
        """Before the run writes anything (collective): where the checkpoints live (a directory every
        machine sees, or each machine's own disk meeting in the bucket), the checkpoint key and an
        explicit ``--resume`` verified, stale staging removed, and on a machine's own disk the
        bucket's newest checkpoint made whole there. ``refuse_node_local``: why this run cannot keep
        its checkpoints on each machine's disk (a rollback needs a whole checkpoint), if it cannot."""
        writer = self.writer
        self.reader.allow_pickles = allow_pickles
        layout = check_shared_output(self.accelerator, self.output_dir, bucket=writer.remote is not None)
        writer.layout, writer.attempt = layout, layout.attempt
        if layout.node_local and refuse_node_local is not None:
            raise ConfigError([refuse_node_local])
        self.verify_explicit(resume_from)  # a refusal writes nothing
        if writer.commits_here:
            writer.store.remove_stale_staging()
        if layout.node_local and resume_from is None and self.train.AUTO_RESUME:
            complete_from_bucket(
                self.accelerator, writer.store, writer.remote
            )  # before the newest is looked for

    def tell_commits(self, tell: Callable[[int, Path], None]) -> None:
        """``tell(step, path)`` once each checkpoint is committed (main process; the background thread)."""
        self.writer.on_commit = tell

    def keep_also(self, protected: Callable[[list[int]], set[int]]) -> None:
        """Retention also keeps the steps ``protected(committed steps)`` names (a rollback's target)."""
        self.writer.keep_for_rollback = protected

    def is_committed(self, step: int) -> bool:
        """Whether the run directory holds a committed checkpoint of ``step`` (presence only)."""
        return self.writer.store.is_committed(step)

    @property
    def node_local(self) -> bool:
        """Each machine keeps its part of a checkpoint on its own disk (they meet in the bucket)."""
        return bool(self.writer.layout.node_local)

    @property
    def newest(self) -> Path | None:
        """The newest checkpoint this run wrote or resumed from (a commit may still be running)."""
        return self.writer.current

    @property
    def resume_point(self) -> Path | None:
        """The newest committed checkpoint (main process): where a rerun would resume."""
        return self.writer.resume_point

    def settle(self) -> None:
        """Collective: the last checkpoint is committed, or every process raises."""
        self.writer.settle()

    def close(self, timeout: float = 600.0, failing: bool = False) -> list[str]:
        """The end of the run's checkpoints (``CheckpointWriter.close``): what the bucket lacks."""
        return self.writer.close(timeout, failing)

    def abandon(self, timeout: float = 60.0) -> str | None:
        """A run failing outside an agreement: the background write finished or removed; what was lost."""
        return self.writer.abandon(timeout)

    def catch_up_finished(self) -> list[str] | None:
        """Main process, a finished run rerun: upload what the bucket lacks (bounded by
        ``ENV.OUTPUT.BUCKET.WAIT_S``); what it still lacks then (None: no bucket)."""
        if not self.writer.bucket_on:
            return None
        self.writer.catch_up()
        return self.writer.close()

    @property
    def bucket_on(self) -> bool:
        return bool(self.writer.bucket_on)

    def take_timings(self) -> dict[str, float]:
        """The checkpoints' blocked and waited seconds since the last call, for the next record."""
        return self.writer.take_timings()

    def totals(self) -> dict[str, float]:
        """``summary.json``'s ``checkpoint_blocked_s`` and ``checkpoint_wait_s`` for the whole run."""
        return {
            "checkpoint_blocked_s": round(self.writer.total_blocked_s, 3),
            "checkpoint_wait_s": round(self.writer.total_waited_s, 3),
        }

    def journal(self) -> dict[str, dict[str, float]]:
        """The validation passes the newest checkpoint's journal records as complete, by prefix."""
        assert self.writer.current is not None
        return {e["prefix"]: e["metrics"] for e in self.reader.journal(self.writer.current)}

    def journal_at(self, step: int) -> Path | None:
        """The checkpoint whose journal a pass at ``step`` is recorded in: the newest, if taken there."""
        return self.writer.current if self.writer.current_step == step else None

    def record_validation(self, checkpoint: Path | None, entry: dict[str, Any]) -> None:
        """A validation pass completed: appended to ``checkpoint``'s journal (a rerun skips it)."""
        self.writer.record_validation(checkpoint, entry)

    def record_metric(self, step: int, metrics: dict[str, float]) -> None:
        """The ranking metric of the checkpoint at ``step`` (retention keeps the best)."""
        self.writer.record_metric(step, metrics)

    def rollback_target(
        self, pick: Callable[[list[int]], int | None], say: Callable[[str], None]
    ) -> Path | None:
        """Collective: the committed checkpoint ``pick`` chooses among the committed steps, verified
        on the main process; one that fails verification is moved to ``rejected/`` (never deleted, as
        on resume) and ``pick`` chooses again. None: nothing is left to go back to."""
        found: Any = None
        if self.accelerator.is_main_process:
            store = self.writer.store
            steps = store.complete_steps()
            while (step := pick(steps)) is not None:
                path = store.final_path(step)
                problem = store.verify(path, deep=True)
                if problem is None:
                    found = path
                    break
                moved = store.reject(path, problem)
                say(f"not rolling back to {path.name}: {problem}; moved to {moved}")
                steps.remove(step)
        return broadcast_object_list([found], from_process=0)[0]  # type: ignore[no-any-return]

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
        resuming on its own, it is moved to ``rejected/`` and the previous one is tried. Then what
        an outage kept from the bucket goes up first, in the background (a node-local run's parts
        come together only as it saves them)."""
        self._resume(resume_from, out, data_problem, allow_config_change)
        if not self.node_local:
            self.writer.catch_up()

    def _resume(
        self,
        resume_from: str | Path | None,
        out: Any,
        data_problem: Callable[[int], tuple[str, str] | None],
        allow_config_change: bool,
    ) -> None:
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
                        self.train.length_key,
                        f"this config ends the run at step {self.plan.total_steps}, but {path.name} has trained "
                        f"{done} steps: a run cannot be shortened (ask for at least {done} steps, or start a new run)",
                    )
                ],
                source="resume",
            )
        if regrouped := regrouping_problems(saved.get("config"), self.run_config):  # flag or not
            raise ConfigError(regrouped, source="resume")
        changes = review_changes(
            saved.get("config"), saved.get("plan"), self.run_config, self.plan, done, allow_config_change
        )
        registered = [name for name in self.registry.names(per_rank=False) if name.startswith(REGISTERED)]
        state = load_state(acc, reader, path, registered)
        if isinstance(state, str):
            return state
        # load_state_dict took the groups' settings from the checkpoint: the changed ones are this run's.
        put_back(self.optimizer, self.built_groups, changed_group_keys(saved.get("config"), self.run_config))
        changes += [
            f"{RESUME_NOTE}{line}"
            for line in resume_notes(saved.get("config"), saved.get("plan"), self.plan, done)
        ]
        return state, changes, batches_seen


def wandb_run_id(accelerator: Accelerator) -> str | None:
    """The W&B run this run logs to (main process), so that a resumed run logs to the same one."""
    if not accelerator.is_main_process:
        return None
    wandb = next((t.tracker for t in accelerator.trackers if t.name == "wandb"), None)
    run = getattr(wandb, "id", None)
    return str(run) if run else None
