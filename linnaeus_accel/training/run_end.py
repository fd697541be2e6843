"""How a run ends: its last checkpoint committed, the final weights written (``final/``), and
``summary.json``: completed, stopped early or preempted; or, when it cannot go on, ``failed``
with the reason (written when it still can be: the disk may be full)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from accelerate import Accelerator
from torch import nn

from ..config import Config
from ..data.token_format import TokenOutOfVocab
from ..progress import TrainingProgress
from ..run_directory.failures import NonFiniteGuard, RunFailed, collective_timeout
from ..run_directory.first_failure import first_failure
from ..run_directory.launcher import stop_if_launcher_gone
from ..run_state.saver import Checkpointer
from ..schedule import ResolvedPlan, StopDecision
from .final_weights import run_tokenizer, save_final


class RunEnd:
    def __init__(
        self,
        accelerator: Accelerator,
        config: Config,
        plan: ResolvedPlan,
        model: nn.Module,
        progress: TrainingProgress,
        checkpointer: Checkpointer,
        nonfinite: NonFiniteGuard,
        take_tokens: Callable[[], int],
        train_data: Any = None,
        last_validation: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.accelerator, self.config, self.plan, self.model = accelerator, config, plan, model
        self.progress, self.checkpointer, self.nonfinite, self.take_tokens = (
            progress,
            checkpointer,
            nonfinite,
            take_tokens,
        )
        self.out: Any = None  # the run's outputs, once the run has started
        self.run_info: dict[str, Any] = {}  # what the run ran on (main process)
        self.last_validation = last_validation  # the latest validation's metrics, for summary.json
        self.tokenizer = run_tokenizer(train_data)  # the run's, shipped in final/

    def summary(
        self, status: str, stop: StopDecision | None = None, error: str | None = None
    ) -> dict[str, Any]:
        progress = self.progress
        return {
            "global_step": progress.global_step,
            "epoch": progress.epoch,
            "samples_seen": progress.samples_seen,
            "tokens_seen": progress.tokens_seen,
            "status": status,
            "stop_reason": stop.reason if stop else None,
            "error": error,
            "best_metric": progress.best_metric,
            "expected_total_steps": self.plan.total_steps,
            "last_validation": self.last_validation(),
            "warnings": list(self.plan.warnings),  # the plan's, as printed at the start
            "run_info": self.run_info,
        }

    def finish(self, stop: StopDecision | None, before_summary: Callable[[], None]) -> dict[str, Any]:
        """Every process: the last checkpoint committed (``before_summary`` then runs: callbacks
        hear of it), ``final/`` written (collective), ``summary.json``."""
        acc, progress = self.accelerator, self.progress
        preempted = stop is not None and stop.reason == "preempted"
        progress.tokens_seen += self.take_tokens()
        self.checkpointer.settle()  # the last checkpoint is committed, or every process stops here
        before_summary()
        if not preempted:  # a preempted run's weights are in its last checkpoint
            self.nonfinite.check(progress.global_step, "the final weights", self.checkpointer.current)
            save_final(acc, self.model, self.config.output_dir / "final", self.tokenizer)  # collective
        status = "preempted" if preempted else ("early_stopped" if stop is not None else "completed")
        summary = self.summary(status, stop)
        summary["remote_sync_errors"] = self.checkpointer.close()
        summary["checkpoint_blocked_s"] = round(self.checkpointer.total_blocked_s, 3)
        summary["checkpoint_wait_s"] = round(self.checkpointer.total_waited_s, 3)
        self.out.write_json("summary.json", summary)
        return summary

    def tear_down(self) -> None:
        """Every process tears the process group down together (PyTorch's advice for
        destroy_process_group): one destroying it while process 0 still writes, and hosts the
        rendezvous store, was seen to hang at exit with 2 gloo processes; one never destroying it
        was seen to abort at exit (gloo's threads outliving the interpreter)."""
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()

    def already_finished(self, finished: dict[str, Any]) -> dict[str, Any]:
        """``fit()`` on a finished run's directory: nothing to train, said on the main process (in a
        notebook as on the command line), and the finished run's summary returned."""
        self.tear_down()
        if self.accelerator.is_local_main_process:
            status = str(finished["status"]).replace("_", " ")
            print(
                f"{self.config.output_dir} already holds a run {status} at step {finished['global_step']}: "
                "nothing to do (pass overwrite=True / --overwrite to train it again from scratch, or choose "
                "another EXPERIMENT.NAME)",
                flush=True,
            )
        return {**finished, "already_finished": True}

    def record_failure(self, message: str, agreed: bool) -> None:
        """``summary.json`` says ``status: failed``. ``agreed``: every process is here, so the
        process group is torn down together."""
        if self.out is None:
            return
        with contextlib.suppress(Exception):
            self.checkpointer.close(timeout=60.0)
        with contextlib.suppress(OSError):
            self.out.write_json("summary.json", self.summary("failed", error=message))
        if agreed:
            with contextlib.suppress(Exception):
                self.tear_down()
        self.out.close()

    def record_exception(self, exc: Exception) -> RunFailed | None:
        """An exception only this process may have seen: ``summary.json`` records its first cause
        (another process's error when this one only lost that process). Returns the ``RunFailed``
        to raise instead (a sentence, no traceback) when the cause is not this process's own, when a
        collective timed out, or when the data is at fault and the error says it all; else None
        (the exception itself goes on: a bug's traceback is what its author needs)."""
        stop_if_launcher_gone()  # a peer's error once the launcher was killed: a kill, not a failure
        timed_out = collective_timeout(exc, self.config.ENV.DIST_TIMEOUT_S)
        said_in_full = isinstance(exc, TokenOutOfVocab)
        own = timed_out or (str(exc) if said_in_full else f"{type(exc).__name__}: {exc}")
        cause = first_failure(exc, own)
        self.record_failure(cause, agreed=False)
        if cause != own:
            return RunFailed(f"another process failed first ({cause}); this process stops too")
        return RunFailed(own) if timed_out or said_in_full else None
