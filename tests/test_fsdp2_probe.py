"""The first-batch probe leaves an FSDP2 model sharded (found on a GPU: FSDP2 keeps the root
module's parameters gathered after a forward that no backward follows, so the step listed gathered
tensors and the first clip under Accelerate's FSDP2 failed mixing them with DTensors). torch's own
FSDP2 runs on a one-process gloo group here, in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers.configs import REPO

SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from linnaeus_accel.tasks.classification import ClassificationTask
    from linnaeus_accel.training.start.task_checks import probe_problem

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys_port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 3))
    fully_shard(model[2])
    fully_shard(model)  # the root unit: the first and last Linear
    batch = (torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    problem = probe_problem(ClassificationTask(), model, batch, torch.device("cpu"))
    kinds = [type(p).__name__ for p in model.parameters()]
    print(problem, kinds)
    assert problem is None, problem
    assert all(isinstance(p, DTensor) for p in model.parameters()), kinds
    dist.destroy_process_group()
    """
)


def test_the_probe_leaves_an_fsdp2_model_sharded() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", f"sys_port = '{port}'\n" + SCRIPT],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_the_probe_of_a_compiled_model_compiles_nothing() -> None:
    """The probe's small batch, compiled, would make the training batch a second shape and the
    batch size dynamic in the training graph (slower kernels on a GPU): it runs eagerly."""
    import torch
    from torch import nn

    from linnaeus_accel.tasks.classification import ClassificationTask
    from linnaeus_accel.training.start.task_checks import probe_problem

    graphs: list[object] = []

    def counting_backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(graph)
        return graph.forward

    torch.manual_seed(0)
    compiled = torch.compile(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), backend=counting_backend
    )
    batch = (torch.randn(2, 4), torch.tensor([0, 1]))
    assert probe_problem(ClassificationTask(), compiled, batch, torch.device("cpu")) is None
    assert graphs == []
    compiled(torch.randn(12, 4))  # training compiles its own batch's shape, once
    assert len(graphs) == 1
