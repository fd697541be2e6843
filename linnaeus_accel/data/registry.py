"""Datasets by name (``DATA.DATASET.NAME``).

Register your own from your training script::

    from linnaeus_accel.data import register_dataset

    @register_dataset("my_data")
    def build_my_data(config, split):   # split is "train" or "val"
        return MyDataset(...)           # any map-style torch Dataset

Built-in datasets are imported only when first asked for, so ``plan --dataset-size`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ..registry import Registry

if TYPE_CHECKING:
    from ..config import Config
    from ..config.schedule import ScheduleConfig

Split = Literal["train", "val"]
DatasetBuilder = Callable[["Config", Split], Any]

DATASETS: Registry[DatasetBuilder] = Registry(
    "dataset",
    "DATA.DATASET.NAME",
    "linnaeus_accel.data.register_dataset",
    {
        "digits": "linnaeus_accel.data.digits",
        "digits_images": "linnaeus_accel.data.digits",
        "hf_dataset": "linnaeus_accel.data.hf.dataset",
        "mixture": "linnaeus_accel.data.mixtures.mixture",
        "python_docs": "linnaeus_accel.data.text",
        "token_files": "linnaeus_accel.data.tokens.files",
        "linnaeus_h5": "linnaeus_accel.data.species.build",
        "image_table": "linnaeus_accel.data.species.build",
    },
)
register_dataset = DATASETS.register
get_dataset_builder = DATASETS.get


def build_dataset(config: Config, split: Split) -> Any:
    """The dataset DATA.DATASET.NAME names; linnaeus' ``labels.h5`` when DATA.H5.LABELS_PATH is set."""
    name = "linnaeus_h5" if config.DATA.H5.LABELS_PATH is not None else config.DATA.DATASET.NAME
    return get_dataset_builder(name)(config, split)


def dataset_problems(schedule: ScheduleConfig, dataset: Any) -> list[tuple[str, str]]:
    """Config keys that name label levels or metadata components the dataset does not have.

    Datasets may declare ``levels`` and ``meta_components``; undeclared ones are not checked.
    """
    problems: list[tuple[str, str]] = []
    components = getattr(dataset, "meta_components", None)
    if components is not None:
        for key, combos in schedule.partial_whitelists().items():
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
    group_levels = schedule.MIXUP.GROUP_LEVELS
    if levels is not None and group_levels and group_levels[0] not in levels:
        problems.append(
            (
                "SCHEDULE.MIXUP.GROUP_LEVELS",
                f"{group_levels[0]!r} is not a label level of the dataset ({', '.join(levels)})",
            )
        )
    return problems
