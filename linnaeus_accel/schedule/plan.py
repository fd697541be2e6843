"""The resolved plan: every schedule parameter of a config, in integer global steps, computed once.

``resolve_plan(config, batches_per_epoch, world_size)`` is the only place where steps, fractions and
epochs (and, for ``TRAIN.TARGET_TOKENS``, tokens) meet; everything downstream (the training loop,
``OpsSchedule``, ``plan``) reads ints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..config import Config, ConfigError
from ..config.augmentation import ProbabilityRamp
from ..config.duration import Duration
from ..config.lr import LRSchedulerConfig, ParameterGroup
from ..config.optimizer import OptimizerConfig
from .boundaries import Interval, exhaustive_combinations
from .callback_steps import resolve_callbacks
from .lr import LRCurve
from .ramps import DISABLED, PartialMasking, Ramp
from .resolved import MAX_TOTAL_STEPS, DataSource, ResolvedPlan
from .rollback import rollback_warnings
from .run_length import epoch_unit_keys, run_length
from .sanity import sanity_warnings
from .steps import ceil_div, floor_fraction_of, optimizer_steps_per_epoch


def resolve_plan(
    config: Config,
    batches_per_epoch: int | None,
    world_size: int = 1,
    dataset_size: int | None = None,
    tokens_per_sample: int | None = None,
    sources: Sequence[Any] = (),
) -> ResolvedPlan:
    """Resolve ``config`` for a dataloader of ``batches_per_epoch`` batches per process (None: a
    stream without ``__len__``, whose epochs end where it ends: docs/semantics.md §7).

    ``tokens_per_sample``: target tokens in every training sample, when the dataset declares a fixed
    count (packed sequences); TRAIN.TARGET_TOKENS needs it. ``sources``: a mixture's
    ``describe()``, shown by ``plan``."""
    if world_size < 1:
        raise ConfigError([("--world-size", f"must be >= 1 (got {world_size})")], source="plan")
    if batches_per_epoch is not None and batches_per_epoch < 1:
        # Only what is known: a streaming dataset has no size to print.
        facts = [f"{dataset_size} samples"] if dataset_size is not None else []
        facts += [
            f"batches of {config.DATA.BATCH_SIZE}",
            f"{world_size} process{'es' if world_size > 1 else ''}",
        ]
        facts += ["DROP_LAST"] if config.DATA.DROP_LAST else []
        raise ConfigError(
            [
                (
                    "DATA.BATCH_SIZE",
                    f"the training data yields no batch per process ({', '.join(facts)}): lower BATCH_SIZE "
                    "or add data",
                )
            ],
            source="plan",
        )
    accum = config.TRAIN.accumulation
    ope = None if batches_per_epoch is None else optimizer_steps_per_epoch(batches_per_epoch, accum)
    if ope is None and (
        keys := epoch_unit_keys(config.TRAIN, config.SCHEDULE, config.LR_SCHEDULER, config.CALLBACKS)
    ):
        raise ConfigError(
            [
                (
                    key,
                    "the training data is a stream without __len__, so an epoch has no known number of steps: "
                    + (
                        "give the run's length as TRAIN.STEPS or TRAIN.TARGET_TOKENS"
                        if key == "TRAIN.EPOCHS"
                        else f"give it in steps or as a fraction of the run ({key.removesuffix('_EPOCHS')}_STEPS / _FRACTION)"
                    ),
                )
                for key in keys
            ],
            source="plan",
        )
    sched, lrc = config.SCHEDULE, config.LR_SCHEDULER
    effective = config.DATA.BATCH_SIZE * world_size * accum
    length = run_length(
        config.TRAIN, config.DATA, batches_per_epoch, world_size, dataset_size, tokens_per_sample
    )
    total, epochs = length.total_steps, length.epochs
    if total > MAX_TOTAL_STEPS:
        raise ConfigError(
            [
                (
                    config.TRAIN.length_key,
                    f"resolves to {total:,} optimizer steps, more than 2**53 = {MAX_TOTAL_STEPS:,}: the "
                    "schedules' step arithmetic is exact only up to there (and at 10,000 steps a second such "
                    "a run would take 28,000 years); lower it",
                )
            ],
            source="plan",
        )
    scale = effective / lrc.REFERENCE_BS if lrc.REFERENCE_BS else 1.0

    def steps(duration: Duration | None) -> int | None:
        # Epochs of unknown length (ope None) were refused above when a duration is in epochs.
        return None if duration is None else duration.steps(total, ope)

    def interval(duration: Duration | None) -> Interval | None:
        """Epochs stay epochs (they fire on ``epoch % N``); a fraction that resolved to 0 steps
        disables the interval."""
        if duration is None:
            return None
        if duration.unit == "epochs":
            return Interval("epochs", int(duration.value))
        every = duration.steps(total, ope)
        return Interval("steps", every) if every else None

    def ramp(block: ProbabilityRamp) -> Ramp:
        if not block.ENABLED:
            return DISABLED
        return Ramp(True, block.START_PROB, block.END_PROB, steps(block.END) or 0)

    curves = [_curve("default", lrc, None, scale, total, steps)]
    curves += [_curve(g.LABEL, lrc, g, scale, total, steps) for g in lrc.PARAMETER_GROUPS]
    _check_lr_bounds(curves, lrc, effective)

    pm = sched.META_MASKING.PARTIAL
    partial_start = steps(pm.START) or 0
    partial_end = steps(pm.END)
    partial_end = total if partial_end is None else partial_end
    whitelist = tuple(tuple(c) for c in pm.WHITELIST)
    partial = PartialMasking(
        enabled=pm.ENABLED,
        start_step=partial_start,
        end_step=partial_end,
        prob=Ramp(pm.ENABLED, pm.START_PROB, pm.END_PROB, steps(pm.PROB_END) or 0),
        whitelist=whitelist,
        weights=tuple(pm.WEIGHTS) if pm.WEIGHTS is not None else tuple(1.0 for _ in whitelist),
    )

    val, final = sched.VALIDATION, sched.VALIDATION.FINAL_EPOCH
    metrics = sched.METRICS
    log_every = steps(metrics.STEP) or 50  # a fraction that resolved to 0 steps too
    gradnorm = config.LOSS.GRAD_WEIGHTING.TASK
    plan = ResolvedPlan(
        world_size=world_size,
        batch_size=config.DATA.BATCH_SIZE,
        accumulation=accum,
        batches_per_epoch=batches_per_epoch,
        optimizer_steps_per_epoch=ope,
        epochs=epochs,
        total_steps=total,
        effective_batch_size=effective,
        lr_scale=scale,
        lr_curves=tuple(curves),
        group_patterns=tuple(tuple(g.MATCH) for g in lrc.PARAMETER_GROUPS),
        validation=interval(val.INTERVAL),
        mask_meta_validation=interval(val.MASK_META_INTERVAL),
        partial_mask_meta_validation=interval(val.PARTIAL_MASK_META.INTERVAL)
        if val.PARTIAL_MASK_META.ENABLED
        else None,
        partial_validation_whitelist=tuple(tuple(c) for c in val.PARTIAL_MASK_META.WHITELIST),
        exhaustive_combinations=exhaustive_combinations(tuple(final.EXHAUSTIVE_META_COMPONENTS))
        if final.EXHAUSTIVE_PARTIAL_META_VALIDATION
        else (),
        checkpoint=interval(sched.CHECKPOINT.INTERVAL),
        mid_epoch_checkpoints=sched.CHECKPOINT.MID_EPOCH,
        mid_epoch_validation=val.MID_EPOCH,
        meta_mask=ramp(sched.META_MASKING),
        partial_mask=partial,
        mixup=ramp(sched.MIXUP.PROB),
        mixup_group_level=sched.MIXUP.GROUP_LEVELS[0] if sched.MIXUP.GROUP_LEVELS else None,
        metrics_interval=log_every,
        console_interval=multiple_of(log_every, metrics.CONSOLE_INTERVAL),
        tracker_interval=multiple_of(log_every, metrics.TRACKER_INTERVAL),
        lr_interval=metrics.LR_INTERVAL or log_every,
        gradnorm_enabled=gradnorm.GRADNORM_ENABLED,
        gradnorm_warmup_steps=gradnorm.GRADNORM_WARMUP_STEPS,
        gradnorm_interval=gradnorm.UPDATE_INTERVAL,
        max_steps=config.TRAIN.EARLY_STOP.MAX_STEPS if config.TRAIN.EARLY_STOP.ACTIVE else None,
        dataset_size=dataset_size,
        target_tokens=config.TRAIN.TARGET_TOKENS,
        tokens_per_step=length.tokens_per_step,
        total_tokens=length.total_tokens,
        length_key=config.TRAIN.length_key,
        sources=tuple(DataSource.from_description(row) for row in sources),
        callbacks=resolve_callbacks(config.CALLBACKS, total),
    )
    warnings = (
        *sanity_warnings(sched, lrc, config.TRAIN, plan),
        *rollback_warnings(config.TRAIN, plan),
        *source_warnings(plan, sources),
        *muon_warnings(config.OPTIMIZER, plan.total_steps),
    )
    return replace(plan, warnings=warnings)


def muon_warnings(optimizer: OptimizerConfig, total_steps: int) -> list[str]:
    """Muon's momentum warmup longer than the run: the run ends before the momentum is MOMENTUM."""
    warmup = optimizer.MUON.MOMENTUM_WARMUP_STEPS
    if optimizer.NAME != "muon" or warmup <= total_steps:
        return []
    return [
        f"OPTIMIZER.MUON.MOMENTUM_WARMUP_STEPS: a warmup of {warmup} steps is longer than the run ({total_steps} "
        f"steps): the momentum never reaches MUON.MOMENTUM ({optimizer.MUON.MOMENTUM:g}); shorten the warmup"
    ]


def source_warnings(plan: ResolvedPlan, rows: Sequence[Any]) -> list[str]:
    """A mixture's warnings: its own (``warnings`` of a ``describe()`` row: two sources reading the
    same data), and a source whose share leaves it less than one expected sample in the whole run."""
    out = [str(warning) for row in rows for warning in (row.get("warnings") or ())]
    samples = plan.total_steps * plan.effective_batch_size  # a partial last batch counted whole
    if plan.epochs is not None and plan.dataset_size is not None:
        samples = min(samples, plan.epochs * plan.dataset_size)
    for source in plan.sources:
        if samples > 0 and source.weight * samples < 1:
            out.append(
                f"mixture source {source.label!r}: its weight is {source.weight:.3g} of the sources' total, "
                f"so of the run's {samples:,} samples it is expected to give {source.weight * samples:.3g}, "
                "less than one, and its share cannot be kept (any draw of it is rounding): raise its weight "
                f"to at least {1 / samples:.3g} of the total, or remove the source"
            )
    return out


def multiple_of(step: int, interval: int | None) -> int:
    """``interval`` rounded up to a multiple of ``step`` (``step`` itself when unset): the console and
    the trackers can only show the metrics records, which exist every ``step`` steps."""
    return step if interval is None else ceil_div(interval, step) * step


StepResolver = Callable[[Duration | None], "int | None"]


def _curve(
    label: str,
    lrc: LRSchedulerConfig,
    group: ParameterGroup | None,
    scale: float,
    total: int,
    steps: StepResolver,
) -> LRCurve:
    """docs/semantics.md §3: a group follows the global curve times LR_MULTIPLIER; a field it sets replaces the
    scaled global value."""
    mult = group.LR_MULTIPLIER if group else 1.0

    def pick(name: str) -> Any:
        own = getattr(group, name, None) if group else None
        return own if own is not None else getattr(lrc, name)

    def own_or_global(own: Duration | None, default: Duration | None) -> int | None:
        return steps(own if own is not None else default)

    kind = group.NAME if group and group.NAME else lrc.NAME
    warmup = min(own_or_global(group.WARMUP if group else None, lrc.WARMUP) or 0, total)
    post = max(1, total - warmup)
    decay_every = own_or_global(group.DECAY if group else None, lrc.DECAY)
    return LRCurve(
        label=label,
        kind=kind,
        base_lr=lrc.BASE_LR * scale * mult,
        min_lr=group.MIN_LR if group and group.MIN_LR is not None else lrc.MIN_LR * mult,
        warmup_lr=group.WARMUP_LR if group and group.WARMUP_LR is not None else lrc.WARMUP_LR * mult,
        warmup_steps=warmup,
        total_steps=total,
        decay_every=max(1, decay_every) if decay_every else None,
        decay_rate=pick("DECAY_RATE"),
        stable_steps=floor_fraction_of(pick("STABLE_DURATION_FRACTION"), post),
        decay_steps=floor_fraction_of(pick("DECAY_DURATION_FRACTION"), post),
        decay_type=pick("DECAY_TYPE"),
    )


def _peak_lr_terms(lrc: LRSchedulerConfig, effective: int, group: ParameterGroup | None) -> str:
    """How a curve's peak LR is made, with every factor's value: the fix depends on which one is off."""
    if lrc.REFERENCE_BS:
        ratio = f"effective batch {effective} / REFERENCE_BS {lrc.REFERENCE_BS}"
        scale = f"batch-size scale {effective / lrc.REFERENCE_BS:g} ({ratio})"
    else:
        scale = "batch-size scale 1 (REFERENCE_BS null: no scaling)"
    multiplier = f" x LR_MULTIPLIER {group.LR_MULTIPLIER:g}" if group is not None else ""
    return f"BASE_LR {lrc.BASE_LR:g} x {scale}{multiplier}"


def _check_lr_bounds(curves: list[LRCurve], lrc: LRSchedulerConfig, effective: int) -> None:
    problems = []
    for i, c in enumerate(curves):
        where = "LR_SCHEDULER" if i == 0 else f"LR_SCHEDULER.PARAMETER_GROUPS.{i - 1}"
        group = lrc.PARAMETER_GROUPS[i - 1] if i else None
        peak = f"the peak LR {c.base_lr:g} = {_peak_lr_terms(lrc, effective, group)}"
        if c.min_lr > c.base_lr:
            problems.append(
                (f"{where}.MIN_LR", f"{c.min_lr:g} is above {peak}: lower MIN_LR or raise the peak")
            )
        if c.warmup_lr > c.base_lr:
            problems.append(
                (
                    f"{where}.WARMUP_LR",
                    f"{c.warmup_lr:g} is above {peak}: warmup would go down; lower WARMUP_LR or raise the peak",
                )
            )
    if problems:
        raise ConfigError(problems, source="plan")
