"""linnaeus-accel: linnaeus' training-progress and scheduling system on Hugging Face Accelerate.

The Python API: ``Trainer(load_config(...), model, train_data, val_data).fit()``;
``DistributedContext`` for rank-aware user code (both imported on first use, so that
``linnaeus-accel plan`` does not load torch); ``Callback`` and ``register_callback`` for code of
your own run during training, handed a ``RunContext`` (``linnaeus_accel.callbacks``); ``register_optimizer`` for an
``OPTIMIZER.NAME`` of your own (``linnaeus_accel.optim``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .callbacks import Callback, RunContext, register_callback
from .config import load_config
from .optim import register_optimizer

if TYPE_CHECKING:
    from .distributed import DistributedContext
    from .training.trainer import Trainer

__version__ = "0.1.0"
__all__ = [
    "Callback",
    "DistributedContext",
    "RunContext",
    "Trainer",
    "__version__",
    "load_config",
    "register_callback",
    "register_optimizer",
]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from .training.trainer import Trainer

        return Trainer
    if name == "DistributedContext":
        from .distributed import DistributedContext

        return DistributedContext
    raise AttributeError(f"module 'linnaeus_accel' has no attribute {name!r}")
