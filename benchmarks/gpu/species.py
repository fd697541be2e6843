"""Part ``species``: ``configs/species.yaml`` with a ConvNeXt-Tiny-sized backbone (``hf_vision``
built from a config, random weights) at 224 px, batch 64, bf16, DataLoader workers decoding real
JPEGs of about 300 px; images/s of ``linnaeus-accel`` against a hand-written Accelerate loop, and
what ``MODEL.OPTIONS.channels_last`` gains.

The photos are ``write_synthetic_species``'s (several writers at once, each a shard of its own, their
labels merged into one ``labels.h5``), enough that no side reaches a second epoch. Three sides take
turns on the GPU as in part ``throughput`` (its ``Referee``, the processes of ``sides``), a block
of ``block`` optimizer steps at a time: ours (``Trainer.fit`` on the recipe, channels-last), the
hand-written loop (channels-last) and ours in the default memory order. Every side sets
``torch.backends.cudnn.benchmark`` (the trainer does not: a script sets it before ``fit``), so the
sides' set-up and first block (where cuDNN times its candidate kernels) run one after the other: a
kernel timed while another side runs could be picked slower than it is, for the rest of that side's
run. Their imports run at once, before that.

The hand-written loop is the one a user writes for this recipe: the dataset and DataLoader the
Trainer builds (the same sampler: the same batches and keyed transforms), pinned and copied without
blocking, the same model (``build_model``), AdamW over the recipe's parameter groups (its backbone
LR multiplier, no decay on biases and norms), the LR set before each step, a cross-entropy per rank
over its labelled samples, clipping, the loss read back once per block. benchmarks/species.py's
hand loop is not reused: its sizes are fixed and it reads batches unpinned, as on a CPU.

Metadata masking and mixup are off (``workloads.MLP_OPTS``): augmentation a hand loop would call too,
not loop overhead; so are validation and checkpoints inside the run. Each side's DataLoader workers
fill its queue (2 x workers batches) during the others' turns, so a block starts with that many
batches ready: the rates are the loop's and the GPU's with the data's head start, the same for every
side; ``perf/data_time_share`` and the decode cost per image say how near the workers are to
being what sets the pace.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .common import CONFIGS, Context, Part, metrics
from .sides import BlockBaton, run_ours, worker
from .throughput import Referee

NAME = "species"
TITLE = "configs/species.yaml, ConvNeXt-T at 224 px, bf16, JPEG workers: ours vs hand-written, channels-last"
RECIPE = CONFIGS / "species.yaml"
TARGET = 0.97
# name -> (loop, channels_last): the comparison, then what channels-last gains on ours.
SIDES: dict[str, tuple[str, bool]] = {
    "ours": ("ours", True),
    "accelerate": ("accelerate", True),
    "ours, channels first": ("ours", False),
}
CONVNEXT_T = {
    "model_type": "convnext", "num_channels": 3, "patch_size": 4, "num_stages": 4,
    "depths": [3, 3, 9, 3], "hidden_sizes": [96, 192, 384, 768], "image_size": 224,
}  # fmt: skip
# The one-stage ConvNeXt of the test suite's species helpers: the smallest that trains.
TINY_CONVNEXT = {
    "model_type": "convnext", "num_channels": 3, "depths": [1], "hidden_sizes": [8], "num_stages": 1,
    "image_size": 32,
}  # fmt: skip
# photo: the JPEGs' side; block: optimizer steps a turn; workers: DataLoader workers a side.
# At full size about 90 s on an H100: 12k photos written in ~5 s, the sides' imports at once, their
# set-up and first block one at a time, 7 rounds of 3 blocks of ~1 s, a profiled block each.
FULL: dict[str, Any] = {
    "model": CONVNEXT_T, "img_size": 224, "photo": 300, "batch": 64, "workers": 8, "block": 20,
    "warmup": 1, "rounds": 6,
}  # fmt: skip
TINY: dict[str, Any] = {
    "model": TINY_CONVNEXT, "img_size": 32, "photo": 40, "batch": 4, "workers": 1, "block": 2,
    "warmup": 0, "rounds": 2,
}  # fmt: skip
SPLIT = 0.95  # of the photos trained on (the rest would validate; nothing does here)
DECODE_SAMPLES = {"full": 64, "tiny": 2}  # photos decoded and transformed alone, for the cost per image


# -- the photos ----------------------------------------------------------------------------------------
def _write_shard(args: tuple[Path, int, int, int]) -> None:
    from linnaeus_accel.data.species.synthetic import write_synthetic_species

    root, rows, seed, size = args
    write_synthetic_species(root, rows, seed, size=size)


def write_photos(root: Path, rows: int, size: int, writers: int) -> tuple[Path, Path]:
    """``rows`` synthetic observations (``size`` px JPEGs) under ``root``, written by ``writers``
    processes at once, each a shard (``root/shard<k>/images``, seeded by its index); one
    ``root/labels.h5`` of every shard's rows, its identifiers relative to ``root``. Returns
    (labels.h5, the images' folder to name in DATA.HYBRID.IMAGES_DIR)."""
    import h5py  # type: ignore[import-untyped]
    import numpy as np

    from linnaeus_accel.data.species.labels import IDENTIFIERS, write_labels_h5
    from linnaeus_accel.data.species.synthetic import TASK_KEYS

    shards = [(root / f"shard{k}", rows // writers + (k < rows % writers), k, size) for k in range(writers)]
    shards = [shard for shard in shards if shard[1]]
    # Forked: the writers need numpy and Pillow only, already imported or cheap to import.
    with multiprocessing.get_context("fork").Pool(len(shards)) as pool:
        pool.map(_write_shard, shards)
    columns: dict[str, list[Any]] = {}
    for shard, *_ in shards:
        with h5py.File(shard / "labels.h5", "r") as f:
            for key in f:
                values = f[key].asstr()[()] if key == IDENTIFIERS else f[key][()]
                if key == IDENTIFIERS:
                    values = [f"{shard.name}/images/{name}" for name in values]
                columns.setdefault(key, []).append(values)
    merged = {key: np.concatenate(parts) for key, parts in columns.items()}
    names = merged.pop(IDENTIFIERS).tolist()
    taxa = {key: merged.pop(key) for key in TASK_KEYS}
    return write_labels_h5(root / "labels.h5", names, taxa, merged), root


def workers_that_fit(workers: int, batch_bytes: int, shm: str = "/dev/shm") -> tuple[int, float | None]:
    """(at most ``workers`` DataLoader workers a side whose batches fit in ``shm``, where workers
    hand them over: 2 queued a worker, every side's, twice over for those in flight; GiB free there).
    A container's default of 64 MB would end the run with a worker killed by a bus error."""
    try:
        stats = os.statvfs(shm)
    except OSError:
        return workers, None
    free = stats.f_bavail * stats.f_frsize
    return min(workers, free // (2 * len(SIDES) * 2 * batch_bytes)), round(free / 2**30, 1)


# -- the config and the two loops (in the sides' processes) ---------------------------------------------
def species_config(spec: dict[str, Any]) -> Any:
    """configs/species.yaml with what a measurement changes: the data, the sizes, the backbone,
    ``channels_last``, the length, no masking or mixup, no validation or checkpoint inside the run,
    metrics once a block."""
    from linnaeus_accel.config import load_config

    from ..workloads import MLP_OPTS

    opts = {
        "EXPERIMENT.NAME": spec["run_name"],
        "ENV.OUTPUT.BASE_DIR": spec["out"],
        "ENV.PROGRESS_BAR": "false",
        "DATA.H5.LABELS_PATH": spec["labels"],
        "DATA.H5.TRAIN_VAL_SPLIT_RATIO": str(SPLIT),
        "DATA.HYBRID.IMAGES_DIR": spec["images"],
        "DATA.IMG_SIZE": str(spec["img_size"]),
        "DATA.BATCH_SIZE": str(spec["batch"]),
        "DATA.NUM_WORKERS": str(spec["workers"]),
        "DATA.DROP_LAST": "true",
        "MODEL.OPTIONS.config": spec["model_json"],
        "MODEL.OPTIONS.channels_last": "true" if spec["channels_last"] else "false",
        "TRAIN.EPOCHS": "null",
        "TRAIN.STEPS": str(spec["steps"]),
        "TRAIN.AUTO_RESUME": "false",
        "SCHEDULE.VALIDATION.INTERVAL_FRACTION": "null",
        "SCHEDULE.VALIDATION.INTERVAL_STEPS": str(spec["steps"]),
        "SCHEDULE.VALIDATION.MASK_META_INTERVAL_FRACTION": "null",
        "SCHEDULE.CHECKPOINT.INTERVAL_FRACTION": "null",
        "SCHEDULE.CHECKPOINT.INTERVAL_STEPS": str(spec["steps"]),
        "SCHEDULE.METRICS.STEP_INTERVAL": str(spec["block"]),
    }
    return load_config(RECIPE, [*MLP_OPTS, *(item for pair in opts.items() for item in pair)])


def _gpu_settings() -> None:
    import torch

    # Autotuned convolution kernels, as a vision script asks for (the trainer leaves torch's default).
    torch.backends.cudnn.benchmark = True


def decode_ms(config: Any, count: int) -> float:
    """Milliseconds to read, decode and transform one training photo on one core (``count`` of them)."""
    import torch

    from linnaeus_accel.data import build_dataset

    train = build_dataset(config, "train")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        started = time.perf_counter()
        for index in range(count):
            train[(1, index)]
        return (time.perf_counter() - started) * 1e3 / count
    finally:
        torch.set_num_threads(threads)


def run_species_ours(spec: dict[str, Any], baton: BlockBaton) -> dict[str, Any]:
    """``Trainer.fit`` on the recipe (``sides.run_ours``); its logged records; with ``decode`` in the
    spec, the decode cost per photo measured after the lock-step (the GPU and the other sides idle)."""
    _gpu_settings()
    config = species_config(spec)
    result = run_ours(spec, baton, config)
    keys = ("global_step", "train/loss", "perf/samples_per_s", "perf/data_time_share")
    result["logged"] = [{k: r.get(k) for k in keys} for r in metrics(config.output_dir) if "train/loss" in r]
    if spec.get("decode"):
        result["decode_ms"] = decode_ms(config, spec["decode"])
    return result


def run_species_accelerate(spec: dict[str, Any], baton: BlockBaton) -> dict[str, Any]:
    """The hand-written Accelerate loop for the recipe, as its user would write it."""
    import itertools

    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.data.sampling import make_dataloader
    from linnaeus_accel.schedule import resolve_plan
    from linnaeus_accel.training.start.setup import parameter_groups

    from ..workloads import seeded_model

    _gpu_settings()
    config = species_config(spec)
    accelerator = Accelerator(
        mixed_precision="bf16" if spec["cuda"] else "no",
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
    )
    train = build_dataset(config, "train")
    model = seeded_model(config, train)  # the same weights as ours
    groups = parameter_groups(model, config.OPTIMIZER, config.LR_SCHEDULER)
    optim = config.OPTIMIZER
    optimizer = torch.optim.AdamW(groups, lr=0.0, betas=tuple(optim.BETAS), eps=optim.EPS)
    loader = make_dataloader(config.DATA, config.EXPERIMENT.SEED, train, True, pin_memory=spec["cuda"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plan = resolve_plan(config, len(loader), 1, len(train))
    clip, block = config.TRAIN.CLIP_GRAD, spec["block"]
    model.train()
    loss_sum = torch.zeros((), device=accelerator.device)
    logged: list[float] = []
    step = 0
    for epoch in itertools.count(1):  # 1-based, as the trainer counts: it keys the sampler
        loader.set_epoch(epoch)
        for batch in loader:
            labels = batch["labels"]
            ranks = [F.cross_entropy(lg, labels[:, i], ignore_index=-1) for i, lg in enumerate(model(batch))]
            loss = torch.stack(ranks).sum()
            accelerator.backward(loss)
            for group in optimizer.param_groups:
                group["lr"] = plan.lr(step, group["lr_group"])
            accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            step += 1
            if not baton():
                return {"logged": logged}
            if step % block == 0:
                logged.append(loss_sum.item() / block)
                loss_sum.zero_()
    raise AssertionError("unreachable: the loop above ends only through the baton")


LOOPS = {"ours": run_species_ours, "accelerate": run_species_accelerate}


# -- the part -------------------------------------------------------------------------------------------
def paired_median(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def run_part(ctx: Context) -> Part:
    import json

    part = Part(NAME, TITLE)
    sizes = FULL if ctx.full else TINY
    block, warmup, rounds, batch = sizes["block"], sizes["warmup"], sizes["rounds"], sizes["batch"]
    steps = (2 + warmup + rounds) * block  # the first block, the rounds, the profiled block
    root = ctx.work / NAME
    root.mkdir(parents=True, exist_ok=True)
    photos = math.ceil(steps * batch / SPLIT) + batch  # one epoch holds every side's steps
    writers = min(16, os.cpu_count() or 1) if ctx.full else 2
    started = time.perf_counter()
    labels, images = write_photos(root / "photos", photos, sizes["photo"], writers)
    part.figures["photos"] = {"count": photos, "side_px": sizes["photo"], "writers": writers,
                              "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    workers, shm_gib = workers_that_fit(sizes["workers"], batch * 3 * sizes["img_size"] ** 2 * 4)  # fp32
    part.figures["workers per side"] = workers
    if workers < sizes["workers"]:
        part.figures[f"workers fewer than {sizes['workers']}: /dev/shm GiB free"] = shm_gib
    spec = {
        "labels": str(labels), "images": str(images), "img_size": sizes["img_size"], "batch": batch,
        "workers": workers, "block": block, "steps": steps, "cuda": ctx.cuda, "compile": False,
        "model_json": json.dumps(sizes["model"]), "out": str(root / "runs"), "alone": True, "release": False,
    }  # fmt: skip
    specs = {
        side: {**spec, "side": loop, "channels_last": channels_last, "run_name": f"side{i}"}
        for i, (side, (loop, channels_last)) in enumerate(SIDES.items())
    }
    specs["ours"]["decode"] = DECODE_SAMPLES[ctx.size]
    ctx.say(f"species: {photos} photos, {steps} steps a side, blocks of {block}, {rounds} timed rounds")
    started = time.perf_counter()
    results = Referee(specs, root, ctx.cuda, module="benchmarks.gpu.species").play(
        warmup + rounds, first_timeout=300, alone=True
    )
    part.figures["seconds_to_first_block"] = round(time.perf_counter() - started, 1)
    rates = {side: [block * batch / t for t in results[side]["times"][warmup:]] for side in SIDES}
    for side in SIDES:
        part.check(f"{side}: every block timed", len(rates[side]) == rounds, f"{len(rates[side])} blocks")
    for side in SIDES:
        part.figures[f"{side} images/s"] = round(statistics.median(rates[side]), 1)
    ratio = paired_median(rates["ours"], rates["accelerate"])
    part.figures["ours / accelerate"] = round(ratio, 4)
    # A tiny CPU run checks that the comparison runs, not its figures.
    name = f"ours >= {TARGET} x accelerate" if ctx.full else "ours / accelerate measured"
    part.check(name, ratio >= TARGET if ctx.full else ratio > 0, f"median of paired ratios {ratio:.4f}")
    part.figures["channels-last speed-up (ours / ours, channels first)"] = round(
        paired_median(rates["ours"], rates["ours, channels first"]), 4
    )
    logged = results["ours"]["logged"]
    losses = [r["train/loss"] for r in logged if r.get("train/loss") is not None]
    part.check("ours: loss logged and finite", bool(losses) and all(map(math.isfinite, losses)), losses[:3])
    shares = [r["perf/data_time_share"] for r in logged if r.get("perf/data_time_share") is not None]
    if shares:
        share = statistics.median(shares)
        part.figures["ours perf/data_time_share as logged, lock-stepped (median)"] = round(share, 4)
        # Its clock runs through the other sides' turns too, while it waits for data only in its own.
        times = [results[side]["times"][warmup:] for side in SIDES]
        own = statistics.median(t[0] / sum(t) for t in zip(*times, strict=True))
        part.figures["ours data wait / its own blocks (estimate)"] = round(min(1.0, share / own), 4)
    decode = results["ours"].get("decode_ms")
    if decode:
        part.figures["decode + transforms, ms per photo (one core)"] = round(decode, 2)
        # Workers each make whole batches: at ours' rate they are busy this many at once.
        part.figures["workers busy at ours' rate"] = round(part.figures["ours images/s"] * decode / 1e3, 1)
    part.figures["batches ready at a turn's start"] = 2 * workers
    for side in SIDES:  # why a side is slower: the host's share of each block, its profile
        host, times = results[side]["host"][warmup:], results[side]["times"][warmup:]
        part.figures[f"{side} host queued / block (median)"] = round(
            statistics.median(h / t for h, t in zip(host, times, strict=True)), 3
        )
        part.figures[f"{side} profile"] = results[side]["diagnosis"]
    part.figures["losses (first logged)"] = {
        "ours": losses[0] if losses else None,
        "accelerate": (results["accelerate"]["logged"] or [None])[0],
    }
    part.figures["parameters"] = results["ours"]["parameters"]
    part.figures["images per block"] = block * batch
    part.figures["run_info"] = {
        k: results["ours"]["run_info"].get(k) for k in ("mixed_precision", "dynamo_backend", "device")
    }
    return part


if __name__ == "__main__":  # one side's process, started by the Referee
    # Imported while the side waits for its turn to set up: the sides' imports run at once.
    import accelerate  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import linnaeus_accel.training.trainer  # noqa: F401

    worker(int(sys.argv[1]), LOOPS)
