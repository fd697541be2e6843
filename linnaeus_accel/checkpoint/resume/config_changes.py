"""What a resumed run may change in its config.

A checkpoint stores the resolved config it was trained with. On resume, a change that only acts
on the steps still to come (more epochs, logging, validation and checkpoint intervals, early
stopping, output and tracker settings) is applied and listed. A change that would make the steps
already trained a different run (data, seed, model, loss, optimizer, a schedule's values before the
current step) is refused, naming each key, unless the user passes ``--allow-config-change``.
Schedules are compared by their values, not their keys: more epochs under a warmup-stable-decay
LR whose decay has not started change nothing already trained; under cosine they do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...config import Config, ConfigError, load_config
from ...json_files import flatten
from ...schedule import ResolvedPlan, resolve_plan

# Keys (or key prefixes, ending in ".") that act only on steps still to come.
FORWARD_ONLY = (
    "SCHEDULE.METRICS.",
    "SCHEDULE.VALIDATION.",
    "SCHEDULE.CHECKPOINT.",
    "TRAIN.EPOCHS",
    "TRAIN.STEPS",
    "TRAIN.TARGET_TOKENS",
    "TRAIN.EARLY_STOP.",
    "TRAIN.AUTO_RESUME",
    "TRAIN.NONFINITE",
    "ENV.",
    "EXPERIMENT.NAME",  # the output directory: a checkpoint may be resumed into another
    "EXPERIMENT.WANDB.",
    "EXPERIMENT.TRACKERS",
    "EXPERIMENT.TAGS",
    "EXPERIMENT.NOTES",
    "DATA.NUM_WORKERS",
    "DATA.BATCH_SIZE_VAL",
    "TASK.FLOPS_PER_TOKEN",
    "TASK.FLOPS_PER_SAMPLE",
    "CALLBACKS",  # a callback acts on the steps to come; one new since the checkpoint starts fresh
    "MODEL.INIT_FROM",  # the weights a run starts from: a resumed run's are its checkpoint's
    "MODEL.INIT_IGNORE",
)
# The split of the effective batch over processes and accumulation: elastic resume converts the
# position when the product is the same (checked by ``checkpoint.resume.elastic.compatible_position``).
ELASTIC = ("DATA.BATCH_SIZE", "TRAIN.ACCUMULATION_STEPS")
# Applied changes whose line says more: what they do to comparisons with the steps before.
_NOTES = {
    "SCHEDULE.VALIDATION.MAX_BATCHES": "validations from here on read another part of the split: their "
    "metrics, and the best metric and checkpoint ranking that compare them with earlier ones, are "
    "not like for like",
}
_SAMPLED_STEPS = 20_000  # schedule values compared at most at this many past steps


def differing_keys(saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (the checkpoint's value, this run's value), for every key that differs. A key the
    checkpoint's config does not have (added to linnaeus-accel since it was written) differs only
    when this run sets it to something other than its default."""
    old, new = flatten(saved), flatten(now)
    defaults = flatten(Config().model_dump(mode="json"))
    missing = object()
    return {
        key: (old.get(key), new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key, missing) != new.get(key, missing)
        and not (key not in old and key in defaults and new.get(key) == defaults[key])
    }


def _forward_only(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in FORWARD_ONLY)


def _past_steps(done: int) -> range | list[int]:
    if done <= _SAMPLED_STEPS:
        return range(done)
    stride = done / _SAMPLED_STEPS
    return sorted({int(i * stride) for i in range(_SAMPLED_STEPS)} | {done - 1})


def past_schedule_change(before: ResolvedPlan, after: ResolvedPlan, done: int) -> str | None:
    """How the schedules' values differ on the ``done`` steps already trained, or None."""
    if len(before.lr_curves) != len(after.lr_curves):
        return f"the number of parameter groups changed ({len(before.lr_curves)} -> {len(after.lr_curves)})"
    curves: list[tuple[str, Any, Any]] = [
        (f"the LR of group {c.label}", before.lr_curves[i], after.lr_curves[i])
        for i, c in enumerate(after.lr_curves)
    ]
    curves += [
        ("the meta-mask probability", before.meta_mask, after.meta_mask),
        ("the partial-mask probability", before.partial_mask, after.partial_mask),
        ("the mixup probability", before.mixup, after.mixup),
    ]
    for name, old, new in curves:
        for k in _past_steps(done):
            if not math.isclose(old(k), new(k), rel_tol=1e-9, abs_tol=1e-15):
                return f"{name} at step {k} would be {new(k):.6g}, not {old(k):.6g}"
    return None


def review_changes(
    saved_config: Mapping[str, Any] | None,
    saved_plan: Mapping[str, int] | None,
    run_config: Mapping[str, Any],
    plan: ResolvedPlan,
    done: int,
    allow: bool,
) -> list[str]:
    """The changes this resumed run applies, one line each; ``ConfigError`` for changes that
    rewrite the ``done`` steps already trained (unless ``allow``). ``run_config``: this run's
    config as JSON data (``Config.model_dump(mode="json")``), compared key by key with the
    checkpoint's ``saved_config``; a checkpoint written before configs were stored in it
    (``saved_config`` None) is not reviewed."""
    if saved_config is None:
        return []
    changed = differing_keys(saved_config, run_config)
    if not changed:
        return []
    lines = [
        f"{key}: {old!r} -> {new!r}" + (f" ({_NOTES[key]})" if key in _NOTES else "")
        for key, (old, new) in changed.items()
    ]
    refused = [key for key in changed if not _forward_only(key) and key not in ELASTIC]
    problems = [
        (key, f"was {changed[key][0]!r} in the checkpoint, is {changed[key][1]!r} now") for key in refused
    ]
    if not refused and saved_plan is not None and "batches_per_epoch" in saved_plan:
        before = _saved_plan(saved_config, saved_plan, plan)
        difference = past_schedule_change(before, plan, done) if before is not None else None
        if difference is not None:
            keys = ", ".join(changed)
            problems.append((keys, f"changes the {done} steps already trained: {difference}"))
    if problems and not allow:
        hint = (
            "these change the steps already trained: resume with the checkpoint's values, start a new run "
            "(EXPERIMENT.NAME or --overwrite), or pass --allow-config-change to resume anyway"
        )
        if saved_plan is not None and int(saved_plan.get("total_steps") or 0) < plan.total_steps:
            hint = (
                f"to train this run on to step {plan.total_steps} (it was to end at step "
                f"{saved_plan['total_steps']}), pass --allow-config-change: the schedules are resolved again for "
                "the new length, and the steps from here on follow them (a schedule given in steps, such as "
                "wsd with LR_SCHEDULER.DECAY_STEPS, is extended without changing the steps already trained)"
            )
        raise ConfigError([*problems, ("--allow-config-change", hint)], source="resume")
    return lines


def resume_notes(
    saved_config: Mapping[str, Any] | None,
    saved_plan: Mapping[str, int] | None,
    plan: ResolvedPlan,
    done: int,
) -> list[str]:
    """What changes at the resume step ``done`` when this run's length is not the checkpoint's (a
    finished run trained longer): its new end, each group's LR for the next step under the
    checkpoint's schedule and this one, the next validation and checkpoint. Empty otherwise."""
    if saved_plan is None or saved_config is None or saved_plan.get("total_steps") == plan.total_steps:
        return []
    lines = [
        f"the run now ends at step {plan.total_steps} ({plan.length_key}), not {saved_plan['total_steps']}"
    ]
    before = _saved_plan(saved_config, saved_plan, plan) if "batches_per_epoch" in saved_plan else None
    if before is not None:
        difference = past_schedule_change(before, plan, done)
        lines.append(
            f"the {done} steps trained are what a fresh run of {plan.total_steps} steps trains: trained on, "
            "this run is that run"
            if difference is None
            else f"the {done} steps trained differ from a fresh run of {plan.total_steps} steps ({difference}): "
            "from here on, every value is the new length's"
        )
    if before is not None and len(before.lr_curves) == len(plan.lr_curves):
        for i, curve in enumerate(plan.lr_curves):
            old, new = before.lr(done, i), plan.lr(done, i)
            lines.append(
                f"LR of group {curve.label} at step {done + 1}: {new:.6g} ({old:.6g} under the checkpoint's schedule)"
            )
    from ...schedule.report.boundary_steps import next_event_step

    upcoming = [
        f"{name} at step {step}"
        for name, kind in (("validation", "validation"), ("checkpoint", "checkpoint"))
        if (step := next_event_step(plan, kind, done)) is not None
    ]
    if upcoming:
        lines.append("next " + ", ".join(upcoming))
    return lines


def _saved_plan(
    saved_config: Mapping[str, Any], saved_plan: Mapping[str, int], plan: ResolvedPlan
) -> ResolvedPlan | None:
    """The plan the checkpoint was trained under, resolved again from its stored config."""
    try:
        old = load_config(dict(saved_config))
        saved = saved_plan["batches_per_epoch"]
        batches = None if saved is None else int(saved)  # None: a stream without __len__
        return resolve_plan(
            old, batches, int(saved_plan["world_size"]), plan.dataset_size, _tokens_per_sample(plan)
        )
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


def _tokens_per_sample(plan: ResolvedPlan) -> int | None:
    if plan.tokens_per_step is None:
        return None
    return plan.tokens_per_step // plan.effective_batch_size
