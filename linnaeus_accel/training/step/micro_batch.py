"""``MicroBatch``: one batch of one process, as the loop and validation receive it from a
``BatchSource`` (``batches``) or a stream without a length (``stream_agreement``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor


class MicroBatch(NamedTuple):
    position: int  # this process's batch index in the epoch
    data: Any
    real: Tensor | None  # rows that are not even-batch repeats; None when every row is real
    samples: int | None = None  # real rows of this micro-batch over all processes, when not computed
