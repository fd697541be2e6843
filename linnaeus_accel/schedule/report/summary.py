"""Human summary, text timeline and JSON of a resolved plan (``linnaeus-accel plan``).

The same text is written to ``<output dir>/assets/schedule_summary.txt`` when training starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..lr import LRCurve
from ..ops import EventEpochs, OpsSchedule
from ..resolved import ResolvedPlan
from ..rollback import rollback_lines
from .boundary_steps import EVENT_KINDS, event_steps, forced_at_end, interval_of, mid_epoch_multiples
from .optimizer import Optimizer, built_optimizer_lines, muon_lr_lines, optimizer_lines
from .settings import ReportSettings
from .timeline import timeline
from .validation_budget import validation_budget, validation_budget_line

SERIES_FULL_LIMIT = 100_000
SERIES_SAMPLES = 10_000


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / max(1, whole):.1f}%"


def describe_lr(curve: LRCurve) -> str:
    """One line per curve, e.g. 'warmup 50 steps (5.0%); stable 760 steps (80.0% of post-warmup) ...'."""
    t, w = curve.total_steps, curve.warmup_steps
    post = curve.post_warmup_steps
    parts = [f"warmup {w} steps ({_pct(w, t)})" + (f" from {curve.warmup_lr:.3g}" if w else "")]
    if curve.kind == "wsd":
        phases = curve.phases()
        for name, length in (("stable", curve.stable_steps), ("decay", curve.decay_steps)):
            span = phases.get(name)
            where = f" from step {span[0]} to {span[1]}" if span else ""
            share = f"{_pct(length, post)} of post-warmup" if name == "stable" else _pct(length, post)
            parts.append(f"{name} {length} steps ({share}){where}")
        if "decay" in phases:
            parts[-1] += f" ({curve.decay_type})"
        if "min" in phases:
            a, b = phases["min"]
            parts.append(f"held at MIN_LR from step {a} to {b}")
    elif curve.kind == "step":
        every = f"every {curve.decay_every} steps" if curve.decay_every else "never"
        parts.append(f"x{curve.decay_rate:g} {every} after warmup, floor {curve.min_lr:.3g}")
    elif w < t:
        parts.append(f"{curve.kind} decay {post} steps from step {w} to {t - 1}")
    return "; ".join(parts) + "."


def _epochs_text(epochs: EventEpochs) -> str:
    first = epochs.first(13)
    if not first:
        return "never"
    shown = (
        ", ".join(map(str, first))
        if len(first) <= 12
        else (", ".join(map(str, first[:6])) + ", ..., " + ", ".join(map(str, epochs.last(3))))
    )
    return f"after epoch{'s' if len(first) > 1 else ''} {shown}"


def summary_text(settings: ReportSettings, plan: ResolvedPlan, optimizer: Optimizer | None = None) -> str:
    """``optimizer``: the one given to the Trainer (a factory's or built), described as it is built
    instead of what OPTIMIZER says, which it does not read."""
    lines = ["Schedule summary", "================"]
    procs = f"{plan.world_size} process{'es' if plan.world_size > 1 else ''}"
    if plan.batches_per_epoch is None:
        data = "a stream without __len__: epochs end where it ends, their number of batches is unknown"
    else:
        size = f"{plan.dataset_size} training samples -> " if plan.dataset_size is not None else ""
        data = f"{size}{plan.batches_per_epoch} batches per process per epoch"
    lines += [
        f"Data:     {data} (batch {plan.batch_size} x {procs})",
        *_source_lines(plan),
        _steps_line(plan),
        *_tokens_lines(plan),
        f"Batch:    effective batch size {plan.effective_batch_size}; LR scale {plan.lr_scale:g}"
        + (
            f" (= {plan.effective_batch_size} / {settings.reference_bs})"
            if settings.reference_bs
            else " (scaling off)"
        ),
        "",
    ]
    for i, curve in enumerate(plan.lr_curves):
        head = f"LR {curve.kind}, group {i} '{curve.label}'"
        if i:
            head += f" (params matching {', '.join(plan.group_patterns[i - 1])})"
        lines.append(f"{head}: peak {curve.base_lr:.4g}, min {curve.min_lr:.4g}")
        lines.append("  " + describe_lr(curve))
    lines += optimizer_lines(settings.optimizer) if optimizer is None else built_optimizer_lines(optimizer)
    if settings.optimizer.NAME == "muon" and optimizer is None:
        lines += muon_lr_lines(settings.optimizer, settings.base_lr, plan.lr_curves)
    lines.append("")
    lines.append(f"Validation:            {_event_text(plan, 'validation')}")
    lines += validation_budget_line(settings.schedule.VALIDATION, settings.val_batch_size, plan)
    lines.append(f"Mask-meta validation:  {_event_text(plan, 'mask_meta_validation')}")
    combos = "; ".join("+".join(c) for c in plan.partial_validation_whitelist)
    partial = _event_text(plan, "partial_mask_meta_validation")
    lines.append(f"Partial-mask validation: {partial}" + (f" ({combos})" if partial != "never" else ""))
    if plan.exhaustive_combinations:
        lines.append(
            f"Exhaustive validation: {len(plan.exhaustive_combinations)} passes at the final epoch: "
            + ", ".join("+".join(c) for c in plan.exhaustive_combinations)
        )
    ck = settings.schedule.CHECKPOINT
    keep = (
        "all"
        if ck.KEEP_TOP_N == 0 and ck.KEEP_LAST_N == 0
        else f"best {ck.KEEP_TOP_N} + last {ck.KEEP_LAST_N}"
    )
    lines.append(f"Checkpoints:           {_event_text(plan, 'checkpoint')}; keep {keep}")
    lines += rollback_lines(settings.train, plan)
    for timing in plan.callbacks:
        lines.append(f"Callback {timing.label}: on_step_end {timing.describe()}")
    lines.append("")
    lines += _ramp_lines(settings, plan)
    lines += _logging_lines(settings, plan)
    if plan.max_steps is not None:
        lines.append(f"MAX_STEPS: training stops after step {plan.max_steps} of {plan.total_steps}")
    lines += ["", *timeline(plan)]
    if plan.warnings:
        lines += ["", "Warnings:", *(f"  - {w}" for w in plan.warnings)]
    return "\n".join(lines) + "\n"


def _event_text(plan: ResolvedPlan, kind: str) -> str:
    """When an event happens: after which epochs, and at which steps inside them (MID_EPOCH). For
    epochs of unknown length, what can be said before the run."""
    every = mid_epoch_multiples(plan, kind)
    mid = f"every {every} steps (at the step itself, mid-epoch)" if every is not None else None
    if plan.known_epochs:
        events = OpsSchedule(plan).events()
        boundary = _epochs_text(events[kind])
        if kind == "partial_mask_meta_validation" and boundary == "never" and plan.exhaustive_combinations:
            boundary = _epochs_text(events["exhaustive_validation"])
        if mid is None:
            return boundary
        return mid if boundary == "never" else f"{mid}; {boundary}"
    interval, _ = interval_of(plan, kind)
    parts = [mid] if mid is not None else []
    if mid is None and interval is not None:
        parts.append(
            f"at the first end of a pass after every {interval.every} steps (where passes end is unknown)"
        )
    if forced_at_end(plan, kind):
        parts.append(f"at the last step ({plan.total_steps})")
    return ", and ".join(parts) or "never"


def _logging_lines(settings: ReportSettings, plan: ResolvedPlan) -> list[str]:
    """What every SCHEDULE.METRICS interval resolves to, with the rounding said where it happened."""
    metrics = settings.schedule.METRICS
    every = plan.metrics_interval

    def steps(n: int) -> str:
        return "every step" if n == 1 else f"every {n} steps"

    def rounded(key: str, asked: int | None, resolved: int) -> str:
        if asked is None or asked == resolved:
            return steps(resolved)
        return f"{steps(resolved)} ({key} {asked} rounded up to a multiple of {every})"

    trackers = ", ".join(settings.trackers) or "none"
    return [
        f"Logging:  metrics.jsonl {steps(every)} and at the last step; "
        f"console {rounded('CONSOLE_INTERVAL', metrics.CONSOLE_INTERVAL, plan.console_interval)}",
        f"          trackers ({trackers}) "
        f"{rounded('TRACKER_INTERVAL', metrics.TRACKER_INTERVAL, plan.tracker_interval)}, "
        f"validation results at every pass; lr/<group> {steps(plan.lr_interval)}",
    ]


def _source_lines(plan: ResolvedPlan) -> list[str]:
    """A mixture's sources: the samples (and target tokens) each gives an epoch, and how many passes
    over itself that is (a source drawn past its size is cycled)."""
    lines = []
    for source in plan.sources:
        tokens = f", {source.tokens_per_epoch:,} tokens" if source.tokens_per_epoch is not None else ""
        passes = source.samples_per_epoch / max(1, source.size)
        lines.append(
            f"          {source.label}: weight {source.weight:.4g} -> {source.samples_per_epoch:,} samples{tokens} "
            f"per epoch ({passes:.3g} passes over its {source.size:,})"
        )
    return ["Mixture:  samples per epoch by source", *lines] if lines else []


def _steps_line(plan: ResolvedPlan) -> str:
    if plan.optimizer_steps_per_epoch is None:
        return (
            f"Steps:    {plan.total_steps} total steps from {plan.length_key}; optimizer steps per epoch "
            f"unknown (accumulation {plan.accumulation})"
        )
    per_epoch = (
        f"{plan.optimizer_steps_per_epoch} optimizer steps per epoch (accumulation {plan.accumulation})"
    )
    if plan.length_key == "TRAIN.EPOCHS":
        return f"Steps:    {per_epoch} x {plan.epochs} epochs = {plan.total_steps} total steps"
    if plan.length_key == "TRAIN.STEPS":
        return f"Steps:    {per_epoch}; {plan.total_steps} total steps from TRAIN.STEPS = {_epochs_of(plan)}"
    return f"Steps:    {per_epoch}; {plan.total_steps} total steps from TRAIN.TARGET_TOKENS (see Tokens)"


def _epochs_of(plan: ResolvedPlan) -> str:
    """'3 epochs', or '3 epochs, the last partial (40 of 100 steps)'; 'epochs of unknown length'."""
    if plan.epochs is None or plan.optimizer_steps_per_epoch is None:
        return "epochs of unknown length"
    text = f"{plan.epochs} epoch{'s' if plan.epochs > 1 else ''}"
    if plan.last_epoch_steps < plan.optimizer_steps_per_epoch:
        text += f", the last partial ({plan.last_epoch_steps} of {plan.optimizer_steps_per_epoch} steps)"
    return text


def _tokens_lines(plan: ResolvedPlan) -> list[str]:
    """The target tokens of a step and of the run, when every sample holds a known number of them."""
    per_step = plan.tokens_per_step
    if per_step is None:
        return []
    head = f"Tokens:   {per_step} target tokens per step"
    if plan.target_tokens is not None:
        return [
            f"{head}; target {plan.target_tokens} -> ceil({plan.target_tokens} / {per_step}) = "
            f"{plan.total_steps} steps = {_epochs_of(plan)}; {plan.total_tokens} tokens in the whole run"
        ]
    if plan.total_tokens is None:  # EPOCHS run of unknown dataset size: a padded last batch counts less
        return [f"{head}; at most {plan.total_steps * per_step} tokens in the whole run"]
    return [f"{head}; {plan.total_tokens} tokens in the whole run"]


def _ramp_lines(settings: ReportSettings, plan: ResolvedPlan) -> list[str]:
    out = []
    t = plan.total_steps
    m = plan.meta_mask
    out.append(
        f"Meta masking:    {m.start_prob:g} -> {m.end_prob:g} by step {m.end_step} ({_pct(m.end_step, t)})"
        if m.enabled
        else "Meta masking:    off"
    )
    pm = plan.partial_mask
    if pm.enabled:
        out.append(
            f"Partial masking: active steps {pm.start_step}..{pm.end_step - 1}; prob {pm.prob.start_prob:g} -> "
            f"{pm.prob.end_prob:g} by step {pm.prob.end_step}; combinations "
            + ", ".join("+".join(c) for c in pm.whitelist)
        )
    else:
        out.append("Partial masking: off")
    x = plan.mixup
    out.append(
        f"Mixup:           {x.start_prob:g} -> {x.end_prob:g} by step {x.end_step} ({_pct(x.end_step, t)}), "
        f"within groups of '{plan.mixup_group_level}'"
        if x.enabled
        else "Mixup:           off"
    )
    if settings.document_masking:  # causal_lm only (the config refuses it for other tasks)
        out.append(
            "Document masking: on: attention within each document, positions restart after each end-of-document id"
        )
    if plan.gradnorm_enabled:
        out.append(
            f"GradNorm:        every {plan.gradnorm_interval} steps from step {plan.gradnorm_warmup_steps}"
        )
    if settings.loss_chunk_tokens:
        out.append(
            f"Chunked loss:    output projection and cross-entropy {settings.loss_chunk_tokens} tokens at a "
            "time (TASK.LOSS_CHUNK_TOKENS)"
        )
    es = settings.train.EARLY_STOP
    if es.ACTIVE:
        out.append(
            f"Early stopping:  {es.METRIC} ({es.mode}), patience {es.PATIENCE_STEPS} steps, min delta {es.MIN_DELTA:g}"
        )
    return out


def series_steps(total_steps: int) -> list[int]:
    if total_steps <= SERIES_FULL_LIMIT:
        return list(range(total_steps))
    n = SERIES_SAMPLES
    return [round(i * (total_steps - 1) / (n - 1)) for i in range(n)]


def plan_json(settings: ReportSettings, plan: ResolvedPlan, with_series: bool = True) -> dict[str, Any]:
    events = OpsSchedule(plan).event_epochs() if plan.known_epochs else None
    out: dict[str, Any] = {
        "experiment": settings.experiment,
        "output_dir": str(settings.output_dir),
        "dataset_size": plan.dataset_size,
        "world_size": plan.world_size,
        "batch_size": plan.batch_size,
        "accumulation_steps": plan.accumulation,
        "epochs": plan.epochs,
        "batches_per_epoch": plan.batches_per_epoch,
        "optimizer_steps_per_epoch": plan.optimizer_steps_per_epoch,
        "total_steps": plan.total_steps,
        "effective_batch_size": plan.effective_batch_size,
        "target_tokens": plan.target_tokens,
        "tokens_per_step": plan.tokens_per_step,
        "total_tokens": plan.total_tokens,
        "lr_scale": plan.lr_scale,
        "warmup_steps": plan.warmup_steps,
        "lr_groups": [
            {
                "label": c.label,
                "schedule": c.kind,
                "base_lr": c.base_lr,
                "min_lr": c.min_lr,
                "warmup_lr": c.warmup_lr,
                "warmup_steps": c.warmup_steps,
                "phases": {k: list(v) for k, v in c.phases().items()},
            }
            for c in plan.lr_curves
        ],
        "events": events,  # epochs of each boundary event; null for epochs of unknown length
        # Steps of the events that happen at steps (MID_EPOCH), and of every known event when the
        # epochs' length is unknown (the final step, the mid-epoch multiples).
        "event_steps": {
            kind: event_steps(plan, kind, plan.total_steps)
            for kind in EVENT_KINDS
            if not plan.known_epochs or mid_epoch_multiples(plan, kind) is not None
        },
        "length_key": plan.length_key,
        "sources": [dataclasses.asdict(source) for source in plan.sources],
        "callbacks": [dataclasses.asdict(timing) for timing in plan.callbacks],  # when on_step_end runs
        "logging": {
            "metrics_interval": plan.metrics_interval,
            "console_interval": plan.console_interval,
            "tracker_interval": plan.tracker_interval,
            "lr_interval": plan.lr_interval,
            "trackers": list(settings.trackers),
        },
        # null: every pass reads the whole split
        "validation_budget": validation_budget(settings.schedule.VALIDATION, settings.val_batch_size, plan),
        "warnings": list(plan.warnings),
    }
    if with_series:
        steps = series_steps(plan.total_steps)
        series: dict[str, Any] = {
            "step": steps,
            "lr": [plan.lr_curves[0](k) for k in steps],
            "meta_mask_prob": [plan.meta_mask(k) for k in steps],
            "partial_mask_prob": [plan.partial_mask(k) for k in steps],
            "mixup_prob": [plan.mixup(k) for k in steps],
        }
        if len(plan.lr_curves) > 1:
            series["lr_by_group"] = {c.label: [c(k) for k in steps] for c in plan.lr_curves}
        out["series"] = series
    return out


def write_schedule_summary(output_dir: str | Path, text: str) -> Path:
    path = Path(output_dir) / "assets" / "schedule_summary.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
