"""The run's checkpoints as the loop sees them: ``save`` writes what every registered part holds
(``components.StateRegistry``) with the event point it was taken at; ``resume`` finds the newest
usable checkpoint, checks it fits this run (layout, effective batch, config changes), and hands
each part its state back. The loop asks; what a checkpoint holds is decided here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ..config import Config, ConfigError
from ..progress import TrainingProgress
from ..run_directory.failures import NonFiniteGuard
from ..schedule import ResolvedPlan
from .components import StateRegistry
from .config_changes import review_changes
from .elastic import check_resume, compatible_position, own_rank_state, plan_identity
from .frozen_weights import STATE_KEY as FROZEN_KEY
from .frozen_weights import frozen_weights_for
from .saver import Checkpointer


class RunCheckpoints:
    def __init__(
        self,
        accelerator: Accelerator,
        config: Config,
        plan: ResolvedPlan,
        checkpointer: Checkpointer,
        registry: StateRegistry,
        progress: TrainingProgress,
        nonfinite: NonFiniteGuard,
        take_tokens: Callable[[], int],
    ) -> None:
        self.accelerator, self.config, self.plan = accelerator, config, plan
        self.checkpointer, self.registry, self.progress = checkpointer, registry, progress
        self.nonfinite, self.take_tokens = nonfinite, take_tokens
        self.after_save: list[Callable[[int], None]] = []  # told the step of each checkpoint saved
        # What the checkpoint resumed from says (None: a fresh start).
        self.resumed_from: Path | None = None
        self.boundary: dict[str, Any] | None = None  # the event point it was taken at
        self.wandb_run_id: str | None = None
        frozen = frozen_weights_for(accelerator, config, checkpointer)  # a LoRA model's base
        if frozen is not None:
            registry.register(FROZEN_KEY, frozen)

    def save(self, boundary: dict[str, Any] | None) -> None:
        """A checkpoint of the current step; ``boundary``: the event point (None: a preemption)."""
        step = self.progress.global_step
        parameters_finite = self.nonfinite.start_parameters_check()  # read while the state is saved
        resume_point = self.checkpointer.current
        self.progress.tokens_seen += self.take_tokens()
        state = {
            **self.registry.state(per_rank=False),
            "boundary": boundary,
            "wandb_run_id": wandb_run_id(self.accelerator),
            "plan": plan_identity(self.plan),
            "config": self.config.model_dump(mode="json"),
        }
        self.checkpointer.save(
            step,
            state,
            self.registry.state(per_rank=True),
            before_commit=lambda: self.nonfinite.check(
                step, f"the checkpoint of step {step}", resume_point, parameters_finite
            ),
        )
        for tell in self.after_save:
            tell(step)

    def resume(
        self,
        resume_from: str | Path | None,
        out: Any,
        data_problem: Callable[[int], tuple[str, str] | None],
        allow_config_change: bool,
    ) -> None:
        """Resume from ``resume_from`` or the newest usable checkpoint, if any (every process).
        ``data_problem(batches_seen)``: why the data cannot continue at that position (a sharded
        stream under another layout), checked before any pass or step runs."""
        acc, checkpointer, progress = self.accelerator, self.checkpointer, self.progress
        path, skipped = checkpointer.find_everywhere(resume_from)  # a refusal stops every process
        for message in skipped:
            out.say(f"skipping checkpoint {message}")
        resume_step = checkpointer.store.step_of(path) if path is not None else 0
        if acc.is_main_process:
            dropped = checkpointer.discard_after(resume_step or 0)
            if dropped:
                out.say(f"removed checkpoints after the resume point: steps {dropped}")
        acc.wait_for_everyone()
        if path is None:
            out.truncate_metrics(after_step=0)  # killed before its first checkpoint: start over
            return
        path = Path(path)
        saved = checkpointer.read_state(path)
        check_resume(acc, saved.get("plan"))
        batches_seen = compatible_position(  # first: another effective batch cannot resume at all
            saved.get("plan"),
            plan_identity(self.plan),
            int(saved["progress"].get("batches_seen_in_epoch", 0)),
            same_length=saved.get("config") is None,
        )
        done = int(saved["progress"]["global_step"])
        changes = review_changes(
            saved.get("config"), saved.get("plan"), self.config, self.plan, done, allow_config_change
        )
        _check_saved_tensors(acc, path, saved.get("config"))
        state = checkpointer.load(path)
        notes = self.registry.load(state, per_rank=False)
        progress.batches_seen_in_epoch = batches_seen  # in this run's layout
        own = own_rank_state(checkpointer.rank_states(path), acc.process_index, acc.num_processes)
        notes += self.registry.load(own, per_rank=True)
        problem = data_problem(batches_seen)
        if problem is not None:  # before any pass or step of the resumed run
            raise ConfigError([problem], source="resume")
        self.resumed_from, self.boundary = path, state.get("boundary")
        self.wandb_run_id = state.get("wandb_run_id")
        # The run's length is this config's (more epochs may have been asked for).
        progress.total_epochs, progress.expected_total_steps = self.plan.epochs or 0, self.plan.total_steps
        step = progress.global_step
        out.truncate_metrics(after_step=step)
        out.say(f"resumed from {path} (global step {step}, epoch {progress.current_epoch})")
        for line in changes:
            out.say(f"config changed since the checkpoint, applied: {line}")
        for line in notes:
            out.say(line)


def wandb_run_id(accelerator: Accelerator) -> str | None:
    """The W&B run this run logs to (main process), so that a resumed run logs to the same one."""
    if not accelerator.is_main_process:
        return None
    wandb = next((t.tracker for t in accelerator.trackers if t.name == "wandb"), None)
    run = getattr(wandb, "id", None)
    return str(run) if run else None


def _check_saved_tensors(accelerator: Accelerator, path: Path, saved_config: dict[str, Any] | None) -> None:
    """Callbacks that save tensors with the run's state (``ema``) must be those the checkpoint was
    written with: Accelerate loads them by position and fails on any other count."""
    saved = len(list(path.glob("custom_checkpoint_*.pkl")))
    registered = len(accelerator._custom_objects)
    if saved == registered:
        return
    then = [entry.get("NAME") for entry in (saved_config or {}).get("CALLBACKS") or []]
    raise ConfigError(
        [
            (
                "CALLBACKS",
                f"the checkpoint {path.name} holds the saved tensors of {saved} callback(s) (its run's CALLBACKS: "
                f"{then or 'none'}) and this run registers {registered}: a callback that saves tensors (ema) "
                "cannot be added to or removed from a run under way; list the checkpoint's CALLBACKS, or "
                "start a new run in another directory",
            )
        ],
        source="resume",
    )
