"""Sharded (FSDP2) model state through our checkpoint machinery: ``CheckpointWriter.save``'s collective
protocol, ``CheckpointStore``'s commit and verification, and resume.

``tests/sharded_worker.py`` trains a tiny MLP sharded with torch's FSDP2 (``fully_shard``) on 2
gloo processes under ``torchrun`` and checkpoints it every 4 steps through ``CheckpointWriter.save``;
its model and optimizer state are written as Accelerate's FSDP2 ``save_state`` writes them with
SHARDED_STATE_DICT: ``torch.distributed.checkpoint`` (DCP) directories ``pytorch_model_fsdp_0/``
and ``optimizer_0/`` (``__0_0.distcp``, ``__1_0.distcp``, ``.metadata``), written by every process,
here from Accelerate's save/load pre-hooks (inside ``save_state`` / ``load_state``).

Why torch-level: Accelerate selects its FSDP path (``DistributedType.FSDP``) only on accelerators
(MULTI_GPU, MULTI_XPU, ...); on CPU processes it stays MULTI_CPU, where ``prepare`` wraps a model in
DDP, so its FSDP ``save_state`` cannot run end to end here. The sharding and the DCP writes are
therefore torch's own, called as Accelerate calls them; everything around them (staging, the rank
files, the processes' agreement, the commit and its manifest, verification, fallback, resume) is
linnaeus-accel's real code.

- An uninterrupted run gives the reference weights; each committed checkpoint's ``COMMITTED.json``
  lists the DCP files of both ranks (model and optimizer), and the checkpoint verifies deeply.
- Rank 1 SIGKILLed right after writing its model shard of the step-8 checkpoint (before rank 0
  wrote DCP's ``.metadata``): the launch fails, step 4 is the only committed checkpoint; the same
  command rerun resumes from step 4, finishes, and its final weights equal the reference byte for
  byte.
- One flipped byte in rank 1's shard of the newest checkpoint (same size: only the sha256 sees it)
  makes resume reject that checkpoint (moved to ``rejected/``) and choose the previous one.
- On 2 machines without a shared directory (``helpers.nodes``) meeting in a ``file://`` bucket:
  each machine's disk holds its own rank's shards (DCP's ``.metadata``, the coordinator's, on the
  first only); killed once step 4 is whole in the bucket and rerun with the second machine's disk
  gone, the run resumes from the bucket and ends with the reference weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.configs import CFG, REPO
from helpers.launches import Launch, launch_logged
from helpers.nodes import two_nodes
from helpers.processes import torchrun_command
from safetensors.torch import load_file

from linnaeus_accel.checkpoint.directory import read_marker
from linnaeus_accel.checkpoint.resume.reader import CheckpointReader
from linnaeus_accel.checkpoint.state.files import checkpoint_store
from linnaeus_accel.config import load_config

WORKER = REPO / "tests" / "sharded_worker.py"
LAUNCH_TIMEOUT_S = 180
DCP_FILES = ("__0_0.distcp", "__1_0.distcp", ".metadata")  # of each DCP directory, both ranks' shards
DCP_DIRS = ("pytorch_model_fsdp_0", "optimizer_0")  # Accelerate's FSDP names (model 0, optimizer 0)

pytestmark = pytest.mark.slow


def launch(tmp: Path, name: str, log: str, extra_env: dict[str, str] | None = None) -> Launch:
    """The worker under torchrun, 2 processes; its run directory is ``tmp/outputs/name``."""
    command = [
        *torchrun_command(2), str(WORKER),
        "--base-dir", str(tmp / "outputs"), "--name", name, "--final", str(tmp / f"{name}.final.safetensors"),
    ]  # fmt: skip
    return launch_logged(command, tmp, log, tmp / "outputs" / name, extra_env, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Launch]:
    """The uninterrupted run: its directory (holding ``outputs/ref`` and the final weights)."""
    tmp = tmp_path_factory.mktemp("sharded_reference")
    run = launch(tmp, "ref", "ref")
    assert run.returncode == 0, run.tail()
    return tmp, run


def test_sharded_checkpoints_list_every_rank_shard_and_verify(reference: tuple[Path, Launch]) -> None:
    tmp, run = reference
    assert "no checkpoint: starting from step 0" in run.stdout, run.tail()
    for step in (4, 8, 12):
        assert f"committed step_{step:08d}" in run.stdout, run.tail()
    assert "NaN in rank 1's shard detected" in run.stdout, run.tail()  # parameters_finite on DTensors

    store = checkpoint_store(tmp / "outputs" / "ref" / "checkpoints")
    # Retention (default KEEP_LAST_N 2, no ranking metric) deleted step 4, DCP directories and all.
    assert store.complete_steps() == [8, 12]
    assert not (store.root / "step_00000004").exists()
    assert sorted(p.name for p in store.root.iterdir()) == ["step_00000008", "step_00000012"]
    for step in (8, 12):
        path = store.final_path(step)
        manifest = {entry["path"]: entry for entry in read_marker(path)["files"]}
        expected = {f"{d}/{f}" for d in DCP_DIRS for f in DCP_FILES} | {
            "random_states_0.pkl",
            "random_states_1.pkl",
            "rank_00000.json",
            "rank_00001.json",
            "trainer_state.json",
        }
        assert set(manifest) == expected, sorted(manifest)
        for rel in (f"{d}/{f}" for d in DCP_DIRS for f in DCP_FILES):
            assert manifest[rel]["size"] == (path / rel).stat().st_size > 0, rel
        assert store.verify(path, deep=True) is None
    assert (tmp / "ref.final.safetensors").is_file()


def test_kill_mid_shard_write_resumes_from_previous_and_matches_reference(
    reference: tuple[Path, Launch], tmp_path: Path
) -> None:
    ref_dir, _ = reference
    killed = launch(
        tmp_path, "run", "killed", {"SHARDED_WORKER_KILL_AT_STEP": "8", "SHARDED_WORKER_KILL_RANK": "1"}
    )
    assert killed.returncode != 0, killed.tail()
    assert "rank 1: wrote my shard, killing myself mid-checkpoint" in killed.stdout, killed.tail()
    assert "committed step_00000004" in killed.stdout
    assert "committed step_00000008" not in killed.stdout

    store = checkpoint_store(tmp_path / "outputs" / "run" / "checkpoints")
    assert store.complete_steps() == [4]
    assert not store.final_path(8).exists()
    assert store.verify(store.final_path(4), deep=True) is None
    staging = store.staging_path(8)
    if staging.exists():  # what the kill left: rank 1's shard, never DCP's metadata (rank 0's, last)
        model_dir = staging / "pytorch_model_fsdp_0"
        assert (model_dir / "__1_0.distcp").is_file()
        assert not (model_dir / ".metadata").exists()
        assert not (staging / "COMMITTED.json").exists()
    assert not (tmp_path / "run.final.safetensors").exists()

    rerun = launch(tmp_path, "run", "rerun")  # the same command, without the fault
    assert rerun.returncode == 0, rerun.tail()
    assert "resumed from step_00000004 (global step 4)" in rerun.stdout, rerun.tail()
    assert "committed step_00000004" not in rerun.stdout
    assert "committed step_00000008" in rerun.stdout
    assert "committed step_00000012" in rerun.stdout

    final, expected = tmp_path / "run.final.safetensors", ref_dir / "ref.final.safetensors"
    assert final.read_bytes() == expected.read_bytes()
    resumed, uninterrupted = load_file(str(final)), load_file(str(expected))
    assert resumed.keys() == uninterrupted.keys()
    assert len(resumed) == 6  # 3 Linear layers, weight and bias each
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)

    assert not staging.exists()  # the stale staging was removed at start
    # The resume point is protected from retention; every checkpoint left verifies.
    assert store.complete_steps() == [4, 8, 12]
    assert all(store.verify(store.final_path(s), deep=True) is None for s in (4, 8, 12))


def test_corrupt_shard_is_rejected_and_previous_checkpoint_chosen(
    reference: tuple[Path, Launch], tmp_path: Path
) -> None:
    ref_dir, _ = reference
    config = load_config(
        CFG, opts=["ENV.OUTPUT.BASE_DIR", str(tmp_path / "outputs"), "EXPERIMENT.NAME", "run"]
    )
    shutil.copytree(ref_dir / "outputs" / "ref" / "checkpoints", config.output_dir / "checkpoints")
    # find() runs on the main process only and needs nothing else of the Accelerator.
    reader = CheckpointReader(
        SimpleNamespace(is_main_process=True),  # type: ignore[arg-type]
        config.TRAIN,
        config.output_dir,
    )
    newest = reader.store.final_path(12)
    shard = newest / "pytorch_model_fsdp_0" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert reader.store.verify(newest, deep=False) is None  # same size: only the hash sees it

    path, skipped = reader.find(None)

    assert path == reader.store.final_path(8)
    assert len(skipped) == 1, skipped
    assert "step_00000012" in skipped[0]
    assert "pytorch_model_fsdp_0/__1_0.distcp: checksum mismatch" in skipped[0]
    assert "using step_00000008" in skipped[0]
    moved = reader.store.rejected_root / "step_00000012"
    assert (moved / "REJECTED.txt").is_file()
    assert (moved / "pytorch_model_fsdp_0" / "__1_0.distcp").is_file()  # moved aside, not deleted
    assert reader.store.complete_steps() == [8]


def test_fsdp2_on_two_machines_resumes_from_the_bucket(
    reference: tuple[Path, Launch], tmp_path: Path
) -> None:
    ref_dir, _ = reference
    bucket, node0, node1 = tmp_path / "bucket", tmp_path / "node0", tmp_path / "node1"
    bucket.mkdir()
    final = tmp_path / "run.final.safetensors"
    script = [
        str(WORKER),
        "--base-dir",
        "outputs",
        "--name",
        "run",
        "--final",
        str(final),
        "--bucket",
        bucket.as_uri(),
    ]
    kill = {"LINNAEUS_ACCEL_KILL_AT": "bucket_sealed:1", "LINNAEUS_ACCEL_FAULT_RANK": "0"}
    killed = two_nodes((node0, node1), tmp_path, [], node_env=(kill, {}), log_name="killed", script=script)
    assert killed[0][0] != 0, killed[0][1][-3000:]
    remote_step = bucket / "run" / "checkpoints" / "step_00000004"
    manifest = {entry["path"] for entry in read_marker(remote_step)["files"]}
    assert {f"{d}/{f}" for d in DCP_DIRS for f in DCP_FILES} <= manifest, sorted(manifest)
    part1 = {
        entry["path"]
        for entry in read_marker(node1 / "outputs" / "run" / "checkpoints" / "step_00000004")["files"]
    }
    assert "pytorch_model_fsdp_0/__1_0.distcp" in part1
    assert "pytorch_model_fsdp_0/.metadata" not in part1

    shutil.rmtree(node1)  # the second machine's disk is gone
    rerun = two_nodes((node0, node1), tmp_path, [], log_name="rerun", script=script)
    for status, output in rerun:
        assert status == 0, output[-3000:]
    assert "resumed from step_00000004 (global step 4)" in rerun[0][1], rerun[0][1][-3000:]
    assert final.read_bytes() == (ref_dir / "ref.final.safetensors").read_bytes()
