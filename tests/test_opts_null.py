"""`--opts KEY null` means what `KEY: null` means in a YAML file, for every kind of key.

Each row writes the same key as null twice: in a file on top of the default config (through
BASE), and as `--opts KEY null` on the default config. Both must load to the same config (or fail
with the same problems), and the row checks what null means there, as a user would notice it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from linnaeus_accel.config import Config, ConfigError, load_config
from linnaeus_accel.schedule import resolve_plan

# The default config's digits run: 32 per batch, 1438 training samples -> 45 batches per epoch.
BATCHES_PER_EPOCH = 45


def nested(key: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return dict(out)


def from_file(tmp_path: Path, default_config_path: Path, key: str) -> Config:
    path = tmp_path / "null.yaml"
    path.write_text(yaml.safe_dump({"BASE": [str(default_config_path)], **nested(key, None)}))
    return load_config(path)


def from_opts(default_config_path: Path, key: str) -> Config:
    return load_config(default_config_path, [key, "null"])


def plan(config: Config) -> Any:
    return resolve_plan(config, BATCHES_PER_EPOCH)


NULL_MEANS: list[tuple[str, Callable[[Config], bool]]] = [
    # null = off, where the default is on: no LR scaling (scale 1 on 2 processes, not 64/32 from the file's 32)
    (
        "LR_SCHEDULER.REFERENCE_BS",
        lambda c: (
            (p := resolve_plan(c, BATCHES_PER_EPOCH, world_size=2)).lr_scale == 1.0
            and p.lr_curves[0].base_lr == 0.002
        ),
    ),
    # null = off, where the default is on: no gradient clipping (the default and the file say 5.0)
    ("TRAIN.CLIP_GRAD", lambda c: c.TRAIN.CLIP_GRAD is None),
    # null = an interval off: the file validates every epoch; null never validates
    ("SCHEDULE.VALIDATION.INTERVAL_EPOCHS", lambda c: plan(c).validation is None),
    # null = a unit unset: the file's 5% warmup is gone, so no warmup
    ("LR_SCHEDULER.WARMUP_FRACTION", lambda c: plan(c).warmup_steps == 0),
    # null = the run's length falls back to its default: 10 epochs instead of the file's 20
    ("TRAIN.EPOCHS", lambda c: plan(c).epochs == 10),
    # null = a condition off (the file sets none: it would be warned about while ACTIVE is false)
    ("TRAIN.EARLY_STOP.PATIENCE_STEPS", lambda c: c.TRAIN.EARLY_STOP.PATIENCE_STEPS is None),
    # null = automatic: the direction follows the metric's name (val/loss: lower is better)
    ("TRAIN.EARLY_STOP.MODE", lambda c: c.TRAIN.EARLY_STOP.mode == "min"),
    # null = another key's value: the checkpoint ranking follows the early-stopping metric
    ("SCHEDULE.CHECKPOINT.METRIC", lambda c: c.SCHEDULE.CHECKPOINT.METRIC is None),
    # null = another key's value: validation batches are DATA.BATCH_SIZE
    ("DATA.BATCH_SIZE_VAL", lambda c: c.DATA.BATCH_SIZE_VAL is None),
    # null = equal weights, where the file gives [1.0, 1.0] explicitly
    ("LOSS.TASK_WEIGHTS", lambda c: c.LOSS.TASK_WEIGHTS is None),
]


@pytest.mark.parametrize(("key", "means"), NULL_MEANS, ids=[key for key, _ in NULL_MEANS])
def test_null_from_opts_is_null_from_a_file(
    tmp_path: Path, default_config_path: Path, key: str, means: Callable[[Config], bool]
) -> None:
    config = from_opts(default_config_path, key)
    assert config == from_file(tmp_path, default_config_path, key)
    assert means(config)


NULL_REFUSED: list[tuple[str, str]] = [
    # a value with no off or automatic setting: null is an error naming the default to write instead
    (
        "TRAIN.ACCUMULATION_STEPS",
        "cannot be null (this key has no off or automatic setting): give a value; its default is 1",
    ),
    # a string: the same, with its default
    ("LR_SCHEDULER.NAME", "its default is cosine"),
    # a list: the same; [] empties it
    ("SCHEDULE.MIXUP.GROUP_LEVELS", "its default is []"),
    # a whole section: null is not "the defaults"
    ("SCHEDULE.MIXUP", "cannot be null: it is a section; give its keys, or leave it out for its defaults"),
]


@pytest.mark.parametrize(("key", "message"), NULL_REFUSED, ids=[key for key, _ in NULL_REFUSED])
def test_null_where_it_means_nothing_is_the_same_error_from_opts_and_a_file(
    tmp_path: Path, default_config_path: Path, key: str, message: str
) -> None:
    with pytest.raises(ConfigError) as opts_error:
        from_opts(default_config_path, key)
    with pytest.raises(ConfigError) as file_error:
        from_file(tmp_path, default_config_path, key)
    assert opts_error.value.problems == file_error.value.problems
    assert [k for k, _ in opts_error.value.problems] == [key]
    assert message in str(opts_error.value)


def test_a_mapping_from_opts_merges_into_the_section_like_a_file(
    tmp_path: Path, default_config_path: Path
) -> None:
    # The default config's mixup has a probability ramp; setting ALPHA through a mapping keeps it.
    path = tmp_path / "alpha.yaml"
    path.write_text(
        yaml.safe_dump({"BASE": [str(default_config_path)], **nested("SCHEDULE.MIXUP", {"ALPHA": 0.5})})
    )
    config = load_config(default_config_path, ["SCHEDULE.MIXUP", "{ALPHA: 0.5}"])
    assert config == load_config(path)
    assert config.SCHEDULE.MIXUP.ALPHA == 0.5
    assert config.SCHEDULE.MIXUP.PROB == load_config(default_config_path).SCHEDULE.MIXUP.PROB
