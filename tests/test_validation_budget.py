"""``SCHEDULE.VALIDATION.MAX_BATCHES``: validation on a fixed, seeded budget of batches per process
(``training.validation.data``), the final validation on the whole split (``FINAL_EPOCH.WHOLE_SPLIT``).

In-process runs of the built-in digits data (359 validation images), the validation dataset
wrapped so that it records every index (or, as a stream, every sample) it hands out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from accelerate.utils import set_seed
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from torch.utils.data import Dataset, IterableDataset

from linnaeus_accel.checkpoint.resume.config_changes import review_changes
from linnaeus_accel.config import Config, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.sampling import EpochOrderSampler, EpochSeededSampler, SubsetSampler
from linnaeus_accel.models import build_model
from linnaeus_accel.process import faults
from linnaeus_accel.schedule import resolve_plan
from linnaeus_accel.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

N_VAL = 359
BATCH_VAL, MAX_BATCHES = 16, 2
BUDGET = BATCH_VAL * MAX_BATCHES  # samples per budgeted pass on one process
FAST = [
    "DATA.BATCH_SIZE", "128",
    "DATA.BATCH_SIZE_VAL", str(BATCH_VAL),
    "SCHEDULE.VALIDATION.MAX_BATCHES", str(MAX_BATCHES),
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS", "null",
    "SCHEDULE.VALIDATION.PARTIAL_MASK_META.ENABLED", "false",
    "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",  # the final epoch's only
]  # fmt: skip


class Recorded(Dataset[Any]):
    """A map-style dataset that records the indices it is asked for."""

    def __init__(self, data: Any) -> None:
        self.data, self.seen = data, []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        self.seen.append(int(index))
        return self.data[index]


class RecordedStream(IterableDataset[Any]):
    """The same samples as a stream without ``__len__``; records each pass's samples."""

    def __init__(self, data: Any) -> None:
        self.data, self.passes = data, []

    def __iter__(self) -> Iterator[Any]:
        self.passes.append([])
        for index in range(len(self.data)):
            self.passes[-1].append(index)
            yield self.data[index]


class Reversed(EpochOrderSampler):
    def _order(self, start: int) -> Iterator[int]:
        return iter(range(self.size - 1 - start, -1, -1))


def budget_config(tmp_path: Path, *opts: str) -> Config:
    return load_config(DEFAULT_CONFIG, [*FAST, "ENV.OUTPUT.BASE_DIR", str(tmp_path), *opts])


def train(config: Config, wrap: Any = Recorded, resume: bool = False) -> tuple[dict[str, Any], Any]:
    """One run (or its resumption); the summary and the recording validation dataset."""
    reset_accelerate()
    data, val = build_dataset(config, "train"), build_dataset(config, "val")
    recorded = wrap(val)
    set_seed(config.EXPERIMENT.SEED)  # as the command line does: the same initial weights in every run
    trainer = Trainer(config, build_model(config, data), data, recorded)
    try:
        return trainer.fit(overwrite=not resume), recorded
    finally:
        reset_accelerate()


def passes(seen: list[int], sizes: list[int]) -> list[list[int]]:
    """``seen`` cut into consecutive passes of ``sizes`` indices (all of it)."""
    assert len(seen) == sum(sizes), (len(seen), sizes)
    out, start = [], 0
    for size in sizes:
        out.append(seen[start : start + size])
        start += size
    return out


def val_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if any(k.startswith("val") for k in r)]


def test_the_subset_is_fixed_seeded_and_nested() -> None:
    base = EpochSeededSampler(range(1000), seed=0, shuffle=False)
    subset = SubsetSampler(base, 64, seed=42)
    first = list(subset)
    subset.set_epoch(5)
    assert list(subset) == first == sorted(set(first))
    assert len(first) == len(subset) == 64
    assert list(SubsetSampler(base, 64, seed=42)) == first
    assert list(SubsetSampler(base, 64, seed=7)) != first
    assert set(first) < set(SubsetSampler(base, 128, seed=42))  # 2 processes: a superset
    assert len(SubsetSampler(base, 5000, seed=42)) == 1000
    # A sampler of its own order (a mixture's): the subset holds the samples at the chosen positions.
    reversed_order = SubsetSampler(Reversed(1000, seed=0), 64, seed=42)
    assert list(reversed_order) == [999 - p for p in first]


def test_validations_read_the_same_budget_and_the_final_one_the_whole_split(tmp_path: Path) -> None:
    config = budget_config(tmp_path / "a", "TRAIN.EPOCHS", "3")
    result, recorded = train(config)
    assert result["status"] == "completed"
    one, two, final = passes(recorded.seen, [BUDGET, BUDGET, N_VAL])
    assert one == two == sorted(one)
    assert len(set(one)) == BUDGET
    assert final == list(range(N_VAL))
    records = val_records(config.output_dir)
    assert [r["global_step"] for r in records] == [12, 24, 36]
    # Another run with the seed: the same subset (WHOLE_SPLIT false: the final validation too).
    # Another seed's subset: test_the_subset_is_fixed_seeded_and_nested, without a run.
    subset_only = ("TRAIN.EPOCHS", "1", "SCHEDULE.VALIDATION.FINAL_EPOCH.WHOLE_SPLIT", "false")
    same, recorded = train(budget_config(tmp_path / "b", *subset_only))
    assert same["status"] == "completed"
    assert recorded.seen == one


def test_a_stream_reads_its_first_max_batches_per_pass(tmp_path: Path) -> None:
    result, recorded = train(budget_config(tmp_path, "TRAIN.EPOCHS", "2"), wrap=RecordedStream)
    assert result["status"] == "completed"
    first, final = recorded.passes
    # The stream is read in order: a pass stops after its first MAX_BATCHES batches (no DataLoader
    # workers here, so nothing is read ahead); the final one reads it all.
    assert first == list(range(BUDGET))
    assert final == list(range(N_VAL))


def test_a_run_killed_during_a_budgeted_validation_resumes_to_the_same_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two passes per boundary (val, val_mask_meta), a checkpoint before them: the run stops right
    after epoch 1's first pass is journalled; the rerun runs the second on the same subset."""
    opts = (
        "TRAIN.EPOCHS", "2",
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS", "1",
        "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1",
    )  # fmt: skip
    reference, _ = train(budget_config(tmp_path / "ref", *opts))
    config = budget_config(tmp_path / "run", *opts)
    monkeypatch.setattr(faults, "_ARMED", {"validation_pass": (1, faults._raise)})
    monkeypatch.setattr(faults, "_seen", faults.Counter())
    with pytest.raises(RuntimeError, match="fault point"):
        train(config)
    monkeypatch.setattr(faults, "_ARMED", {})
    resumed, recorded = train(config, resume=True)
    assert resumed["status"] == reference["status"] == "completed"
    # The rerun: epoch 1's val_mask_meta pass on the subset (its val pass is journalled), then the
    # final boundary's two passes on the whole split.
    assert len(recorded.seen) == BUDGET + N_VAL * 2
    ref_dir, run_dir = tmp_path / "ref" / config.EXPERIMENT.NAME, config.output_dir
    weights = "final/model.safetensors"
    assert (run_dir / weights).read_bytes() == (ref_dir / weights).read_bytes()
    assert val_records(run_dir) == val_records(ref_dir)  # every pass's metrics, to the last bit


def test_plan_states_the_budget(tmp_path: Path) -> None:
    opts = ["--opts", *FAST, "ENV.OUTPUT.BASE_DIR", str(tmp_path)]
    rc, out, err = run_cli("plan", "--cfg", str(DEFAULT_CONFIG), "--world-size", "2", *opts)
    assert rc == 0, err
    line = next(line for line in out.splitlines() if line.startswith("Validation data:"))
    assert "2 batches per process per pass (at most 64 samples: batch 16 x 2 processes)" in line
    assert "final validation on the whole split" in line
    rc, out, err = run_cli("plan", "--cfg", str(DEFAULT_CONFIG), "--json", "--no-series", *opts)
    assert json.loads(out)["validation_budget"] == {
        "max_batches_per_process": 2,
        "batch_size": 16,
        "max_samples": 32,
        "final_whole_split": True,
    }
    rc, out, err = run_cli(
        "plan", "--cfg", str(DEFAULT_CONFIG), "--opts", "ENV.OUTPUT.BASE_DIR", str(tmp_path)
    )
    assert rc == 0
    assert "Validation data:" not in out


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("SCHEDULE.VALIDATION.MAX_BATCHES", "0"),
        ("SCHEDULE.VALIDATION.MAX_BATCHES", "half"),
        ("SCHEDULE.VALIDATION.FINAL_EPOCH.WHOLE_SPLIT", "sometimes"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, key: str, value: str) -> None:
    rc, _out, err = run_cli("plan", "--cfg", str(DEFAULT_CONFIG), "--opts", key, value)
    assert rc == 2, err
    assert key in err, err


def test_a_changed_budget_on_resume_is_applied_with_a_note() -> None:
    before = load_config(DEFAULT_CONFIG)
    after = load_config(DEFAULT_CONFIG, ["SCHEDULE.VALIDATION.MAX_BATCHES", "20"])
    plan = resolve_plan(after, 45, 1, 1438)
    saved_plan = {"total_steps": plan.total_steps, "world_size": 1, "accumulation": 1, "batch_size": 32}
    (line,) = review_changes(
        before.model_dump(mode="json"), saved_plan, after.model_dump(mode="json"), plan, 90, allow=False
    )
    assert line.startswith("SCHEDULE.VALIDATION.MAX_BATCHES: None -> 20 (")
    assert "not like for like" in line
