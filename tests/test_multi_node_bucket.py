"""Two machines without a shared filesystem, each with its own disk, meeting in a bucket.

Two real "nodes" on this one machine (``helpers.nodes``): the same relative ``ENV.OUTPUT.BASE_DIR``
is a different directory on each, and ``ENV.OUTPUT.BUCKET.URL`` is where their checkpoints come
together. The run trains to the end (a ``file://`` bucket); against a real S3 endpoint (moto's
server): killed once a checkpoint is whole in the bucket, it resumes from the bucket with a
machine's disk lost, or both, and ends with the weights of the run that was never interrupted;
killed while a machine uploads, it resumes from the checkpoint before.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers.nodes import two_nodes
from helpers.processes import lines_through_our_code
from helpers.s3_server import object_keys, s3_bucket_fixture, s3_client, s3_server_fixture  # noqa: F401

from linnaeus_accel.checkpoint.directory import MARKER

pytestmark = pytest.mark.slow

RUN = Path("outputs") / "run"


def opts(bucket: Path | str) -> list[str]:
    """A ``file://`` bucket at ``bucket`` (a path), or ``bucket`` (a URL)."""
    if isinstance(bucket, Path):
        bucket.mkdir(exist_ok=True)  # a bucket exists before the run: a missing one is refused at start
    url = bucket.as_uri() if isinstance(bucket, Path) else bucket
    # 3 epochs of 3 steps (1,438 samples, 256 per process, 2 processes), a checkpoint after each.
    return [
        "ENV.OUTPUT.BASE_DIR", "outputs", "EXPERIMENT.NAME", "run", "TRAIN.EPOCHS", "3",
        "DATA.BATCH_SIZE", "256", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1", "ENV.OUTPUT.BUCKET.URL", url,
    ]  # fmt: skip


def final_weights(node0: Path) -> dict[str, bytes]:
    final = node0 / RUN / "final"
    return {p.relative_to(final).as_posix(): p.read_bytes() for p in sorted(final.rglob("*")) if p.is_file()}


def complete_in_bucket(bucket: Path) -> list[int]:
    root = bucket / "run" / "checkpoints"
    return sorted(int(d.name.split("_")[1]) for d in root.glob("step_*") if (d / MARKER).is_file())


def run_ok(results: list[tuple[int, str]]) -> str:
    for status, output in results:
        assert status == 0, output[-4000:]
    return results[0][1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The run never interrupted: both machines train to the end; the bucket holds whole
    checkpoints, every machine's files in each; each disk holds only its own machine's."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    bucket, node0, node1 = tmp / "bucket", tmp / "node0", tmp / "node1"
    run_ok(two_nodes((node0, node1), tmp, opts(bucket)))
    summary = json.loads((node0 / RUN / "summary.json").read_text())
    assert (summary["status"], summary["global_step"], summary["remote_sync_errors"]) == ("completed", 9, [])
    assert complete_in_bucket(bucket)[-1] == 9
    marker = json.loads((bucket / "run" / "checkpoints" / "step_00000009" / MARKER).read_text())
    files = {entry["path"] for entry in marker["files"]}
    assert {"rank_00000.json", "rank_00001.json"} <= files, files  # both machines' processes
    assert marker["info"]["nodes"] == 2
    # Machine 1 keeps its own part; the run's outputs are the main machine's.
    part = json.loads((node1 / RUN / "checkpoints" / "step_00000009" / MARKER).read_text())
    assert {entry["path"] for entry in part["files"]} < files
    assert "rank_00001.json" in {entry["path"] for entry in part["files"]}
    assert not [p for p in (node1 / RUN).rglob("*") if p.is_file() and "checkpoints" not in p.parts]
    assert not (node1 / RUN / "final").exists()  # final/ is the main machine's: no empty one here
    return final_weights(node0)


def test_a_machine_that_lost_its_disk_and_then_both_resume_from_the_s3_bucket(
    tmp_path: Path, reference: dict[str, bytes], s3_bucket: str
) -> None:
    node0, node1, url = tmp_path / "node0", tmp_path / "node1", f"s3://{s3_bucket}/runs"
    kill = {"LINNAEUS_ACCEL_KILL_AT": "bucket_sealed:1", "LINNAEUS_ACCEL_FAULT_RANK": "0"}
    results = two_nodes((node0, node1), tmp_path, opts(url), node_env=({**kill}, {}), log_name="killed")
    assert results[0][0] != 0, results[0][1][-3000:]
    # The machine that lost its peer says so in one sentence naming it, not in gloo's traceback.
    survivor = results[1][1]
    assert results[1][0] != 0, survivor[-3000:]
    assert not lines_through_our_code(survivor), survivor[-3000:]  # torchrun's own report aside
    said = [line for line in survivor.splitlines() if "lost machine 0" in line]
    assert len(said) == 1, survivor[-3000:]
    assert "machine 1 of 2 stops too" in said[0], said[0]
    assert markers(s3_bucket, "runs") == [f"runs/run/checkpoints/step_00000003/{MARKER}"]
    client = s3_client()  # the bucket as the killed run left it, for a second rerun below
    for key in object_keys(s3_bucket):
        client.copy_object(
            Bucket=s3_bucket, Key="kept/" + key[len("runs/") :], CopySource=f"{s3_bucket}/{key}"
        )

    shutil.rmtree(node1)  # machine 1's disk is gone
    output = run_ok(two_nodes((node0, node1), tmp_path, opts(url), log_name="lost1"))
    assert re.search(r"resum\w+ .*step 3\b", output), output[-3000:]
    assert final_weights(node0) == reference

    new0, new1 = tmp_path / "new0", tmp_path / "new1"  # a whole new set of machines
    output = run_ok(two_nodes((new0, new1), tmp_path, opts(f"s3://{s3_bucket}/kept"), log_name="new"))
    assert re.search(r"resum\w+ .*step 3\b", output), output[-3000:]
    assert final_weights(new0) == reference


def markers(bucket: str, prefix: str) -> list[str]:
    """The commit markers under ``prefix``, by boto3 (not by the code under test)."""
    return [k for k in object_keys(bucket) if k.startswith(prefix + "/") and k.endswith(MARKER)]


def test_killed_while_a_machine_uploads_to_s3_resumes_from_the_checkpoint_before(
    tmp_path: Path, reference: dict[str, bytes], s3_bucket: str
) -> None:
    """Against a real S3 endpoint (moto's server, reached through the standard AWS variables), with
    ``SCHEDULE.CHECKPOINT.ASYNC``."""
    node0, node1, url = tmp_path / "node0", tmp_path / "node1", f"s3://{s3_bucket}/runs"
    # Machine 1 dies with its files of step 6 in the bucket but not the record that completes them.
    kill = {"LINNAEUS_ACCEL_KILL_AT": "part_uploaded:2", "LINNAEUS_ACCEL_FAULT_RANK": "1"}
    asynchronous = [*opts(url), "SCHEDULE.CHECKPOINT.ASYNC", "true"]  # written from host memory meanwhile
    results = two_nodes((node0, node1), tmp_path, asynchronous, node_env=({}, {**kill}), log_name="killed")
    assert results[1][0] != 0, results[1][1][-3000:]
    assert markers(s3_bucket, "runs") == [f"runs/run/checkpoints/step_00000003/{MARKER}"]
    assert "runs/run/checkpoints/step_00000006/rank_00001.json" in object_keys(s3_bucket)
    output = run_ok(two_nodes((node0, node1), tmp_path, asynchronous, log_name="rerun"))
    assert re.search(r"resum\w+ .*step 3\b", output), output[-3000:]
    assert final_weights(node0) == reference
