"""Datasets by name (``DATA.DATASET.NAME``).

Register your own from your training script::

    from linnaeus_accel.data import register_dataset

    @register_dataset("my_data")
    def build_my_data(config, split):   # split is "train" or "val"
        return MyDataset(...)           # any map-style torch Dataset

Built-in datasets are imported only when first asked for, so ``plan --dataset-size`` stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ..config import ConfigError

if TYPE_CHECKING:
    from ..config import Config

Split = Literal["train", "val"]
DatasetBuilder = Callable[["Config", Split], Any]

_DATASETS: dict[str, DatasetBuilder] = {}
_BUILTIN_MODULES = {"digits": "linnaeus_accel.data.digits"}


def register_dataset(name: str) -> Callable[[DatasetBuilder], DatasetBuilder]:
    def decorate(builder: DatasetBuilder) -> DatasetBuilder:
        _DATASETS[name] = builder
        return builder

    return decorate


def get_dataset_builder(name: str) -> DatasetBuilder:
    if name not in _DATASETS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _DATASETS:
        known = sorted(set(_DATASETS) | set(_BUILTIN_MODULES))
        raise ConfigError(
            [
                (
                    "DATA.DATASET.NAME",
                    f"no dataset named {name!r}; known: {', '.join(known)} "
                    "(register your own with @linnaeus_accel.data.register_dataset)",
                )
            ]
        )
    return _DATASETS[name]


def build_dataset(config: Config, split: Split) -> Any:
    return get_dataset_builder(config.DATA.DATASET.NAME)(config, split)


def dataset_problems(config: Config, dataset: Any) -> list[tuple[str, str]]:
    """Config keys that name label levels or metadata components the dataset does not have.

    Datasets may declare ``levels`` and ``meta_components``; undeclared ones are not checked.
    """
    problems: list[tuple[str, str]] = []
    components = getattr(dataset, "meta_components", None)
    if components is not None:
        for key, combos in config.SCHEDULE.partial_whitelists().items():
            unknown = sorted({c for combo in combos for c in combo} - set(components))
            if unknown:
                problems.append(
                    (
                        f"SCHEDULE.{key}",
                        f"{', '.join(unknown)} not among the dataset's metadata components "
                        f"({', '.join(components)})",
                    )
                )
    levels = getattr(dataset, "levels", None)
    group_levels = config.SCHEDULE.MIXUP.GROUP_LEVELS
    if levels is not None and group_levels and group_levels[0] not in levels:
        problems.append(
            (
                "SCHEDULE.MIXUP.GROUP_LEVELS",
                f"{group_levels[0]!r} is not a label level of the dataset ({', '.join(levels)})",
            )
        )
    return problems
