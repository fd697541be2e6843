"""Tasks: everything that depends on what is trained (layer 4 of docs/design.md).

``TASK.NAME`` selects a built-in task (``hierarchical``, ``classification``, ``causal_lm``) or one
registered from your own script::

    from linnaeus_accel.tasks import Task, register_task

    @register_task("my_task")
    class MyTask(Task):
        ...

The Python API also takes an instance: ``Trainer(config, model, train, val, task=MyTask())``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..registry import Registry
from .base import IGNORE_INDEX, STANDARD_PASS, Direction, Task, TaskContext, ValidationPass, logits_of

if TYPE_CHECKING:
    from ..config.sections import TaskConfig

TASKS: Registry[Callable[[], Task]] = Registry(
    "task",
    "TASK.NAME",
    "linnaeus_accel.tasks.register_task",
    {
        "hierarchical": "linnaeus_accel.tasks.builtin",
        "classification": "linnaeus_accel.tasks.builtin",
        "causal_lm": "linnaeus_accel.tasks.builtin",
    },
)
register_task = TASKS.register


def build_task(task: TaskConfig) -> Task:
    """The task ``TASK.NAME`` names (registered with ``register_task``)."""
    return TASKS.get(task.NAME)()


__all__ = [
    "IGNORE_INDEX",
    "STANDARD_PASS",
    "Direction",
    "Task",
    "TaskContext",
    "ValidationPass",
    "build_task",
    "logits_of",
    "register_task",
]
