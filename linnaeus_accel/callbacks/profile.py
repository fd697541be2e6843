"""``profile``: a ``torch.profiler`` trace of a range of steps, for finding where a step's time goes.

Off unless listed: ``CALLBACKS: [{NAME: profile, OPTIONS: {start_step: 100, steps: 10}}]`` traces
steps 100-109 (the optimizer steps whose ends are in the range: each step's forward, backward and
optimizer work) on every process, writes ``<run dir>/profile/steps_100-109.rank<r>.json`` (a Chrome
trace: open it in https://ui.perfetto.dev or ``chrome://tracing``), and prints the main process's
summary of operators by self time. The profiler's own overhead makes those steps slower; the steps
outside the range are not called back at all.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.callbacks import ProfileOptions
from . import Callback, RunContext, register_callback


@register_callback("profile")
class Profile(Callback):
    Options = ProfileOptions

    def __init__(
        self,
        start_step: int = 10,
        steps: int = 5,
        record_shapes: bool = False,
        with_stack: bool = False,
        row_limit: int = 15,
    ) -> None:
        self.options = ProfileOptions.model_validate(
            {
                "start_step": start_step,
                "steps": steps,
                "record_shapes": record_shapes,
                "with_stack": with_stack,
                "row_limit": row_limit,
            }
        )
        self.interval = {"INTERVAL_STEPS": 1}  # while tracing; finished afterwards
        self.done = False
        self._profiler: Any = None

    @property
    def last_step(self) -> int:
        return self.options.start_step + self.options.steps - 1

    def _start(self, run: RunContext) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=self.options.record_shapes,
            with_stack=self.options.with_stack,
        )
        self._profiler.__enter__()

    def on_fit_start(self, run: RunContext) -> None:
        step = run.global_step
        if step >= self.last_step:
            self.done = True
        elif step + 1 >= self.options.start_step:
            self._start(run)  # the next step is in the range

    def on_step_end(self, run: RunContext, step: int) -> None:
        if self.done:
            return
        if self._profiler is None:
            if step + 1 == self.options.start_step:
                self._start(run)
            return
        if step < self.last_step:
            return
        profiler, self._profiler, self.done = self._profiler, None, True
        profiler.__exit__(None, None, None)
        first = max(self.options.start_step, step - self.options.steps + 1)
        out = run.config.output_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        rank = run.accelerator.process_index
        trace = out / f"steps_{first}-{step}.rank{rank}.json"
        profiler.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=self.options.row_limit)
        run.say(f"profile of steps {first}-{step} ({trace.parent}):\n{table}")

    @property
    def finished(self) -> bool:
        return self.done

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = bool(state.get("done", False))
