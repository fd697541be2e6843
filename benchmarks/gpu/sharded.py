"""Part ``sharded``: FSDP2 and DeepSpeed ZeRO-3 through the shipped accelerate config files.

``accelerate launch --config_file accelerate_configs/<file> --num_processes 1 -m linnaeus_accel
train``: one process still runs the real thing (Accelerate's FSDP2 wrapping or DeepSpeed's engine,
sharded checkpoints through ``save_state``, the gathering of the full weights into ``final/``).
For each file: an uninterrupted run; a run killed with SIGKILL right after its second checkpoint
commits, then resumed by the same command, ending with the uninterrupted run's weights (within bf16
tolerance; whether bitwise is reported); the newest checkpoint's sharded files in its manifest;
``final/`` loaded by ``AutoModelForCausalLM.from_pretrained`` with every tensor; and the refusals
of the ``ema`` callback and of a LoRA adapter, which exit before the first step naming the key.
DeepSpeed's own files (which DeepSpeed unpickles with ``weights_only=False``) must open as data,
and a copy of the checkpoint whose optimizer file is a pickle that runs a command is refused.

Accelerate selects FSDP and DeepSpeed only on accelerators, so on a machine without CUDA the part
is not run; DeepSpeed's cases are not run where the ``deepspeed`` package is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .common import (
    ACCELERATE_CONFIGS,
    CONFIGS,
    Context,
    Done,
    Part,
    compare_weights,
    launch_command,
    not_run,
    run,
    run_env,
    summary,
    tail,
)
from .e2e import KILL_AT, opts

NAME, TITLE = "sharded", "FSDP2 and DeepSpeed ZeRO-3, one process, through the shipped accelerate configs"
CFG = CONFIGS / "lm_tiny.yaml"
# config file -> (Accelerate's distributed type, the sharded model directory in a checkpoint)
BACKENDS = {
    "fsdp2_full_shard.yaml": ("FSDP", "pytorch_model_fsdp_0"),  # torch.distributed.checkpoint files
    "deepspeed_zero3.yaml": ("DEEPSPEED", "pytorch_model"),  # DeepSpeed's own layout
}
REFUSALS = {  # what a sharded run refuses, the override that asks for it, the message
    "ema": (["CALLBACKS", "[{NAME: ema}]"], "ema keeps a whole copy of the weights"),
    "lora": (["MODEL.OPTIONS.lora", "{r: 4}"], "MODEL.OPTIONS.lora: LoRA is not supported under"),
}


def from_pretrained_problems(final: Path) -> dict[str, Any]:
    """What transformers reports loading ``final/``: missing, unexpected, mismatched keys (empty: none)."""
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    return {k: v for k, v in info.items() if v}


def check_backend(part: Part, file: str, done: dict[str, Any], root: Path, steps: int) -> None:
    kind, sharded_dir = BACKENDS[file]
    label = file.removesuffix(".yaml")
    ref: Done = done["ref"]
    ref_dir, kill_dir = root / "ref" / "run", root / "kill" / "run"
    info = summary(ref_dir).get("run_info", {})
    status = summary(ref_dir)
    part.check(
        f"{label}: uninterrupted run completes as {kind}",
        ref.returncode == 0
        and (status.get("status"), status.get("global_step")) == ("completed", steps)
        and (info.get("distributed_type"), info.get("world_size")) == (kind, 1),
        f"exit {ref.returncode}, {status.get('status')} at step {status.get('global_step')}, "
        f"{info.get('distributed_type')} x{info.get('world_size')}, {info.get('mixed_precision')}"
        + ("" if ref.returncode == 0 else f"\n{tail(ref.output, 30)}"),
    )
    checkpoints = sorted((ref_dir / "checkpoints").glob("step_*"))
    if checkpoints:
        manifest = json.loads((checkpoints[-1] / "COMMITTED.json").read_text(encoding="utf-8"))
        listed = {entry["path"] for entry in manifest["files"]}
        shards = {
            p.relative_to(checkpoints[-1]).as_posix()
            for p in (checkpoints[-1] / sharded_dir).rglob("*")
            if p.is_file()
        }
        part.check(
            f"{label}: the checkpoint's sharded files are in its manifest",
            bool(shards) and shards <= listed,
            f"{checkpoints[-1].name}/{sharded_dir}: {len(shards)} files, {len(shards - listed)} not listed",
        )
    else:
        part.check(f"{label}: the checkpoint's sharded files are in its manifest", False, "no checkpoint")
    if (ref_dir / "final" / "config.json").exists():
        try:
            problems = from_pretrained_problems(ref_dir / "final")
        except Exception as exc:  # reported, not raised: the other checks still count
            problems = {"error": f"{type(exc).__name__}: {exc}"}
        part.check(f"{label}: final/ loads with from_pretrained, every tensor", not problems, problems or "")
    else:
        part.check(f"{label}: final/ loads with from_pretrained, every tensor", False, "no final/config.json")
    killed, resumed = done["kill"]
    res = summary(kill_dir)
    # The worker kills itself; the launcher then exits 1 reporting the worker's SIGKILL.
    worker_killed = killed.returncode != 0 and "Signal 9 (SIGKILL)" in killed.output
    part.check(
        f"{label}: killed after a checkpoint, rerun resumes and completes",
        worker_killed
        and resumed.returncode == 0
        and "resumed from" in resumed.output
        and (res.get("status"), res.get("global_step")) == ("completed", steps),
        f"killed: exit {killed.returncode}; rerun: exit {resumed.returncode}, {res.get('status')} at step "
        f"{res.get('global_step')}"
        + ("" if resumed.returncode == 0 else f"\n{tail(resumed.output, 30)}")
        + ("" if worker_killed else f"\n{tail(killed.output, 30)}"),
    )
    same = compare_weights(ref_dir / "final", kill_dir / "final")
    part.check(
        f"{label}: resumed final/ equals uninterrupted (within bf16 tolerance)",
        same["close"],
        f"bitwise {same['bitwise']}, max |diff| {same['max_abs_diff']:.3g}, files {same['files']}",
    )
    for refusal, (_, message) in REFUSALS.items():
        refused: Done = done[refusal]
        wrote = list((root / refusal / "run").glob("checkpoints/step_*"))
        part.check(
            f"{label}: {refusal} refused before the first step",
            refused.returncode != 0 and message in refused.output and not wrote,
            f"exit {refused.returncode}, message {'found' if message in refused.output else 'missing'}"
            + ("" if message in refused.output else f"\n{tail(refused.output, 20)}"),
        )
    if kind == "DEEPSPEED" and checkpoints:
        check_deepspeed_files(part, label, checkpoints[-1], done.get("tampered"))
        # What DeepSpeed's files refer to: a new DeepSpeed version's classes show up here first.
        from linnaeus_accel.checkpoint.state.content import pickled_globals

        names: set[str] = set()
        for file in sorted((checkpoints[-1] / sharded_dir).rglob("*.pt")):
            try:
                names |= pickled_globals(file)
            except Exception as exc:
                names.add(f"(unreadable {file.name}: {exc})")
        part.figures["deepspeed pickled globals"] = sorted(names)
    part.figures[label] = {
        "bitwise_after_resume": same["bitwise"],
        "max_abs_diff": same["max_abs_diff"],
        "seconds": {
            "uninterrupted": round(ref.seconds, 1),
            "killed": round(killed.seconds, 1),
            "resumed": round(resumed.seconds, 1),
        },
    }


class RunsCode:
    """A pickle that runs a shell command when it is loaded (what an attacker writes)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def tamper(ref_run: Path, dest: Path) -> tuple[Path, str, Path]:
    """A copy in ``dest`` of ``ref_run``'s newest checkpoint whose DeepSpeed optimizer file is a
    pickle that runs a command, its manifest rewritten to match (whoever writes the files can write
    the manifest): (the checkpoint, the file's path in it, the file the command would create)."""
    import torch

    from linnaeus_accel.checkpoint.directory import MARKER, file_digest

    newest = sorted((ref_run / "checkpoints").glob("step_*"))[-1]
    checkpoint = dest / newest.name
    shutil.copytree(newest, checkpoint)
    target = next((checkpoint / "pytorch_model").glob("*optim_states.pt"))
    marker = dest / "code-ran"
    torch.save(RunsCode(marker), target)
    manifest = json.loads((checkpoint / MARKER).read_text(encoding="utf-8"))
    for entry in manifest["files"]:
        data = (checkpoint / entry["path"]).read_bytes()
        entry.update(size=len(data), **dict([file_digest(data)]))
    (checkpoint / MARKER).write_text(json.dumps(manifest), encoding="utf-8")
    return checkpoint, target.relative_to(checkpoint).as_posix(), marker


def check_deepspeed_files(part: Part, label: str, checkpoint: Path, tampered: Any) -> None:
    """DeepSpeed unpickles its files with weights_only=False: the resume opens them as data first
    (checkpoint_content), which must pass on DeepSpeed's real files and refuse a planted pickle."""
    from linnaeus_accel.checkpoint.state.content import content_problem

    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    problem = content_problem(checkpoint, state)
    part.check(f"{label}: DeepSpeed's checkpoint files open as data", problem is None, problem or "")
    if tampered is None:
        part.check(f"{label}: a planted pickle is refused, no code run", False, "not run")
        return
    done, name, marker = tampered
    # The worker exits 2 naming the file; the launcher then exits 1 reporting it.
    refused = done.returncode != 0 and f"{name}: not loadable as data" in done.output
    part.check(
        f"{label}: a planted pickle is refused, no code run",
        refused and not marker.exists(),
        f"exit {done.returncode}, code ran: {marker.exists()}"
        + ("" if refused else f"\n{tail(done.output, 20)}"),
    )


def run_part(ctx: Context) -> Part:
    if not ctx.cuda:
        return not_run(NAME, TITLE, "no CUDA: Accelerate selects FSDP and DeepSpeed only on accelerators")
    from .e2e import sizes

    part = Part(NAME, TITLE)
    steps = sizes(ctx)[0]
    env = run_env(ctx.cuda)
    files = list(BACKENDS)
    if importlib.util.find_spec("deepspeed") is None:
        files.remove("deepspeed_zero3.yaml")
        part.not_run.append("deepspeed_zero3: the deepspeed package is not installed")
    jobs: dict[tuple[str, str], Callable[[], Any]] = {}
    for file in files:
        root = ctx.work / NAME / file.removesuffix(".yaml")

        def launch(case: str, extra: list[str], file: str = file, root: Path = root, **fault: str) -> Done:
            command = launch_command(ACCELERATE_CONFIGS / file, 1, CFG, opts(ctx, root / case / "run", extra))
            return run(command, {**env, **fault}, root / f"log_{case}{'_killed' if fault else ''}.txt", 600)

        def killed_then_resumed(launch: Callable[..., Done] = launch) -> tuple[Done, Done]:
            return launch("kill", [], LINNAEUS_ACCEL_KILL_AT=KILL_AT), launch("kill", [])

        jobs[file, "ref"] = lambda launch=launch: launch("ref", [])
        jobs[file, "kill"] = killed_then_resumed
        for refusal, (extra, _) in REFUSALS.items():
            jobs[file, refusal] = lambda launch=launch, refusal=refusal, extra=extra: launch(refusal, extra)
    ctx.say(f"sharded: {', '.join(files)}: {len(jobs)} chains of launches at once")
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        results = {key: future.result() for key, future in futures.items()}
    if "deepspeed_zero3.yaml" in files and (ctx.work / NAME / "deepspeed_zero3" / "ref" / "run").is_dir():
        root = ctx.work / NAME / "deepspeed_zero3"
        checkpoint, name, marker = tamper(root / "ref" / "run", root / "tampered" / "checkpoint")
        ctx.say("sharded: deepspeed_zero3: resuming from a tampered checkpoint")
        command = launch_command(
            ACCELERATE_CONFIGS / "deepspeed_zero3.yaml", 1, CFG, opts(ctx, root / "tampered" / "run", [])
        )
        refused = run([*command, "--resume", str(checkpoint)], env, root / "log_tampered.txt", 300)
        results["deepspeed_zero3.yaml", "tampered"] = (refused, name, marker)
    for file in files:
        done = {case: result for (f, case), result in results.items() if f == file}
        check_backend(part, file, done, ctx.work / NAME / file.removesuffix(".yaml"), steps)
    return part
