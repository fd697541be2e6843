"""The Accelerate config files shipped in ``accelerate_configs/``.

Accelerate selects FSDP and DeepSpeed only on accelerators, so these files are checked here by
parsing and by Accelerate's launch processing; the end-to-end runs need GPUs.

For every file in the directory (a file without a row in ``EXPECTED`` fails) the tests:

- load it with Accelerate's own loader (``load_config_from_file``) and check the distributed type,
  process and machine counts, precision and the plugin blocks;
- run ``accelerate launch``'s argument processing on it without launching anything: the parser,
  ``_validate_launch_command``, the same launcher choice as ``launch_command``, then
  ``prepare_simple_launcher_cmd_env`` / ``prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env``
  for the environment the workers would get, and the torchrun arguments built from it;
- build the plugins the workers would build from that environment: ``FullyShardedDataParallelPlugin``,
  ``ParallelismConfig`` and ``DeepSpeedPlugin`` (inside ``mock.patch.dict(os.environ, env)``).
  DeepSpeedPlugin's constructor does not import the deepspeed package (not installed here), so its
  resulting ``deepspeed_config`` is checked; what needs deepspeed itself (the engine, the bf16
  section Accelerate adds at ``prepare``) is left to the GPU runs.

Files with ``num_processes: -1`` are launched with ``--num_processes GPUS`` as a user would
(``--num_processes "$(nvidia-smi -L | wc -l)"``): with a config file Accelerate does not count the
GPUs itself, it stops and asks for ``--num_processes`` (also checked here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
import torch.distributed.run as torchrun
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import (
    _filter_args,
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)
from helpers.configs import REPO

from linnaeus_accel.config import load_config
from linnaeus_accel.training.start.backends import backend_problems

CONFIG_DIR = REPO / "accelerate_configs"
CONFIG_FILES = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
ACCELERATE_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
GPUS = 8  # what `nvidia-smi -L | wc -l` answers on the user's (simulated) machine

FSDP2_FULL_SHARD_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
}

# bf16 on every GPU of one machine: the process count is not in the file, torchrun gets
# --nproc_per_node GPUS.
ALL_GPUS_BF16: dict[str, Any] = {
    "num_processes": -1,
    "mixed_precision": "bf16",
    "world_size": GPUS,
    "nproc_per_node": GPUS,
}
# bf16 on 2 machines x 8 GPUs: num_processes is the total, torchrun runs 16 // 2 per machine, node
# rank 0 here, rendezvous at machine 0's address.
TWO_MACHINES_BF16: dict[str, Any] = {
    "num_processes": 16,
    "mixed_precision": "bf16",
    "world_size": 16,
    "num_machines": 2,
    "nproc_per_node": 8,
    "node_rank": 0,
    "rdzv_endpoint": "10.0.0.1:29500",
}
# The DeepSpeed files: one machine, no offload; clipping and accumulation left to us.
DEEPSPEED_ONE_MACHINE: dict[str, Any] = {
    "distributed_type": DistributedType.DEEPSPEED,
    "launcher": "deepspeed",
    **ALL_GPUS_BF16,
}
DEEPSPEED_ENV = {
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
}
DEEPSPEED_ABSENT_ENV = (
    "ACCELERATE_GRADIENT_CLIPPING",  # "auto": the trainer fills in TRAIN.CLIP_GRAD
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_USE_FSDP",
)


@dataclass(frozen=True)
class Expect:
    distributed_type: DistributedType
    launcher: str  # "simple" | "multi_gpu" | "deepspeed": what launch_command would call
    num_processes: int  # in the file; -1: must be given with --num_processes
    mixed_precision: str
    world_size: int  # processes over all machines once launched
    num_machines: int = 1
    nproc_per_node: int | None = None  # torchrun's, for the torchrun launchers
    node_rank: int | None = None  # torchrun's, multi-machine files only
    rdzv_endpoint: str | None = None  # torchrun's, multi-machine files only
    env: dict[str, str] = field(default_factory=dict)  # subset of the workers' environment
    absent_env: tuple[str, ...] = ()  # must not be in the workers' environment
    fsdp2: bool = False  # build FullyShardedDataParallelPlugin from env and check FSDP2 full shard
    hsdp: tuple[int, int] | None = None  # (dp_replicate_size, dp_shard_size) from ParallelismConfig
    zero_stage: int | None = None  # build DeepSpeedPlugin from env and check this stage


EXPECTED: dict[str, Expect] = {
    # One process, no wrapper, fp32; the simple launcher (no torchrun), not on the CPU.
    "single_gpu.yaml": Expect(
        distributed_type=DistributedType.NO,
        launcher="simple",
        num_processes=1,
        mixed_precision="no",
        world_size=1,
        env={"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False"},
        absent_env=("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"),
    ),
    # DDP on one machine; process count not in the file, torchrun gets --nproc_per_node GPUS; bf16.
    "multi_gpu.yaml": Expect(
        distributed_type=DistributedType.MULTI_GPU,
        launcher="multi_gpu",
        **ALL_GPUS_BF16,
        env={"ACCELERATE_MIXED_PRECISION": "bf16"},
        absent_env=("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_PARALLELISM_CONFIG"),
    ),
    # Two gloo processes through torchrun (ACCELERATE_USE_CPU comes from the caller's environment).
    "cpu_2_processes.yaml": Expect(
        distributed_type=DistributedType.MULTI_GPU,
        launcher="multi_gpu",
        num_processes=2,
        mixed_precision="no",
        world_size=2,
        nproc_per_node=2,
        env={"ACCELERATE_MIXED_PRECISION": "no"},
        absent_env=("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"),
    ),
    # FSDP2 full shard with transformer-block wrapping and sharded checkpoints on one machine, bf16.
    "fsdp2_full_shard.yaml": Expect(
        distributed_type=DistributedType.FSDP,
        launcher="multi_gpu",
        **ALL_GPUS_BF16,
        env={"ACCELERATE_MIXED_PRECISION": "bf16", **FSDP2_FULL_SHARD_ENV},
        absent_env=("ACCELERATE_USE_PARALLELISM_CONFIG", "FSDP_TRANSFORMER_CLS_TO_WRAP"),
        fsdp2=True,
    ),
    # FSDP2 HSDP over 2 machines x 8 GPUs: a (2 replicas) x (8 shards) mesh from parallelism_config;
    # torchrun runs 8 per machine, node rank 0 here, rendezvous at machine 0's address.
    "fsdp2_hybrid_shard_multinode.yaml": Expect(
        distributed_type=DistributedType.FSDP,
        launcher="multi_gpu",
        **TWO_MACHINES_BF16,
        env={
            "ACCELERATE_MIXED_PRECISION": "bf16",
            **FSDP2_FULL_SHARD_ENV,
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8",
            "PARALLELISM_CONFIG_TP_SIZE": "1",
            "PARALLELISM_CONFIG_CP_SIZE": "1",
        },
        absent_env=("FSDP_TRANSFORMER_CLS_TO_WRAP",),
        fsdp2=True,
        hsdp=(2, 8),
    ),
    # DeepSpeed ZeRO-2 on one machine, bf16, no offload, clipping and accumulation left to us.
    "deepspeed_zero2.yaml": Expect(
        **DEEPSPEED_ONE_MACHINE,
        env={**DEEPSPEED_ENV, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
        absent_env=DEEPSPEED_ABSENT_ENV,
        zero_stage=2,
    ),
    # DeepSpeed ZeRO-3: as ZeRO-2 plus zero.Init and the 16-bit gather that save_model needs.
    "deepspeed_zero3.yaml": Expect(
        **DEEPSPEED_ONE_MACHINE,
        env={
            **DEEPSPEED_ENV,
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
            "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
            "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
        },
        absent_env=DEEPSPEED_ABSENT_ENV,
        zero_stage=3,
    ),
    # DDP over 2 machines x 8 GPUs: num_processes is the total, torchrun runs 16 // 2 per machine.
    "multi_node_ddp.yaml": Expect(
        distributed_type=DistributedType.MULTI_GPU,
        launcher="multi_gpu",
        **TWO_MACHINES_BF16,
        env={"ACCELERATE_MIXED_PRECISION": "bf16"},
        absent_env=("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_PARALLELISM_CONFIG"),
    ),
}


def _launch_args(name: str, *extra: str):
    """``accelerate launch --config_file FILE [EXTRA] -m linnaeus_accel train --cfg FILE`` parsed."""
    argv = [
        "--config_file",
        str(CONFIG_DIR / name),
        *extra,
        "-m",
        "linnaeus_accel",
        "train",
        "--cfg",
        "c.yaml",
    ]
    return launch_command_parser().parse_args(argv)


def _process(name: str):
    """Accelerate's launch processing without the launch: (args, launcher, workers' env)."""
    exp = EXPECTED[name]
    extra = ("--num_processes", str(GPUS)) if exp.num_processes == -1 else ()
    args, defaults, mp_from_config = _validate_launch_command(_launch_args(name, *extra))
    # Neither a port in use nor Accelerate variables of the caller's shell may change the answer.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ACCELERATE_PREFIXES)}
    with (
        mock.patch.dict(os.environ, clean, clear=True),
        mock.patch("accelerate.utils.launch.is_port_in_use", return_value=False),
    ):
        # The launcher choice of accelerate.commands.launch.launch_command.
        if args.use_deepspeed and not args.cpu:
            fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            cmd, env = prepare_deepspeed_cmd_env(args)
            assert cmd is None  # one machine: torchrun, not the deepspeed runner
            return args, "deepspeed", env
        if (args.use_fsdp or args.multi_gpu) and not args.cpu:
            return args, "multi_gpu", prepare_multi_gpu_env(args)
        _, env = prepare_simple_launcher_cmd_env(args)
        return args, "simple", env


def _torchrun_args(args):
    """The arguments multi_gpu_launcher / deepspeed_launcher hand to torch.distributed.run."""
    return _filter_args(
        args,
        torchrun.get_args_parser(),
        ["--training_script", args.training_script, "--training_script_args", args.training_script_args],
    )


def test_every_expectation_has_a_file():
    assert sorted(EXPECTED) == CONFIG_FILES


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_loaded_by_accelerate(name):
    assert name in EXPECTED, f"accelerate_configs/{name} has no row in EXPECTED"
    exp = EXPECTED[name]
    cfg = load_config_from_file(str(CONFIG_DIR / name))
    assert isinstance(cfg, ClusterConfig)
    assert cfg.distributed_type == exp.distributed_type
    assert cfg.num_processes == exp.num_processes
    assert cfg.num_machines == exp.num_machines
    assert cfg.mixed_precision == exp.mixed_precision
    assert cfg.machine_rank == 0
    if exp.num_machines > 1:
        assert cfg.main_process_ip
        assert cfg.main_process_port
    if exp.fsdp2:
        fsdp = cfg.fsdp_config
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_reshard_after_forward"] is True
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # left to the model's _no_split_modules
        assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert "fsdp_sharding_strategy" not in fsdp  # FSDP1's; FSDP2 uses reshard_after_forward
    else:
        assert cfg.fsdp_config == {}
    if exp.hsdp:
        replicate, shard = exp.hsdp
        assert cfg.parallelism_config == {
            "parallelism_config_dp_replicate_size": replicate,
            "parallelism_config_dp_shard_size": shard,
        }
        assert replicate * shard == cfg.num_processes
        assert replicate == cfg.num_machines
    else:
        assert cfg.parallelism_config == {}
    if exp.zero_stage:
        ds = cfg.deepspeed_config
        assert ds["zero_stage"] == exp.zero_stage
        assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"
        assert ds["zero3_init_flag"] is (exp.zero_stage == 3)
        assert ds.get("zero3_save_16bit_model", False) is (exp.zero_stage == 3)
        # Our schedule and optimizer, our accumulation: no DeepSpeed JSON, no accumulation here.
        assert "deepspeed_config_file" not in ds
        assert "gradient_accumulation_steps" not in ds
    else:
        assert cfg.deepspeed_config == {}


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_launch_processing(name):
    exp = EXPECTED[name]
    args, launcher, env = _process(name)
    assert launcher == exp.launcher
    assert args.num_machines == exp.num_machines
    assert args.num_processes == exp.world_size
    assert args.mixed_precision == exp.mixed_precision
    for key, value in exp.env.items():
        assert env.get(key) == value, key
    for key in exp.absent_env:
        assert key not in env, key
    if launcher == "simple":
        return
    run = _torchrun_args(args)
    assert run.module is True
    assert run.training_script == "linnaeus_accel"
    assert run.training_script_args == ["train", "--cfg", "c.yaml"]
    assert run.nproc_per_node == str(exp.nproc_per_node)
    assert int(run.nproc_per_node) * exp.num_machines == exp.world_size
    if exp.num_machines > 1:
        assert run.nnodes == str(exp.num_machines)
        assert run.node_rank == exp.node_rank
        assert run.rdzv_backend == "static"
        assert run.rdzv_endpoint == exp.rdzv_endpoint


@pytest.mark.parametrize(
    "name", [n for n in CONFIG_FILES if EXPECTED.get(n) and EXPECTED[n].num_processes == -1]
)
def test_process_count_must_be_given(name):
    """No hard-coded count: without --num_processes Accelerate refuses, with it the count is used."""
    with pytest.raises(ValueError, match="manually pass in `--num_processes`"):
        _validate_launch_command(_launch_args(name))
    args, _, _ = _validate_launch_command(_launch_args(name, "--num_processes", "3"))
    assert args.num_processes == 3


@pytest.mark.parametrize("name", [n for n in CONFIG_FILES if EXPECTED.get(n) and EXPECTED[n].fsdp2])
def test_fsdp2_plugin_from_worker_env(name):
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    exp = EXPECTED[name]
    _, _, env = _process(name)
    with mock.patch.dict(os.environ, env, clear=True):
        plugin = FullyShardedDataParallelPlugin()
        parallelism = ParallelismConfig() if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true" else None
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.transformer_cls_names_to_wrap is None  # -> the model's _no_split_modules
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.cpu_ram_efficient_loading is True
    assert type(plugin.cpu_offload).__name__ == "OffloadPolicy"  # FSDP2's "no offload"
    if exp.hsdp:
        replicate, shard = exp.hsdp
        assert parallelism is not None
        assert (parallelism.dp_replicate_size, parallelism.dp_shard_size) == (replicate, shard)
        assert parallelism.dp_replicate_enabled
        assert parallelism.dp_shard_enabled
        assert parallelism.total_size == exp.world_size  # Accelerator checks this at start
        assert parallelism.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]  # the 2-D mesh fully_shard gets
    else:
        assert parallelism is None  # full shard over the whole world


@pytest.mark.parametrize("name", [n for n in CONFIG_FILES if EXPECTED.get(n) and EXPECTED[n].zero_stage])
def test_deepspeed_plugin_from_worker_env(name):
    """DeepSpeedPlugin built from the workers' env (its constructor does not need deepspeed)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    exp = EXPECTED[name]
    _, _, env = _process(name)
    try:
        with mock.patch.dict(os.environ, env, clear=True):
            plugin = DeepSpeedPlugin()
        config = plugin.deepspeed_config
        assert config["zero_optimization"]["stage"] == exp.zero_stage
        assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"
        assert config["zero_optimization"]["offload_param"]["device"] == "none"
        gather = config["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save", False)
        assert gather is (exp.zero_stage == 3)  # what accelerator.save_model needs under ZeRO-3
        assert plugin.zero3_init_flag is (exp.zero_stage == 3)
        # Filled from the Accelerator at prepare (our TRAIN.ACCUMULATION_STEPS), not from the file.
        assert config["gradient_accumulation_steps"] == "auto"
        assert config["gradient_clipping"] == "auto"  # the trainer puts TRAIN.CLIP_GRAD there
        # The LR comes from our schedule on our torch optimizer.
        assert "optimizer" not in config
        assert "scheduler" not in config
        # And the trainer's start-up check accepts it with the default config.
        default = load_config(CONFIG_DIR.parent / "configs" / "default.yaml")
        sections = (default.DATA, default.LOSS, default.TRAIN, default.SCHEDULE)
        assert backend_problems(DistributedType.DEEPSPEED, config, *sections) == []
    finally:
        unset_hf_deepspeed_config()  # ZeRO-3's zero.Init hook must not leak into other tests
