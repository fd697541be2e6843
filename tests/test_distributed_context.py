"""``DistributedContext``, the seeds' distributed helpers over Accelerate's state: on one process
in this process, and on 2 gloo processes under ``torchrun`` (this file is also the worker: each
process writes what it saw to a JSON file, which the test reads back).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.processes import launch_env, torchrun_command

from linnaeus_accel import DistributedContext


def observe(out: Path) -> dict[str, Any]:
    """What one process sees through the facade (every process runs the same collectives)."""
    dist = DistributedContext()
    rank = dist.rank
    records = out / f"log_rank{rank}.txt"
    handler = logging.FileHandler(records, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("seeds.user").addHandler(handler)
    try:
        log = dist.get_logger("seeds.user", level="INFO")
        log.info("only the main process says this")
        log.info("every process says this", main_process_only=False)
    finally:
        logging.getLogger("seeds.user").removeHandler(handler)
        handler.close()

    @dist.master_only
    def write_report(name: str) -> str:
        (out / name).write_text(f"written by rank {dist.rank}", encoding="utf-8")
        return "written"

    try:
        dist.initialize(world_size=dist.world_size + 1)
        wrong_world = "accepted"
    except ValueError as exc:
        wrong_world = str(exc)
    gathered = dist.all_gather(torch.tensor([10.0 * rank, 1.0]))
    return {
        "initialize": repr(
            dist.initialize(is_distributed=dist.world_size > 1, world_size=dist.world_size, rank=rank)
        ),
        "wrong_world": wrong_world,
        "rank": rank,
        "world_size": dist.world_size,
        "is_master": dist.is_master,
        "is_local_master": dist.is_local_master,
        "is_distributed": dist.is_distributed,
        "master_only": write_report("report.txt"),
        "all_gather": [t.tolist() for t in gathered],
        "all_gather_object": dist.all_gather_object({"rank": rank}),
        "mean": dist.reduce(torch.tensor(rank + 1.0)).item(),
        "sum": dist.reduce(torch.tensor([rank + 1]), op="sum").tolist(),
        "max": dist.reduce(torch.tensor(rank + 1.0), op="max").item(),
        "broadcast": dist.broadcast(
            torch.tensor([rank + 5.0]), from_rank=1 if dist.is_distributed else 0
        ).tolist(),
        "broadcast_object": dist.broadcast_object(f"from rank {rank}"),
        "log": records.read_text(encoding="utf-8").splitlines(),
    }


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_one_process_is_its_own_master(tmp_path: Path) -> None:
    seen = observe(tmp_path)
    assert seen["rank"] == 0
    assert seen["world_size"] == 1
    assert seen["is_master"]
    assert seen["is_local_master"]
    assert not seen["is_distributed"]
    assert seen["master_only"] == "written"
    assert (tmp_path / "report.txt").read_text(encoding="utf-8") == "written by rank 0"
    assert seen["all_gather"] == [[0.0, 1.0]]
    assert seen["all_gather_object"] == [{"rank": 0}]
    assert (seen["mean"], seen["sum"], seen["max"]) == (1.0, [1], 1.0)
    assert seen["broadcast"] == [5.0]
    assert "world_size=2 (Accelerate: 1)" in seen["wrong_world"]
    assert seen["log"] == ["[RANK 0] only the main process says this", "[RANK 0] every process says this"]
    with pytest.raises(TypeError, match="op='sum'"):
        DistributedContext().reduce(torch.tensor([1, 2]))  # an integer mean would be truncated


@pytest.mark.slow
def test_two_gloo_processes(tmp_path: Path) -> None:
    env = launch_env(tmp_path)
    command = [*torchrun_command(2), __file__, str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in (0, 1)]
    for rank, s in enumerate(seen):
        assert (s["rank"], s["world_size"], s["is_distributed"]) == (rank, 2, True)
        assert s["is_master"] is (rank == 0)
        assert s["is_local_master"] is (rank == 0)
        assert s["initialize"].startswith(f"DistributedContext(rank={rank}, world_size=2, device=cpu")
        assert "world_size=3 (Accelerate: 2)" in s["wrong_world"]
        # Every process holds every process's values, in rank order.
        assert s["all_gather"] == [[0.0, 1.0], [10.0, 1.0]]
        assert s["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert (s["mean"], s["sum"], s["max"]) == (1.5, [3], 2.0)
        assert s["broadcast"] == [6.0]
        assert s["broadcast_object"] == "from rank 0"
    assert [s["master_only"] for s in seen] == ["written", None]
    assert (tmp_path / "report.txt").read_text(encoding="utf-8") == "written by rank 0"
    # Main-process-only records are written once; records asked of every process carry their rank.
    assert seen[0]["log"] == ["[RANK 0] only the main process says this", "[RANK 0] every process says this"]
    assert seen[1]["log"] == ["[RANK 1] every process says this"]


if __name__ == "__main__":  # a torchrun worker of test_two_gloo_processes
    target = Path(sys.argv[1])
    result = observe(target)
    (target / f"rank{result['rank']}.json").write_text(json.dumps(result), encoding="utf-8")
    DistributedContext().barrier()
    torch.distributed.destroy_process_group()
