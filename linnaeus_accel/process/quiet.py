"""Library notices kept off the console: ones every run of a kind prints, that say nothing of the run.

Accelerate logs ``Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but
check by verifying that you don't receive any warning while reloading`` (``accelerate.utils.other``,
``clean_state_dict_for_safetensors``) at every ``save_state`` and ``save_model`` of a model whose
weights are tied: safetensors cannot store one storage under two names, so the second name is left
out. That is expected for every tied model (a causal LM's head and embeddings): the model is built
tied, and loading a checkpoint or ``final/`` fills the one tensor both names share. Printed at
every checkpoint (12 times in a 120-step run), it only alarms; this module drops exactly that
message, with a ``logging.Filter`` on the logger that emits it. Anything else that logger says
passes, as does the message itself from any other logger.

torchdata's ``StatefulDataLoader`` calls torch's ``set_vital`` at every loader it builds, and torch
warns ``'set_vital' is deprecated, please do not call`` each time: a library's call, not the user's,
so that exact warning is ignored too (``warnings.filterwarnings`` on its message).

``quiet_library_notices()`` installs the filters (once per process; importing
``linnaeus_accel.training`` calls it, so every run and every process of one is covered).
"""

from __future__ import annotations

import logging
import re
import warnings

# Where Accelerate logs it (get_logger(__name__) of accelerate/utils/other.py); the logger of the
# module that defines clean_state_dict_for_safetensors is added at install, should it move.
SHARED_TENSOR_LOGGERS = ("accelerate.utils.other",)
SHARED_TENSOR_NOTICE = re.compile(
    r"(\[RANK \d+\] )?Removed shared tensor \{.*\} while saving\. This should be OK, but check by "
    r"verifying that you don't receive any warning while reloading",
    re.DOTALL,
)


class SharedTensorNotice(logging.Filter):
    """Drops Accelerate's notice that it left a tied (shared) tensor out of a safetensors file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return SHARED_TENSOR_NOTICE.fullmatch(record.getMessage()) is None


_FILTER = SharedTensorNotice()


def _emitting_loggers() -> list[str]:
    names = list(SHARED_TENSOR_LOGGERS)
    try:
        from accelerate.utils import clean_state_dict_for_safetensors
    except ImportError:  # an Accelerate without it does not log the notice there
        return names
    module = getattr(clean_state_dict_for_safetensors, "__module__", None)
    if isinstance(module, str) and module not in names:
        names.append(module)
    return names


def quiet_library_notices() -> None:
    """Install the filter on the loggers that emit the notice, and the warnings filter (idempotent)."""
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning)
    for name in _emitting_loggers():
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
