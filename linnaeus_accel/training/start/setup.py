"""Turning what the user hands the Trainer into what Accelerate prepares: the Accelerator, parameter
groups of the LR schedule, the optimizer, the dataloaders, and the parameters GradNorm balances on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ...config import Config, ConfigError
from ...config.lr import LRSchedulerConfig
from ...config.optimizer import OptimizerConfig
from ...config.run import EnvConfig, ExperimentConfig
from ...config.schedule import ScheduleConfig
from ...config.sections import DataConfig, LossConfig, ModelConfig, TrainConfig
from ...data.sampling import make_dataloader
from ...data.streams.reader import StreamError
from ...data.streams.streaming import StreamShard, stream_loader
from ...data.tokens.format import TokenOutOfVocab
from ...data.tokens.vocab import NO_LIMIT, limit_token_ids
from ...data.worker_signals import shield_workers
from ...optim import build_from_config
from ...optim.checks import check_first_step
from ...optim.groups import parameter_kinds, unused_settings
from ...process.launcher import follow_launcher, startup_deadline
from ...run_directory.trackers import check_log_with, log_with
from ...schedule.steps import batches_per_process
from ...tasks.causal_lm import VOCAB_KEY, vocabulary_shortfall
from ..step.batches import BatchSource
from ..step.loader import Loader
from ..validation.data import validation_batches
from .backends import check_backend

# A Trainer's Python ``optimizer=``: the parameter groups (``parameter_groups`` lists their keys:
# params, name, lr_group, weight_decay where the config decides it) -> the optimizer, at lr 0.0.
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def make_accelerator(
    given: Accelerator | None,
    *,
    experiment: ExperimentConfig,
    env: EnvConfig,
    data: DataConfig,
    loss: LossConfig,
    train: TrainConfig,
    schedule: ScheduleConfig,
    output_dir: Path,
) -> Accelerator:
    """The run's Accelerator (``given``, or one built from the config), checked against the config
    and the launch before anything is prepared. The config's sections: ``experiment`` (trackers,
    seed), ``env`` (determinism, timeouts), ``train`` (accumulation), and what the backend asks of
    ``data``, ``loss``, ``train`` and ``schedule`` (``check_backend``); ``output_dir``: the run
    directory."""
    accum = train.accumulation
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if env.DETERMINISTIC:  # before the first cuBLAS call creates its workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    follow_launcher()  # a worker whose launcher was killed must not train on (and hold the lock)
    joining = startup_deadline(env.DIST_TIMEOUT_S, "joining the other processes")
    with joining if launched > 1 and given is None else contextlib.nullcontext():
        acc = given or _accelerator(experiment, env, output_dir, launched, accum)
    if acc.num_processes != launched:
        raise RuntimeError(
            f"{launched} processes were launched but Accelerate joined {acc.num_processes}: "
            "each would train alone; check the launcher and accelerate config"
        )
    if acc.gradient_accumulation_steps != accum:
        raise ConfigError(
            [
                (
                    "TRAIN.ACCUMULATION_STEPS",
                    f"is {accum} but the Accelerator given accumulates {acc.gradient_accumulation_steps}",
                )
            ]
        )
    check_log_with(acc, experiment)
    check_backend(acc, data, loss, train, schedule)  # before prepare: DeepSpeed reads its config there
    return acc


def _accelerator(
    experiment: ExperimentConfig, env: EnvConfig, output_dir: Path, launched: int, accum: int
) -> Accelerator:
    return Accelerator(
        # Under torchrun on a machine without CUDA, Accelerate needs cpu=True to form the gloo group.
        cpu=launched > 1 and not torch.cuda.is_available(),
        gradient_accumulation_steps=accum,
        # A tracker whose package is missing: a ConfigError.
        log_with=log_with(experiment, output_dir),
        project_dir=str(output_dir),
        step_scheduler_with_optimizer=False,
        # A DataLoader given with shuffle=True gets a sampler seeded by (seed, epoch), so a resumed
        # run draws the epoch's order again instead of a new one (our own sampler already does).
        # non_blocking: a batch's copy to the GPU is queued, not waited for (a blocking copy is a
        # host sync every micro-batch: the host could not run ahead of the device); our loaders
        # pin their batches on a GPU, as an asynchronous copy needs.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=experiment.SEED, non_blocking=True
        ),
        # A process that stops answering must not hold the others for torch's 30 minutes.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=env.DIST_TIMEOUT_S))],
    )


def default_optimizer(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The Trainer's default: the optimizer OPTIMIZER names (AdamW, weight decay 0, torch's betas
    and eps unless the config says otherwise), over ``param_groups`` (see ``parameter_groups``).
    Called alone, it builds the default config's; the Trainer builds the run's config's
    (``build_optimizer``)."""
    return build_from_config(param_groups, Config())


def parameter_groups(
    model: nn.Module, optimizer_config: OptimizerConfig, lr_scheduler: LRSchedulerConfig
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, in an order fixed by the model and the config's OPTIMIZER
    (``optimizer_config``) and LR_SCHEDULER (``lr_scheduler``) sections (so that a resumed run's
    optimizer state fits them). Each is a dict with keys:

    - ``params``: its trained parameters (frozen ones, as a LoRA base's, are in no group), in
      ``model.named_parameters()`` order;
    - ``name``: the label of its LR_SCHEDULER group: ``default`` for group 0, which takes the
      parameters no LR_SCHEDULER.PARAMETER_GROUPS entry matches (docs/semantics.md §3), else the entry's LABEL;
    - ``lr_group``: that LR group's index (0 for ``default``): the schedule sets the group's ``lr``
      from its curve before every step;
    - ``weight_decay``: where the config decides it: 0.0 on the groups of OPTIMIZER.NO_DECAY's
      parameters, OPTIMIZER.WEIGHT_DECAY on the others when it is not 0 (else the optimizer's own
      default applies: a Python factory's, or OPTIMIZER.WEIGHT_DECAY's 0 for a built-in one).

    Groups 0..N are the N+1 LR groups (as before OPTIMIZER existed); with OPTIMIZER.NO_DECAY, each
    LR group's parameters of those kinds follow as a group of their own, in LR-group order (an LR
    group without any forms none).

    With OPTIMIZER.NAME muon, every group also has ``algorithm``: the groups above keep the
    parameters ``optim.muon.muon_split`` sends to AdamW (``adamw``), and the Muon side's follow in the
    same order, an LR group's at a time (``muon``: ``lr_scale`` MUON.LR / BASE_LR, the factor on its
    LR group's scheduled LR; ``weight_decay`` MUON.WEIGHT_DECAY, 0 for NO_DECAY's)."""
    groups = lr_scheduler.PARAMETER_GROUPS
    rule = set(optimizer_config.NO_DECAY)
    kinds = parameter_kinds(model) if rule else {}
    members: list[list[nn.Parameter]] = [[] for _ in range(len(groups) + 1)]
    exempt: list[list[nn.Parameter]] = [[] for _ in range(len(groups) + 1)]
    for name, param in model.named_parameters():
        if param.requires_grad:
            index = next((i + 1 for i, g in enumerate(groups) if any(fnmatch(name, p) for p in g.MATCH)), 0)
            (exempt if rule & kinds.get(id(param), set()) else members)[index].append(param)
    empty = [
        g.LABEL for g, params, more in zip(groups, members[1:], exempt[1:], strict=True) if not params + more
    ]
    if empty:
        raise ConfigError(
            [("LR_SCHEDULER.PARAMETER_GROUPS", f"no parameter matches group(s) {', '.join(empty)}")]
        )
    labels = ["default", *(g.LABEL for g in groups)]
    decay = optimizer_config.WEIGHT_DECAY
    rate: dict[str, Any] = {"weight_decay": decay} if decay else {}
    muon: list[dict[str, Any]] = []
    if optimizer_config.NAME == "muon":
        members, exempt, muon = _muon_groups(model, optimizer_config, lr_scheduler, labels, members, exempt)
        rate["algorithm"] = "adamw"
    out = [
        {"params": params, "name": label, "lr_group": i, **rate}
        for i, (label, params) in enumerate(zip(labels, members, strict=True))
    ]
    out += [
        {"params": params, "name": label, "lr_group": i, **rate, "weight_decay": 0.0}
        for i, (label, params) in enumerate(zip(labels, exempt, strict=True))
        if params
    ]
    return out + muon


def _muon_groups(
    model: nn.Module,
    optimizer_config: OptimizerConfig,
    lr_scheduler: LRSchedulerConfig,
    labels: list[str],
    members: list[list[nn.Parameter]],
    exempt: list[list[nn.Parameter]],
) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]], list[dict[str, Any]]]:
    """``members`` and ``exempt`` (per LR group) less the Muon side's parameters, and the Muon
    side's groups (see ``parameter_groups``)."""
    from ...optim.muon import muon_split

    split = muon_split(model, optimizer_config.MUON)
    names = {id(p): n for n, p in model.named_parameters()}
    to_muon = set(split.muon)
    scale = optimizer_config.MUON.LR / lr_scheduler.BASE_LR
    side = {"algorithm": "muon", "lr_scale": scale}
    muon: list[dict[str, Any]] = []
    for lists, decay in ((members, optimizer_config.MUON.WEIGHT_DECAY), (exempt, 0.0)):
        for i, params in enumerate(lists):
            moved = [p for p in params if names[id(p)] in to_muon]
            if moved:
                lists[i] = [p for p in params if names[id(p)] not in to_muon]
                muon.append(
                    {"params": moved, "name": labels[i], "lr_group": i, **side, "weight_decay": decay}
                )
    return members, exempt, muon


def build_optimizer(
    optimizer: OptimizerFactory | torch.optim.Optimizer,
    model: nn.Module,
    optimizer_config: OptimizerConfig,
    lr_scheduler: LRSchedulerConfig,
    device: torch.device | None = None,
    *,
    from_config: OptimizerFactory = default_optimizer,
) -> torch.optim.Optimizer:
    """The run's optimizer: built from OPTIMIZER (the Trainer's default, ``default_optimizer``), by
    the factory given from ``parameter_groups``, or the optimizer given. OPTIMIZER settings that
    the one given would not read are ConfigErrors (``optim.groups.unused_settings``); so are
    settings of a built-in optimizer that would fail its first step on ``device``, the one the run
    trains on (default: Accelerate's device for this process, the Accelerator's once it exists).
    ``from_config``: how the default is built (the Trainer's: the optimizer registry handed the
    run's whole config, since a registered builder may read any section)."""
    if optimizer is default_optimizer:
        built = from_config(parameter_groups(model, optimizer_config, lr_scheduler))
        check_first_step(built, optimizer_config, device)
        return built
    given = isinstance(optimizer, torch.optim.Optimizer)
    if unused := unused_settings(optimizer_config, built=given):
        raise ConfigError(unused)
    expected = 1 + len(lr_scheduler.PARAMETER_GROUPS)
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != expected:
            raise ConfigError(
                [
                    (
                        "LR_SCHEDULER.PARAMETER_GROUPS",
                        f"the optimizer given has {len(optimizer.param_groups)} parameter groups but the LR schedule has {expected} (default + PARAMETER_GROUPS): pass an optimizer factory instead",
                    )
                ]
            )
        return optimizer
    return optimizer(parameter_groups(model, optimizer_config, lr_scheduler))


def as_loader(
    data_config: DataConfig,
    seed: int,
    data: Dataset[Any] | DataLoader[Any],
    train: bool,
    rank: int,
    world_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
) -> Loader:
    """A map-style dataset gets the epoch-seeded sampler; an IterableDataset (or a DataLoader
    over one) is sharded across processes and workers by ``StreamShard``; a DataLoader over a
    map-style dataset is used as given, once its batch size is checked against the config.
    ``pin_memory`` (on a GPU): the loaders built here put batches in page-locked memory, so that
    copying them to the device neither waits for the device nor stops the host from running ahead.
    ``data_config``: the config's DATA section; ``seed``: EXPERIMENT.SEED (the order data is read in)."""
    key = "DATA.BATCH_SIZE" if train else "DATA.BATCH_SIZE_VAL"
    expected = data_config.BATCH_SIZE if train else (data_config.BATCH_SIZE_VAL or data_config.BATCH_SIZE)
    if isinstance(data, DataLoader) and data.batch_size != expected:
        raise ConfigError(
            [
                (
                    key,
                    f"is {expected} but the DataLoader given batches {data.batch_size}: the schedule is resolved from {key}",
                )
            ]
        )
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset):
        given = data if isinstance(data, DataLoader) else None
        drop_last = data_config.DROP_LAST if train else False
        try:
            loader = stream_loader(
                dataset,
                batch_size=expected,
                world_size=world_size,
                rank=rank,
                num_workers=given.num_workers if given is not None else data_config.NUM_WORKERS,
                drop_last=drop_last,
                collate_fn=given.collate_fn if given is not None else collate_fn,
                pin_memory=pin_memory,
                seed=seed,
                shuffle=train
                and data_config.SHUFFLE,  # a sharded stream's shard order; validation: as listed
            )
        except StreamError as exc:
            raise ConfigError([("DATA", f"{'training' if train else 'validation'} data: {exc}")]) from None
        # A stream read shard by shard ends where its readers run out, whatever its __len__ says.
        size = loader.shard.size if isinstance(loader.shard, StreamShard) else None
        batches = None if size is None else batches_per_process(size, expected, world_size, drop_last)
        shield_workers(loader)
        return Loader(loader, dataset, loader.shard.collate_fn, size, expected, batches, stream=True)
    sampler = None
    if not isinstance(data, DataLoader):
        data = make_dataloader(data_config, seed, data, train, collate_fn, pin_memory=pin_memory)
        sampler = data.sampler
    elif data.generator is None:
        # Else creating its iterator would draw from the global RNG and shift a resumed run's dropout.
        data.generator = torch.Generator()
    shield_workers(data)  # a job-wide SIGTERM must reach the preemption watch, not kill the workers
    size = len(data.sampler)  # type: ignore[arg-type]
    return Loader(data, dataset, data.collate_fn, size, expected, None, stream=False, sampler=sampler)


def shared_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters every task head depends on, for GradNorm: ``model.shared_parameters()``
    when the model defines it, else every parameter outside modules named ``head*``."""
    own = getattr(model, "shared_parameters", None)
    if callable(own):
        return list(own())
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and not name.split(".")[0].startswith("head")
    ]


def model_vocabulary(model: nn.Module) -> tuple[int, str] | None:
    """The token ids ``model`` takes (``[0, size)``) and, in words, what says so: the smaller of its
    input embedding's rows and its output embedding's outputs (a transformers model's
    ``get_input_embeddings``, ``get_output_embeddings``), else its config's ``vocab_size``; None
    when the model tells neither."""
    found = []
    for getter, size_of, words in (
        ("get_input_embeddings", "num_embeddings", "the model's input embedding rows"),
        ("get_output_embeddings", "out_features", "the model's output embedding size"),
    ):
        get = getattr(model, getter, None)
        try:
            size = getattr(get(), size_of, None) if callable(get) else None
        except (NotImplementedError, AttributeError):  # a transformers model without one
            size = None
        if isinstance(size, int) and size > 0:
            found.append((size, words))
    configured = getattr(getattr(model, "config", None), "vocab_size", None)
    if not found and isinstance(configured, int) and configured > 0:
        found.append((configured, "the model's config vocab_size"))
    return min(found) if found else None


def check_token_ids(model_config: ModelConfig, model: nn.Module, train: Loader, val: Loader | None) -> None:
    """Token datasets (``TokenFiles``, alone or in a mixture) refuse, from now on, every window
    holding an id the model has no row for (``TokenOutOfVocab``: the run stops on it). Refused here,
    as ConfigErrors before anything runs: a model smaller than what the data declares (its
    ``vocab_size``, its sidecars' ``max_token_id``), and an id outside the vocabulary in the first
    training windows, which the task's checks read next. ``model_config``: the config's MODEL section
    (whether its OPTIONS set the vocabulary size)."""
    known = model_vocabulary(model)
    size, words = known if known is not None else (NO_LIMIT, "")
    tokens_in_train = False
    for loader, data in ((train, "training data"), (val, "validation data")):
        if loader is None or not limit_token_ids(loader.dataset, size, words):
            continue  # only token datasets check their windows (and say which ids they hold)
        tokens_in_train |= loader is train
        if known is not None and (found := vocabulary_shortfall(size, loader.dataset)) is not None:
            least, why = found
            why = why.replace("the training data", f"the {data}")
            if model_config.OPTIONS.get("vocab_size") == size:  # as the task's check words it
                raise ConfigError([(VOCAB_KEY, f"is {size}, but {why}; set it to at least {least}")])
            fix = f"give it at least {least} ({VOCAB_KEY} for hf_causal_lm)"
            raise ConfigError([("MODEL", f"{words} are {size}, but {why}; {fix}")])
    if not tokens_in_train or isinstance(train.dataset, IterableDataset):
        return
    try:
        for k in range(min(2, len(train.dataset))):  # what task_checks.first_batch reads next
            train.dataset[k]
    except TokenOutOfVocab as exc:
        raise ConfigError([("DATA.DATASET", str(exc))]) from None


class Prepared(NamedTuple):
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train: BatchSource
    val: BatchSource | None
    batches_per_epoch: int | None  # per process (None: a stream of unknown length)


def prepare_run(
    acc: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train: Loader,
    val: Loader | None,
    *,
    seed: int,
    data: DataConfig,
    model_config: ModelConfig,
    schedule: ScheduleConfig,
) -> Prepared:
    """The model, optimizer and map-style loaders through ``accelerator.prepare``; a stream loader
    shards itself, so Accelerate must not shard it again. ``seed``: EXPERIMENT.SEED; ``data``,
    ``model_config``, ``schedule``: the config's DATA, MODEL and SCHEDULE sections."""
    check_token_ids(model_config, model, train, val)  # the model as given: its embedding is whole
    if train.stream:
        model, optimizer = acc.prepare(model, optimizer)
        train_loader, per_epoch = train.loader, train.batches_per_epoch
    else:
        model, optimizer, train_loader = acc.prepare(model, optimizer, train.loader)
        per_epoch = len(train_loader)
    train_batches = BatchSource(
        acc, train_loader, train.size, train.batch_size, stream=train.stream, seed=seed,
        sampler=train.sampler, drop_last=data.DROP_LAST,
    )  # fmt: skip
    # SCHEDULE.VALIDATION.MAX_BATCHES: a fixed budget of the validation split (validation_data)
    val_batches = None if val is None else validation_batches(acc, schedule.VALIDATION, seed, val)
    return Prepared(model, optimizer, train_batches, val_batches, per_epoch)


def data_facts(dataset: Any) -> dict[str, Any]:
    """What the plan needs to know of the training data beyond its size (``resolve_plan``'s
    ``tokens_per_sample`` and ``sources``), as the dataset declares it."""
    describe = getattr(dataset, "describe", None)
    return {
        "tokens_per_sample": getattr(dataset, "tokens_per_sample", None),
        "sources": describe() if callable(describe) else (),
    }
