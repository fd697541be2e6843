"""Part ``e2e``: one GPU end to end, as a user runs it.

``configs/lm_tiny.yaml`` (a 0.9M-parameter Llama built from its config, byte-level text that ships
with Python) trains in bf16 (``ACCELERATE_MIXED_PRECISION=bf16``) with ``ENV.DETERMINISTIC: true``,
checkpointing mid-epoch every ``EVERY`` steps. For each variant, one run goes uninterrupted; another
is killed with SIGKILL right after its second checkpoint commits (``LINNAEUS_ACCEL_KILL_AT``) and
the same command is run again, which resumes it. The resumed run must end completed at the same
step with every tensor of ``final/`` (the model, ``ema/``, a LoRA adapter) bitwise equal to the
uninterrupted run's. Variants: plain, ``SCHEDULE.CHECKPOINT.ASYNC`` (the state copied to pinned
host memory, written in the background), the ``ema`` callback, and a LoRA adapter.

One more pair runs the plain variant without ``ENV.DETERMINISTIC``: GPU kernels such as the
embedding's backward add in a varying order, so that pair is held to bf16 tolerance, and whether it
came out bitwise anyway is reported. Every run of a part runs at once (the GPU has room for them).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .common import (
    CONFIGS,
    Context,
    Done,
    Part,
    compare_weights,
    metrics,
    run,
    run_env,
    summary,
    tail,
    train_command,
)

NAME, TITLE = "e2e", "single GPU end to end: bf16, kill -9 after a checkpoint, resume, same weights"
CFG = CONFIGS / "lm_tiny.yaml"
VARIANTS: dict[str, list[str]] = {
    "plain": [],
    "async": ["SCHEDULE.CHECKPOINT.ASYNC", "true"],
    "ema": ["CALLBACKS", "[{NAME: ema, OPTIONS: {decay: 0.9}}]"],
    "lora": ["MODEL.OPTIONS.lora", "{r: 4, alpha: 8}"],
}
NONDETERMINISTIC = "plain, ENV.DETERMINISTIC false"
KILL_AT = "checkpoint_committed:2"  # right after the second checkpoint is committed


def sizes(ctx: Context) -> tuple[int, int, list[str]]:
    """(optimizer steps, checkpoint interval, model and batch overrides)."""
    if ctx.full:
        return 60, 20, ["DATA.BATCH_SIZE", "16"]
    tiny = [
        *("DATA.BATCH_SIZE", "4", "MODEL.OPTIONS.hidden_size", "32", "MODEL.OPTIONS.intermediate_size", "64"),
        *("MODEL.OPTIONS.num_hidden_layers", "2", "MODEL.OPTIONS.num_attention_heads", "2"),
    ]
    return 12, 4, tiny


def opts(ctx: Context, out: Path, extra: list[str], deterministic: bool = True) -> list[str]:
    steps, every, model = sizes(ctx)
    batch = int(model[model.index("DATA.BATCH_SIZE") + 1])
    return [
        *("ENV.OUTPUT.BASE_DIR", str(out.parent), "EXPERIMENT.NAME", out.name),
        *("ENV.DETERMINISTIC", str(deterministic).lower(), "ENV.PROGRESS_BAR", "false"),
        *model,
        "TRAIN.TARGET_TOKENS", str(steps * batch * 128),  # seq_len 129: 128 targets a sample
        *("SCHEDULE.CHECKPOINT.INTERVAL_STEPS", str(every), "SCHEDULE.CHECKPOINT.MID_EPOCH", "true"),
        *("SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2"),
        *("SCHEDULE.METRICS.STEP_INTERVAL", "5"),
        *extra,
    ]  # fmt: skip


def check_pair(part: Part, label: str, ref: Done, killed: Done, resumed: Done, dirs: dict[str, Path],
               steps: int, exact: bool, ctx: Context) -> None:  # fmt: skip
    ref_summary, res_summary = summary(dirs["ref"]), summary(dirs["kill"])
    part.check(
        f"{label}: uninterrupted run completes",
        ref.returncode == 0
        and (ref_summary.get("status"), ref_summary.get("global_step")) == ("completed", steps),
        f"exit {ref.returncode}, {ref_summary.get('status')} at step {ref_summary.get('global_step')}"
        + ("" if ref.returncode == 0 else f"\n{tail(ref.output)}"),
    )
    info = ref_summary.get("run_info", {})
    want_device, want_precision = ("cuda", "bf16") if ctx.cuda else ("cpu", "bf16" if ctx.full else "no")
    part.check(
        f"{label}: trained in {want_precision} on {want_device}",
        info.get("mixed_precision") == want_precision and info.get("device") == want_device,
        f"mixed_precision {info.get('mixed_precision')}, device {info.get('device')}",
    )
    checkpoints = sorted((dirs["kill"] / "checkpoints").glob("step_*"))
    part.check(
        f"{label}: killed by SIGKILL after a checkpoint",
        killed.killed and bool(checkpoints),
        f"exit {killed.returncode}, checkpoints {[c.name for c in checkpoints]}"
        + ("" if killed.killed else f"\n{tail(killed.output)}"),
    )
    part.check(
        f"{label}: rerun resumes and completes",
        resumed.returncode == 0
        and "resumed from" in resumed.output
        and (res_summary.get("status"), res_summary.get("global_step")) == ("completed", steps),
        f"exit {resumed.returncode}, {res_summary.get('status')} at step {res_summary.get('global_step')}"
        + ("" if resumed.returncode == 0 else f"\n{tail(resumed.output)}"),
    )
    same = compare_weights(dirs["ref"] / "final", dirs["kill"] / "final")
    wanted = "bitwise" if exact else "within bf16 tolerance"
    part.check(
        f"{label}: resumed final/ equals uninterrupted ({wanted})",
        same["same_files"] and (same["bitwise"] if exact else same["close"]),
        f"files {same['files']}, bitwise {same['bitwise']}, max |diff| {same['max_abs_diff']:.3g}",
    )
    part.figures[label] = {
        "bitwise": same["bitwise"],
        "max_abs_diff": same["max_abs_diff"],
        "seconds": {
            "uninterrupted": round(ref.seconds, 1),
            "killed": round(killed.seconds, 1),
            "resumed": round(resumed.seconds, 1),
        },
        "tokens_per_s": _last(dirs["ref"], "perf/tokens_per_s"),
    }


def _last(run_dir: Path, key: str) -> float | None:
    values = [r[key] for r in metrics(run_dir) if key in r]
    return values[-1] if values else None


# At tiny size (the CPU, in CI) one case runs, in fp32 (bf16 matrix products are slow on most
# CPUs): the LoRA one, whose adapter files take the most of this code; the others' overrides are
# only validated. The CPU suite runs each variant's kill and resume (tests/test_resume.py,
# test_async_checkpoints.py, test_ema.py, test_finetune.py).
TINY_CASES = ("lora",)


def run_part(ctx: Context) -> Part:
    from linnaeus_accel.config import load_config

    part = Part(NAME, TITLE)
    steps = sizes(ctx)[0]
    env = run_env(ctx.cuda, ACCELERATE_MIXED_PRECISION="bf16" if ctx.full else "no")
    cases = {name: (extra, True) for name, extra in VARIANTS.items()}
    cases[NONDETERMINISTIC] = ([], False)
    if not ctx.full:
        for label in [c for c in cases if c not in TINY_CASES]:
            load_config(CFG, opts(ctx, ctx.work / "unused", cases.pop(label)[0]))  # its keys still exist
            part.not_run.append(f"{label}: tiny size, overrides validated only")
    root = ctx.work / NAME
    jobs: dict[str, Callable[[], Any]] = {}
    dirs: dict[str, dict[str, Path]] = {}
    for i, (label, (extra, deterministic)) in enumerate(cases.items()):
        case_dirs = {"ref": root / f"c{i}_ref" / "run", "kill": root / f"c{i}_kill" / "run"}
        dirs[label] = case_dirs

        def uninterrupted(
            d: dict[str, Path] = case_dirs, e: list[str] = extra, det: bool = deterministic
        ) -> Done:
            return run(train_command(CFG, opts(ctx, d["ref"], e, det)), env, d["ref"].parent / "log.txt", 600)

        def killed_then_resumed(
            d: dict[str, Path] = case_dirs, e: list[str] = extra, det: bool = deterministic
        ) -> tuple[Done, Done]:
            command = train_command(CFG, opts(ctx, d["kill"], e, det))
            log = d["kill"].parent
            first = run(command, {**env, "LINNAEUS_ACCEL_KILL_AT": KILL_AT}, log / "log_killed.txt", 600)
            return first, run(command, env, log / "log_resumed.txt", 600)

        jobs[f"{label}|ref"] = uninterrupted
        jobs[f"{label}|kill"] = killed_then_resumed
    ctx.say(f"e2e: {len(cases)} cases, {len(jobs)} chains of runs")
    with ThreadPoolExecutor(max_workers=len(jobs) if ctx.cuda else 2) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        done = {key: future.result() for key, future in futures.items()}
    for label, (_, deterministic) in cases.items():
        killed, resumed = done[f"{label}|kill"]
        check_pair(part, label, done[f"{label}|ref"], killed, resumed, dirs[label], steps, deterministic, ctx)
    return part
