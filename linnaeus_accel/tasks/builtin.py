"""The built-in tasks, registered by name when ``TASK.NAME`` first asks for one."""

from __future__ import annotations

from . import register_task
from .causal_lm import CausalLMTask
from .classification import ClassificationTask
from .hierarchical import HierarchicalTask

register_task("hierarchical")(HierarchicalTask)
register_task("classification")(ClassificationTask)
register_task("causal_lm")(CausalLMTask)
