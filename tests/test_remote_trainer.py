"""The Trainer with bucket sync: B2 through b2sdk's RawSimulator, and ENV.OUTPUT.BUCKET.URL s3://
against moto's S3 server on localhost. Checkpoints reach the bucket in the background, remote
retention follows local retention, and a fresh machine with an empty output directory resumes from
the bucket. Credentials never reach any file of the run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from b2sdk.v2 import B2Api, B2HttpApiConfig, InMemoryAccountInfo, RawSimulator
from helpers.checkpoints import RunsCode, reseal
from helpers.configs import DEFAULT_CONFIG
from helpers.s3_server import SECRET_KEY, object_keys, s3_bucket_fixture, s3_server_fixture  # noqa: F401

from linnaeus_accel.checkpoint.bucket.remote import KEY_ID_VAR, KEY_VAR, RemoteCheckpoints, RetryPolicy
from linnaeus_accel.checkpoint.resume.find import ResumeRefused
from linnaeus_accel.cli import EXIT_NOT_SYNCED, exit_status
from linnaeus_accel.config import load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model
from linnaeus_accel.training.trainer import Trainer

BUCKET = "runs"


@pytest.fixture
def bucket_api(monkeypatch: pytest.MonkeyPatch) -> tuple[B2Api, str, str]:
    api = B2Api(InMemoryAccountInfo(), api_config=B2HttpApiConfig(_raw_api_class=RawSimulator))
    sim = api.session.raw_api
    account_id, master_key = sim.create_account()
    api.authorize_account("production", account_id, master_key)
    api.create_bucket(BUCKET, "allPrivate")
    key = api.create_key(["listBuckets", "listFiles", "readFiles", "writeFiles", "deleteFiles"], "linnaeus")
    monkeypatch.setenv(KEY_ID_VAR, key.id_)
    monkeypatch.setenv(KEY_VAR, key.application_key)
    return api, key.id_, key.application_key


def _remote(api: B2Api) -> RemoteCheckpoints:
    fresh = B2Api(InMemoryAccountInfo(), api_config=B2HttpApiConfig(_raw_api_class=RawSimulator))
    fresh.session.raw_api = api.session.raw_api  # the same simulated bucket, a new client
    return RemoteCheckpoints.from_environment(
        BUCKET, "team", "digits_default", api=fresh, retry=RetryPolicy(2, 0.0, 0.0)
    )


def _train(
    base: Path, api: B2Api | None, remote: RemoteCheckpoints | None = None, opts: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Three epochs of the default run, a checkpoint each, the last one kept; ``api``: the B2
    simulator to sync with, or None for the bucket ``opts`` name."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = load_config(
        DEFAULT_CONFIG,
        [
            *opts,
            "ENV.OUTPUT.BASE_DIR",
            str(base),
            "TRAIN.EPOCHS",
            "3",
            "DATA.BATCH_SIZE",
            "128",
            "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS",
            "1",
            "SCHEDULE.CHECKPOINT.KEEP_LAST_N",
            "1",
            "SCHEDULE.CHECKPOINT.KEEP_TOP_N",
            "0",
        ],
    )
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    torch.manual_seed(0)
    remote = remote or (_remote(api) if api is not None else None)
    return Trainer(config, build_model(config, train), train, val, remote=remote).fit()


@pytest.mark.slow
def test_checkpoints_reach_the_bucket_and_a_fresh_machine_resumes_from_it(
    tmp_path: Path, bucket_api: Any
) -> None:
    api, key_id, key = bucket_api
    first = _train(tmp_path / "machine_a", api)
    assert first["status"] == "completed"
    assert first["remote_sync_errors"] == []
    run_a = tmp_path / "machine_a" / "digits_default"
    local_steps = sorted(p.name for p in (run_a / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert local_steps == ["step_00000036"]  # KEEP_LAST_N 1: only the last of 12, 24, 36 is kept
    assert _remote(api).complete_steps() == [36]  # remote retention followed
    # A fresh machine: empty output directory, same experiment, same bucket.
    second = _train(tmp_path / "machine_b", api)
    run_b = tmp_path / "machine_b" / "digits_default"
    assert second["global_step"] == first["global_step"] == 36
    assert (run_b / "checkpoints" / "step_00000036" / "COMMITTED.json").exists()  # downloaded
    assert (run_b / "final" / "model.safetensors").read_bytes() == (
        run_a / "final" / "model.safetensors"
    ).read_bytes()
    for path in [*run_a.rglob("*"), *run_b.rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            assert key.encode() not in data, path
            assert key_id.encode() not in data, path


@pytest.mark.slow
def test_a_run_whose_checkpoints_never_reach_the_bucket_does_not_end_looking_clean(
    tmp_path: Path, bucket_api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key that may not write (b2sdk's simulator refuses every upload): training completes, and
    summary.json lists the failed uploads; the command line exits 3 for it (cli.exit_status)."""
    api, _, _ = bucket_api
    read_only = api.create_key(["listBuckets", "listFiles", "readFiles"], "read-only")
    monkeypatch.setenv(KEY_ID_VAR, read_only.id_)
    monkeypatch.setenv(KEY_VAR, read_only.application_key)
    summary = _train(tmp_path, api)
    assert summary["status"] == "completed"
    assert summary["remote_sync_errors"], summary
    on_disk = json.loads((tmp_path / "digits_default" / "summary.json").read_text(encoding="utf-8"))
    assert on_disk["remote_sync_errors"] == summary["remote_sync_errors"]
    assert exit_status(summary) == EXIT_NOT_SYNCED == 3
    assert exit_status({**summary, "remote_sync_errors": []}) == 0


@pytest.mark.slow
def test_a_checkpoint_planted_in_the_bucket_runs_no_code_and_is_not_resumed(
    tmp_path: Path, bucket_api: Any
) -> None:
    """A writer of the bucket replaces a checkpoint's optimizer.bin with a pickle that runs a
    command, and rewrites its manifest to match: a fresh machine downloads it, finds the file is no
    data, keeps it in rejected/ and refuses to start over; the command never runs."""

    api, _, _ = bucket_api
    assert _train(tmp_path / "machine_a", api)["status"] == "completed"
    planted = tmp_path / "planted" / "step_00000036"
    shutil.copytree(tmp_path / "machine_a" / "digits_default" / "checkpoints" / "step_00000036", planted)
    marker = tmp_path / "code-ran"
    torch.save(RunsCode(marker), planted / "optimizer.bin")
    reseal(planted)
    _remote(api).upload(planted)
    with pytest.raises(ResumeRefused, match=r"optimizer.bin: not loadable as data"):
        _train(tmp_path / "machine_b", api)
    assert not marker.exists()
    assert (tmp_path / "machine_b" / "digits_default" / "checkpoints" / "rejected" / "step_00000036").is_dir()


@pytest.mark.slow
def test_a_run_syncs_to_an_s3_url_and_a_fresh_machine_resumes_from_it(tmp_path: Path, s3_bucket: str) -> None:
    """ENV.OUTPUT.BUCKET.URL alone turns the bucket on; the endpoint and keys come from the AWS
    variables (helpers.s3_server), as they would for R2 or MinIO."""
    url = ("ENV.OUTPUT.BUCKET.URL", f"s3://{s3_bucket}/team")
    first = _train(tmp_path / "machine_a", None, opts=url)
    assert first["status"] == "completed"
    assert first["remote_sync_errors"] == []
    run_a = tmp_path / "machine_a" / "digits_default"
    local = run_a / "checkpoints" / "step_00000036"
    # Remote retention followed local retention (KEEP_LAST_N 1): only step 36, every file of it.
    assert object_keys(s3_bucket) == sorted(
        f"team/digits_default/checkpoints/step_00000036/{p.relative_to(local).as_posix()}"
        for p in local.rglob("*")
        if p.is_file()
    )
    second = _train(tmp_path / "machine_b", None, opts=url)  # empty output directory, same bucket
    run_b = tmp_path / "machine_b" / "digits_default"
    assert second["status"] == "completed"
    assert second["global_step"] == first["global_step"] == 36
    assert (run_b / "checkpoints" / "step_00000036" / "COMMITTED.json").exists()  # downloaded
    assert (run_b / "final" / "model.safetensors").read_bytes() == (
        run_a / "final" / "model.safetensors"
    ).read_bytes()
    for path in [*run_a.rglob("*"), *run_b.rglob("*")]:
        if path.is_file():
            assert SECRET_KEY.encode() not in path.read_bytes(), path
