"""Hugging Face ``datasets`` handed straight to the ``Trainer`` (a user's own script,
``tests/hf_direct_train.py``): a map-style ``datasets.Dataset`` and a streaming
``datasets.IterableDataset`` (no ``__len__``, four shards), on 1 and 2 processes, with 0 and 2
DataLoader workers, killed -9 at a seeded random step and rerun: the final weights are
byte-identical to an uninterrupted run's, and the metrics history the same.

The kill is a process of its own; the reference and the rerun after the kill call the script's
``main`` in the test's process (``call_here``: a process of its own is mostly torch's import).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from helpers.configs import REPO
from helpers.in_process import call_here
from helpers.processes import AFTER_FIRST_COMMIT, accelerate_launch_command
from helpers.runs import Result, TrainRun, assert_same_run, committed, read_summary

from linnaeus_accel.data.text import load_topics
from linnaeus_accel.data.tokens.packing import BYTE_EOS

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
datasets = pytest.importorskip("datasets")

SCRIPT = REPO / "tests" / "hf_direct_train.py"
SEQ_LEN = 65


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four training shards of uneven sizes and a validation file of 65-token byte-level windows."""
    root = tmp_path_factory.mktemp("hf_data")
    tokens = [b for _, text in load_topics()[:30] for b in [*text, BYTE_EOS]]
    windows = [tokens[k * 64 : k * 64 + SEQ_LEN] for k in range((len(tokens) - 1) // 64)]
    for shard, (a, b) in enumerate([(0, 60), (60, 110), (110, 190), (190, 230)]):
        lines = (json.dumps({"input_ids": w}) + "\n" for w in windows[a:b])
        (root / f"train-{shard}.jsonl").write_text("".join(lines))
    (root / "val.jsonl").write_text("".join(json.dumps({"input_ids": w}) + "\n" for w in windows[230:250]))
    return root


class ScriptRun(TrainRun):
    """``TrainRun`` for a user's script rather than ``linnaeus-accel train``."""

    def __init__(self, root: Path, data: Path, mode: str, workers: int, processes: int) -> None:
        super().__init__(root, [], processes)
        root.mkdir(parents=True, exist_ok=True)
        self.args = [str(data), str(self.base), mode, str(workers)]

    def command(self, args: object, python_code: object) -> list[str]:
        if self.processes > 1:
            return [*accelerate_launch_command(self.processes), str(SCRIPT), *self.args]
        return [sys.executable, str(SCRIPT), *self.args]

    def here(self) -> Result:
        """The script's ``main`` with the same arguments in this process, with a datasets cache of
        this run's own, as the HF_HOME under its root gives its process."""
        assert self.processes == 1, "a run of several processes needs a launcher: run()"
        data, out, mode, workers = self.args
        main = script().main  # imported before the console is redirected
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(self.root / "hf_home" / "datasets"))
            return call_here(self.dir, lambda: main(data, out, mode, int(workers)))


@cache
def script() -> ModuleType:
    """tests/hf_direct_train.py, imported (not run as ``__main__``, whose end is ``os._exit``)."""
    spec = importlib.util.spec_from_file_location("hf_direct_train", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# One process reading a map-style dataset in the main process is the simplest case of map-1x2 (and
# of every single-process resume test): left out for the suite's time.
LAYOUTS = [  # (mode, workers, processes)
    pytest.param("map", 2, 1, id="map-1x2"),
    pytest.param("stream", 2, 1, id="stream-1x2"),
]  # 2 processes streaming (2 workers each): test_data_at_scale (hf_dataset, killed inside a pass's
# tail), test_sharded_streams; a stream's position held by the main process (no workers) on 2
# processes: test_streaming's resume tests, and stream-1x2 here for hf_dataset's own state; a
# map-style dataset's order on 2 processes is the sampler's, whatever the dataset (test_resume,
# test_token_files): map-1x2 here for hf_dataset's windows read in DataLoader workers


@pytest.mark.parametrize(("mode", "workers", "processes"), LAYOUTS)
def test_hf_dataset_killed_and_rerun_ends_byte_identical(
    data_dir: Path, tmp_path: Path, mode: str, workers: int, processes: int
) -> None:
    reference = ScriptRun(tmp_path / "ref", data_dir, mode, workers, processes).here()
    assert reference.returncode == 0, reference.tail()
    assert read_summary(reference.dir)["global_step"] == 32
    run = ScriptRun(tmp_path / "killed", data_dir, mode, workers, processes)
    step = random.Random(f"{mode}{workers}{processes}").randint(9, 27)  # past the first checkpoint (7)
    killed = run.run(kill_at=f"optimizer_step:{step}", extra_env=AFTER_FIRST_COMMIT)
    assert killed.returncode != 0, killed.tail()  # SIGKILLed (under a launcher: it reports a failure)
    assert not (run.dir / "summary.json").exists()
    assert committed(run.dir), killed.tail()
    resumed = run.here()
    assert "resumed from " in resumed.output, resumed.tail()
    assert_same_run(resumed, reference)
