"""docs/config.md is the reference generated from the config models, current, and complete."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.configs import REPO

from linnaeus_accel.config import ConfigError, load_config
from linnaeus_accel.config_reference import COMMAND, all_keys, render, sections, unit_families

DOC = REPO / "docs" / "config.md"


def test_docs_config_md_is_current() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/config.md is stale: run `{COMMAND}`"


def test_every_key_has_a_description() -> None:
    missing = [key.path for key in all_keys() if not key.description]
    assert not missing, f"keys without Field(description=...): {', '.join(missing)}"


def test_every_key_is_in_the_reference_with_its_default() -> None:
    text = render()
    keys = all_keys()
    assert len(keys) > 100  # every section is walked, nested ones and list items included
    for key in keys:
        assert f"| `{key.path}` |" in text
    assert "| `LR_SCHEDULER.REFERENCE_BS` | integer >= 1, or null | `512` |" in text
    assert "| `SCHEDULE.VALIDATION.INTERVAL_FRACTION` | number in [0, 1], or null | `null` |" in text
    assert "| `DATA.BATCH_SIZE` | integer >= 1, at most 1,048,576 | `64` |" in text
    assert (
        "| `TRAIN.NONFINITE` | `stop` \\| `skip` \\| `rollback` | `stop` |" in text
    )  # a pipe inside a cell is escaped


@pytest.mark.parametrize(
    ("section", "family"),
    [(s.path, family) for s in sections() if "<i>" not in s.path for family in unit_families(s.model)],
)
def test_each_unit_group_the_reference_names_is_one_parameter(
    default_config_path: Path, section: str, family: list[str]
) -> None:
    # The reference says "set at most one of ..." for each group it finds by name: setting two of
    # them must be the config error naming both.
    first, second = (f"{section}.{name}" for name in family[:2])
    with pytest.raises(ConfigError) as info:
        load_config(default_config_path, [first, "1", second, "1"])
    together = [k for k, message in info.value.problems if "set together" in message]
    assert together, info.value
    assert first in together[0]
    assert second in together[0]


def test_the_documented_command_writes_the_reference(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "linnaeus_accel.config_reference"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert out == render()
    assert COMMAND in out.splitlines()[4]  # the command is at the top of the file


TRANSFORMERS_KNOBS = [
    "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "learning_rate", "lr_scheduler_type", "warmup_ratio", "max_grad_norm", "logging_steps", "eval_steps",
    "save_steps", "save_total_limit", "resume_from_checkpoint", "report_to", "bf16", "gradient_checkpointing",
    "dataloader_num_workers", "seed",
]  # fmt: skip


def test_coming_from_transformers_maps_every_knob_to_a_key_that_exists() -> None:
    """Each TrainingArguments knob has a row, and every config key the page names is a real one."""
    text = (REPO / "docs" / "coming-from-transformers.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1] for line in text.splitlines() if line.startswith("| `")}
    for knob in TRANSFORMERS_KNOBS:
        assert any(f"`{knob}`" in cell for cell in rows), knob
    named = set(
        re.findall(r"`((?:TRAIN|DATA|LR_SCHEDULER|SCHEDULE|MODEL|EXPERIMENT|ENV)\.[A-Za-z_.]+)`", text)
    )
    reference = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    unknown = [key for key in named if f"`{key}`" not in reference and not key.startswith("MODEL.OPTIONS.")]
    assert not unknown, unknown
    assert "63/64" in text  # how transformers' reported loss differs
    assert "TRAIN.CLIP_GRAD" in text
    assert "default 5.0" in text
