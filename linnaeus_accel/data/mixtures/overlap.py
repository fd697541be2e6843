"""Two mixture sources that read the same data, and the warning that says so.

A sample that two sources read is drawn for both, so it is trained on more often than either weight
says. The mixture still builds: ``Mixture.describe`` carries the warnings, which ``plan``, ``train``
and ``summary.json`` show.

What a source reads is compared by key: for token files, each file's real path (so two globs, or a
link and its target, that name one file match); for a source built from the config, its dataset's
name and options with the paths among them resolved (``dataset_reads``); otherwise the dataset
object itself.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..tokens.files import TokenFiles

if TYPE_CHECKING:
    from .sources import MixtureSource


def dataset_reads(name: str, options: dict[str, Any]) -> str:
    """What a source of dataset ``name`` with ``options`` reads, to compare (paths among the
    options resolved), worded as a warning names it."""

    def resolved(value: Any) -> Any:
        if isinstance(value, str) and value and os.path.lexists(os.path.expanduser(value)):
            return os.path.realpath(os.path.expanduser(value))
        if isinstance(value, list | tuple):
            return [resolved(item) for item in value]
        if isinstance(value, dict):
            return {str(key): resolved(item) for key, item in value.items()}
        return value

    resolved_options = json.dumps(resolved(options), sort_keys=True, default=str)
    return f"the dataset {name} with the same options ({resolved_options})"


def _reads(source: MixtureSource) -> dict[str, str]:
    """What ``source`` reads: keys equal for the same data, each with how a warning names it."""
    if isinstance(source.dataset, TokenFiles):
        return {path: path for path in (os.path.realpath(part.file.path) for part in source.dataset.parts)}
    if source.reads is not None:
        return {source.reads: source.reads}
    return {f"object {id(source.dataset)}": "the same dataset object"}


def overlap_warnings(sources: Sequence[MixtureSource]) -> dict[str, list[str]]:
    """By label, a warning for each source that reads data an earlier one reads too: its samples
    are drawn for both, more often than either weight says."""
    reads = [_reads(source) for source in sources]
    found: dict[str, list[str]] = {}
    for (i, earlier), (j, later) in itertools.combinations(enumerate(sources), 2):
        shared = [what for key, what in reads[j].items() if key in reads[i]]
        if shared:
            more = f" (and {len(shared) - 1} more)" if len(shared) > 1 else ""
            found.setdefault(later.label, []).append(
                f"mixture sources {earlier.label!r} and {later.label!r} both read {shared[0]}{more}: its samples "
                "are drawn for both, more often than either weight says; list each file or dataset in one "
                "source only (its weight sets its share)"
            )
    return found
