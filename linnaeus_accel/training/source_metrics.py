"""``samples_seen/<source>`` and ``tokens_seen/<source>`` of a mixed training dataset.

A mixture knows, in closed form, how many samples of each source the first ``p`` positions of an
epoch hold (``Mixture.seen_by_source``); the run's position is known on the host from its progress
(whole epochs, and the global batches of the current one), so these counts cost no device work and
hold exactly after a resume or under any processes x accumulation.
"""

from __future__ import annotations

from typing import Any

from ..progress import TrainingProgress


def source_metrics(
    dataset: Any, progress: TrainingProgress, batch_size: int, world_size: int
) -> dict[str, float]:
    """The per-source counts of ``dataset`` (empty unless it is a mixture)."""
    seen_by_source = getattr(dataset, "seen_by_source", None)
    if not callable(seen_by_source):
        return {}
    # Samples of the current epoch in its global order: whole global batches (its last one may be
    # short, and DROP_LAST leaves the tail unread).
    position = min(len(dataset), progress.batches_seen_in_epoch * batch_size * world_size)
    counts: dict[str, int] = seen_by_source(progress.epoch, position)
    per_sample = getattr(dataset, "tokens_per_sample", None)
    metrics = {f"samples_seen/{label}": float(n) for label, n in counts.items()}
    if per_sample is not None:
        metrics.update({f"tokens_seen/{label}": float(n * per_sample) for label, n in counts.items()})
    return metrics
