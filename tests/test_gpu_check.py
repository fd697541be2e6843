"""The GPU check (``benchmarks/gpu``) runs on the CPU at tiny size, so it cannot rot between the
rare runs on a GPU: every part that can run here runs and passes, the CUDA-only ones say they were
not run (never passed), and the results and log are written where the README says."""

from __future__ import annotations

import json
import math
import os
import subprocess
import tarfile
import traceback
from pathlib import Path

import pytest
import torch
from helpers.configs import REPO
from safetensors.torch import save_file

from benchmarks.gpu.common import compare_weights
from benchmarks.gpu.host_sync import OURS, reason, where
from benchmarks.gpu.species import workers_that_fit


@pytest.mark.slow  # about a minute: every part at once, 8 training runs and 8 lock-stepped loops among them
def test_the_gpu_check_runs_on_the_cpu_at_tiny_size(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LINNAEUS_ACCEL_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), str(tmp_path / "out"), "--size", "tiny"],
        # No wheels: prepare.sh's are for the GPU machine's Python; this one has what it needs.
        env={**env, "TMPDIR": str(tmp_path), "LINNAEUS_GPU_WHEELS": str(tmp_path / "no-wheels")},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text(encoding="utf-8"))
    parts = {p["name"]: p for p in results["parts"]}
    assert list(parts) == ["e2e", "sharded", "throughput", "recipe", "species", "host_sync", "checkpoint"]
    status = {name: p["status"] for name, p in parts.items()}
    assert status == {
        "e2e": "passed",
        "sharded": "not run",  # Accelerate selects FSDP and DeepSpeed only on accelerators
        "throughput": "passed",
        "recipe": "passed",
        "species": "passed",
        "host_sync": "not run",  # torch.cuda.set_sync_debug_mode needs CUDA
        "checkpoint": "passed",
    }, {name: (p["status"], p["reason"]) for name, p in parts.items()}
    assert "accelerators" in parts["sharded"]["reason"]
    assert "CUDA" in parts["host_sync"]["reason"]
    for part in parts.values():
        if part["status"] == "passed":
            assert part["checks"], part
            assert all(c["ok"] for c in part["checks"]), part
        else:
            assert not part["checks"], part  # a part not run checks nothing it could pass
    # e2e: killed and resumed, bitwise the uninterrupted run's weights (a LoRA adapter).
    assert parts["e2e"]["figures"]["lora"]["bitwise"] is True
    assert len(parts["e2e"]["not_run"]) == 4  # the other cases: overrides validated only
    assert {"ours tokens/s", "accelerate tokens/s", "plain tokens/s", "ours / accelerate"} <= set(
        parts["throughput"]["figures"]
    )
    # recipe: configs/gpt2_124m.yaml's settings (masking, chunked loss, accumulation) on both
    # sides; the same model and data, so their first losses agree (here, in fp32, closely).
    recipe = parts["recipe"]["figures"]
    assert {"ours tokens/s", "accelerate tokens/s", "ours / accelerate", "MFU goal (H100)"} <= set(recipe)
    first = recipe["losses (first logged)"]
    assert first["ours"] == pytest.approx(first["accelerate"], rel=0.02), first
    assert recipe["documents in the token file"] > 1
    # recipe, Muon: configs/gpt2_124m_muon.yaml takes turns with ours; the same model and data, so
    # the same loss before its first step; its tokens/s, its step time over ours', and
    # optimizer.step() alone of Muon + AdamW and of AdamW.
    assert first["ours, muon"] == pytest.approx(first["ours"], rel=1e-6), first
    steps = recipe["optimizer.step() alone"]
    figures = [recipe["ours, muon tokens/s"], recipe["ours, muon / ours step time"], steps["muon / adamw"]]
    assert all(math.isfinite(x) and x > 0 for x in [*figures, steps["muon ms"], steps["adamw ms"]]), recipe
    assert "ours, muon: loss logged and finite" in {c["name"] for c in parts["recipe"]["checks"]}
    # species: real JPEGs decoded, three sides (ours and the hand-written loop channels-last, ours
    # channels-first); the same model, batches and transforms, so their first losses agree in fp32.
    species = parts["species"]["figures"]
    assert {"ours images/s", "accelerate images/s", "ours, channels first images/s", "ours / accelerate",
            "channels-last speed-up (ours / ours, channels first)"} <= set(species)  # fmt: skip
    first = species["losses (first logged)"]
    assert first["ours"] == pytest.approx(first["accelerate"], rel=1e-4), first
    assert species["decode + transforms, ms per photo (one core)"] > 0
    assert results["size"] == "tiny"
    assert results["device"]["name"] == "cpu"
    log = (tmp_path / "out" / "log.txt").read_text(encoding="utf-8")
    for name, part in parts.items():
        assert f"-- {name}: {part['status']} in " in log
        assert (tmp_path / "out" / f"{name}.log").stat().st_size > 0
    # Run directories and checkpoints stay out of the results directory (it is copied back whole);
    # the training runs' output is there, packed.
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted(["results.json", "log.txt", "run_logs.tar.gz", *(f"{n}.log" for n in parts)])
    with tarfile.open(tmp_path / "out" / "run_logs.tar.gz") as tar:
        assert "e2e/c0_kill/log_resumed.txt" in tar.getnames()


def test_compare_weights_tells_bitwise_from_close_from_different(tmp_path: Path) -> None:
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7}
    for name, tensor in {"a": weights["w"], "same": weights["w"].clone(),
                         "close": weights["w"] + 1e-4, "far": weights["w"] + 1.0}.items():  # fmt: skip
        (tmp_path / name).mkdir()
        save_file({"w": tensor}, tmp_path / name / "model.safetensors")
    same = compare_weights(tmp_path / "a", tmp_path / "same")
    assert (same["bitwise"], same["close"], same["max_abs_diff"]) == (True, True, 0.0)
    close = compare_weights(tmp_path / "a", tmp_path / "close")
    assert (close["bitwise"], close["close"]) == (False, True)
    assert close["max_abs_diff"] == pytest.approx(1e-4, rel=0.1)
    far = compare_weights(tmp_path / "a", tmp_path / "far")
    assert (far["bitwise"], far["close"]) == (False, False)
    (tmp_path / "empty").mkdir()
    assert compare_weights(tmp_path / "a", tmp_path / "empty")["same_files"] is False


def test_a_sync_is_expected_only_under_a_read_of_ours() -> None:
    def frame(file: str, name: str) -> traceback.FrameSummary:
        return traceback.FrameSummary(file, 1, name)

    step = frame(f"/x{OURS}training/step/optimizer_step.py", "run")
    flush = frame(f"/x{OURS}training/metrics/meter.py", "flush")
    item = frame("/torch/_tensor.py", "item")
    assert reason([step, flush, item]) == "metric window read at a logging step"
    assert reason([step, item]) is None  # a read-back inside the optimizer step: a quiet-step sync
    assert reason([frame("/elsewhere/meter.py", "flush"), item]) is None  # not ours: not excused
    assert where([step, item]) == "training/step/optimizer_step.py:1 run"


def test_species_workers_are_fewer_where_their_batches_do_not_fit_in_shared_memory(tmp_path: Path) -> None:
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize  # others write there too: each row leaves a wide margin
    assert workers_that_fit(8, 1024, str(tmp_path))[0] == 8  # small batches: every worker asked for
    assert workers_that_fit(8, free // 18, str(tmp_path))[0] == 1  # 3 sides x 2 queued x 2 in flight
    assert workers_that_fit(8, free, str(tmp_path))[0] == 0  # decoded in the side's own process
    assert workers_that_fit(8, 1024, str(tmp_path / "absent")) == (8, None)  # no such folder: as asked
