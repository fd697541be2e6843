"""``linnaeus-accel evaluate``: a checkpoint's or a run's final weights give the numbers the run
logged for that step's validation, nothing in the run directory changes but the result file, and
weights that are not committed or are damaged are refused before anything is measured.

One tiny run (default digits config, 2 epochs of batch 256, a checkpoint each epoch, every pass at
every epoch) is trained once for the module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from helpers.processes import accelerate_launch_command, launch_env

pytestmark = pytest.mark.slow  # the module trains a run first (4 s on a quiet 2-core machine)

OPTS = [
    "TRAIN.EPOCHS",
    "2",
    "DATA.BATCH_SIZE",
    "256",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS",
    "1",
    "SCHEDULE.CHECKPOINT.KEEP_LAST_N",
    "0",
    "SCHEDULE.CHECKPOINT.KEEP_TOP_N",
    "0",
    "SCHEDULE.VALIDATION.MASK_META_INTERVAL_EPOCHS",
    "1",
    "SCHEDULE.VALIDATION.PARTIAL_MASK_META.INTERVAL_EPOCHS",
    "1",
]
MID_RUN = "step_00000006"  # the end of epoch 1 (1438 samples / 256 = 6 steps per epoch)


class TinyRun:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.dir = base / "digits_default"
        self.opts = ["ENV.OUTPUT.BASE_DIR", str(base), *OPTS]

    def evaluate(
        self, checkpoint: Path | str, *extra: str, opts: tuple[str, ...] = ()
    ) -> tuple[int, str, str]:
        reset_accelerate()
        try:
            return run_cli(
                "evaluate", "--cfg", str(DEFAULT_CONFIG), "--checkpoint", str(checkpoint), *extra,
                "--opts", *self.opts, *opts,
            )  # fmt: skip
        finally:
            reset_accelerate()

    def logged_validation(self, step: int) -> dict[str, float]:
        records = [json.loads(line) for line in (self.dir / "metrics.jsonl").read_text().splitlines()]
        (record,) = [r for r in records if r["global_step"] == step and "val/loss" in r]
        return {k: v for k, v in record.items() if k not in ("global_step", "epoch")}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    tiny = TinyRun(tmp_path_factory.mktemp("evaluate") / "outputs")
    reset_accelerate()
    try:
        rc, out, err = run_cli("train", "--cfg", str(DEFAULT_CONFIG), "--opts", *tiny.opts)
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    assert (tiny.dir / "checkpoints" / MID_RUN / "COMMITTED.json").is_file()
    return tiny


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every entry under ``directory``: a file's bytes, None for a directory."""
    return {
        p.relative_to(directory).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(directory.rglob("*"))
    }


def test_final_and_mid_run_weights_give_the_numbers_the_run_logged(run: TinyRun) -> None:
    before = snapshot(run.dir)
    summary = json.loads((run.dir / "summary.json").read_text())

    rc, out, err = run.evaluate(run.dir / "final")
    assert rc == 0, out + err
    final = json.loads((run.dir / "eval" / "final.json").read_text())
    logged = run.logged_validation(summary["global_step"])
    assert final["metrics"] == logged  # the final boundary's passes, bit for bit
    assert final["global_step"] == summary["global_step"] == 12
    assert final["num_processes"] == 1
    assert list(final["passes"]) == list(dict.fromkeys(k.split("/")[0] for k in logged))
    for prefix, metrics in final["passes"].items():  # one line per pass, with its metrics
        (line,) = [line for line in out.splitlines() if line.startswith(f"{prefix}: ")]
        assert f"{prefix}/loss {metrics[f'{prefix}/loss']:.4f}" in line

    rc, out, err = run.evaluate(run.dir / "checkpoints" / MID_RUN)
    assert rc == 0, out + err
    mid = json.loads((run.dir / "eval" / f"{MID_RUN}.json").read_text())
    logged = run.logged_validation(6)
    assert mid["global_step"] == 6
    # Epoch 1 ran the whitelisted partial passes; the final boundary runs the exhaustive ones,
    # which include them: every number the run logged at step 6 comes back, and more.
    assert {k: mid["metrics"][k] for k in logged} == logged
    assert set(mid["metrics"]) == set(final["metrics"])
    assert mid["metrics"]["val/loss"] != final["metrics"]["val/loss"]  # other weights were loaded

    after = snapshot(run.dir)
    added = {k: v for k, v in after.items() if k not in before}
    assert set(added) == {"eval", "eval/final.json", f"eval/{MID_RUN}.json"}
    assert {k: after[k] for k in before} == before  # every other file's bytes, and no file removed


def test_out_writes_where_asked_and_only_there(run: TinyRun, tmp_path: Path) -> None:
    before = snapshot(run.dir)
    target = tmp_path / "results" / "eval.json"
    rc, out, err = run.evaluate(run.dir / "final", "--out", str(target))
    assert rc == 0, out + err
    assert json.loads(target.read_text())["metrics"] == run.logged_validation(12)
    assert f"wrote {target}" in out
    assert snapshot(run.dir) == before
    assert [p.name for p in target.parent.iterdir()] == ["eval.json"]  # no temporary file left


def test_weights_not_committed_missing_or_damaged_are_refused(run: TinyRun, tmp_path: Path) -> None:
    before = snapshot(run.dir)
    source = run.dir / "checkpoints" / MID_RUN
    unfinished = tmp_path / "a" / "checkpoints" / MID_RUN  # as a write killed before its commit leaves it
    shutil.copytree(source, unfinished)
    (unfinished / "COMMITTED.json").unlink()
    damaged = tmp_path / "b" / "checkpoints" / MID_RUN
    shutil.copytree(source, damaged)
    weights = bytearray((damaged / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF  # one flipped bit in a weight: same size, only its digest tells
    (damaged / "model.safetensors").write_bytes(bytes(weights))
    cases = {
        unfinished: f"{unfinished} is not a committed checkpoint (no COMMITTED.json",
        tmp_path / "nowhere": f"{tmp_path / 'nowhere'} does not exist",
        damaged: f"{damaged} is damaged: model.safetensors: checksum mismatch",
        run.dir / "assets": "is not a committed checkpoint",
    }
    for path, message in cases.items():
        rc, out, err = run.evaluate(path)
        assert rc == 2, (path, out, err)
        assert err.startswith("linnaeus-accel: invalid arguments (1 problem):\n  --checkpoint: ")
        assert message in err
        assert "Traceback" not in err
        assert "val/loss" not in out  # refused before anything was measured
    assert not (tmp_path / "a" / "eval").exists()
    assert not (tmp_path / "b" / "eval").exists()
    # Weights of another model than the config builds: which ones do not fit, and the fix.
    rc, out, err = run.evaluate(run.dir / "final", opts=("MODEL.OPTIONS.hidden", "64"))
    assert rc == 2, out + err
    assert f"MODEL: the weights in {run.dir / 'final'} do not fit the model this config builds" in err
    assert "use the run's own config" in err
    assert snapshot(run.dir) == before


def test_two_processes_give_the_same_numbers_printed_once(run: TinyRun, tmp_path: Path) -> None:
    """Under `accelerate launch`: the checkpoint is verified by the main process for all, each
    process measures its share of the validation data, the numbers are the run's."""
    target = tmp_path / "eval.json"
    command = [
        *accelerate_launch_command(2),
        "-m", "linnaeus_accel", "evaluate", "--cfg", str(DEFAULT_CONFIG),
        "--checkpoint", str(run.dir / "checkpoints" / MID_RUN), "--out", str(target), "--opts", *run.opts,
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=tmp_path, env=launch_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(target.read_text())
    assert result["num_processes"] == 2
    assert set(result["metrics"]) == set(run.logged_validation(12))  # the final boundary's passes
    for key, value in run.logged_validation(6).items():
        if key.endswith("/loss"):  # float32 sums added in another order over two processes
            assert result["metrics"][key] == pytest.approx(value, rel=1e-6), key
        else:  # counts of right answers: exact
            assert result["metrics"][key] == value, key
    assert proc.stdout.count("val: val/loss") == 1
    assert proc.stdout.count(f"wrote {target}") == 1


def test_overwrite_removes_the_results_of_the_weights_it_deletes(run: TinyRun, tmp_path: Path) -> None:
    from linnaeus_accel.run_directory.outputs import clear_run

    copy = tmp_path / "digits_default"
    shutil.copytree(run.dir, copy)
    rc, out, err = run.evaluate(copy / "final")
    assert rc == 0, out + err
    assert (copy / "eval" / "final.json").is_file()
    clear_run(copy)  # what `train --overwrite` does first
    assert not (copy / "eval").exists()


def test_an_empty_checkpoint_key_is_refused(run: TinyRun, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key set but empty (a secret the job script failed to read) would check no signature."""
    monkeypatch.setenv("LINNAEUS_CHECKPOINT_KEY", "")
    rc, _, err = run.evaluate(run.dir / "final")
    assert rc == 2, err
    assert "LINNAEUS_CHECKPOINT_KEY is set but empty" in err
