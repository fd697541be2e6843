"""The main process's console: a progress bar on a terminal, plain lines anywhere else.

A bar redrawn with carriage returns is unreadable in a log file, a batch job's output or a
notebook cell, so unless ``ENV.PROGRESS_BAR`` says otherwise the bar is drawn only when stdout is a
terminal; elsewhere each console update (the trainer passes the shown metrics at the console
interval) becomes one line: ``epoch 2 step 40/60: loss 2.1528, lr 8.00e-03, samples/s 8701, 0:03 left``.
"""

from __future__ import annotations

import sys
import time
from typing import Literal

from tqdm.auto import tqdm

BarMode = bool | Literal["auto"]


def draws_bar(mode: BarMode) -> bool:
    """Whether ``ENV.PROGRESS_BAR`` = ``mode`` draws the bar here (``auto``: stdout is a terminal)."""
    if mode != "auto":
        return bool(mode)
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


class Console:
    """The bar (or its plain lines) and the run's messages, from ``start`` at the first step this
    process trains: a resumed run's bar starts at the resumed step, so its rate and time left
    count only the steps trained now."""

    def __init__(self, total_steps: int, mode: BarMode = "auto") -> None:
        self.total = total_steps
        self.uses_bar = draws_bar(mode)
        self.bar: tqdm | None = None  # type: ignore[type-arg]
        self._epoch = 0
        self._first_step = self._step = 0
        self._started = time.perf_counter()

    def start(self, step: int, epoch: int) -> None:
        """Training starts (or resumes) at global step ``step``, inside epoch ``epoch``."""
        self._first_step = self._step = step
        self._epoch = epoch
        self._started = time.perf_counter()
        if self.uses_bar:
            self.bar = tqdm(
                total=self.total,
                initial=step,
                desc=f"epoch {epoch}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,  # where the messages go too: tqdm clears the bar around them
            )

    def advance(self, steps: int, epoch: int, postfix: dict[str, str] | None = None) -> None:
        """``steps`` more optimizer steps (every step: cheap unless ``postfix`` is given)."""
        self._step += steps
        bar = self.bar
        if bar is not None:
            if epoch != self._epoch:  # not every step: set_description redraws the bar
                self._epoch = epoch
                bar.set_description(f"epoch {epoch}", refresh=False)
            bar.update(steps)
            if postfix is not None:
                bar.set_postfix(postfix, refresh=False)
        elif postfix is not None:
            self.say(self.plain_line(epoch, postfix))

    def plain_line(self, epoch: int, postfix: dict[str, str]) -> str:
        shown = ", ".join(f"{name} {value}" for name, value in postfix.items())
        line = f"epoch {epoch} step {self._step}/{self.total}: {shown}"
        done, elapsed = self._step - self._first_step, time.perf_counter() - self._started
        if done > 0 and self._step < self.total:
            left = (self.total - self._step) * elapsed / done
            line += f", {tqdm.format_interval(left)} left"
        return line

    def say(self, message: str) -> None:
        tqdm.write(message, file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
