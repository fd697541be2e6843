"""Species photos: our whole training loop against a hand-written Accelerate loop, our species
dataset's loading against a bare DataLoader, and the memory of building the dataset by rows.

The data is written here, deterministically: JPEGs made with Pillow (smooth random colour fields
with a little noise, 256x192, as a photo compresses) and a ``labels.h5`` in linnaeus' layout
(``write_labels_h5``: three ranks, the species null in 1 row of 20, spatial and temporal metadata,
some rows without coordinates). The model is ``hf_vision``: a two-stage ConvNeXt (widths 8 and
16) with the metadata branch and one head per rank, at 32 px, batch 16. See benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import Row, paired, pin_to_one_core, row
from .data_loading import Endless
from .lockstep import LAUNCH_VARIABLES, REPO, Baton, Segment, pooled, run_segments
from .step_overhead import check_same_loss
from .workloads import MLP_OPTS, fit_timed, seeded_model

BENCHMARK = "species"
OURS_SIDE = "benchmarks.species:run_ours"
HAND_SIDE = "benchmarks.species:run_hand"
HAND = "hand-written Accelerate loop"
PHOTO = (256, 192)  # width, height
IMG_SIZE, BATCH, SEED = 32, 16, 0
RANKS = ("taxa_L10", "taxa_L20", "taxa_L30")  # species, genus, family: finest first, as TASK_KEYS_H5
CONVNEXT = {"model_type": "convnext", "depths": [1, 1], "hidden_sizes": [8, 16], "num_stages": 2}
TARGET_RATE = 0.97  # ours' images/s >= this share of the hand loop's
TARGET_FLAT = 1.10
# photos: 640 give a training split of 576, 36 full batches an epoch; rounds: the lock-step's per
# case, by DataLoader workers (split over 4 runs); load: rounds, batches per turn, worker counts;
# mem: (small, large) rows of the labels file and rounds.
FULL: dict[str, Any] = {
    "photos": 640,
    "rounds": {0: 320, 2: 320},
    "aa": 320,
    "load": (30, 6, (0, 2)),
    "mem": (10_000, 200_000, 3),
}
SMOKE: dict[str, Any] = {
    "photos": 160,  # a training split of 144: 9 full batches
    "rounds": {0: 12},
    "aa": 0,
    "load": (2, 2, (0,)),
    "mem": (1_000, 20_000, 1),
}
WORKER_PAIRS = 2
SETTLE_S = 0.2  # after a data-loading turn with workers: their queued batches are done well within it


# -- the data ----------------------------------------------------------------------------------------
def write_labels(path: Path, rows: int) -> list[str]:
    """A labels.h5 of ``rows`` rows; returns the photos' file names."""
    import numpy as np

    from linnaeus_accel.data.species.labels import write_labels_h5

    rng = np.random.default_rng(SEED)
    index = np.arange(rows)
    species = (index * 7919) % 48
    names = [f"obs_{i:07d}.jpg" for i in range(rows)]
    taxa = {  # a species under one genus, a genus under one family
        "taxa_L10": np.where(index % 20 == 7, 0, 1000 + species),
        "taxa_L20": 100 + species // 4,
        "taxa_L30": 10 + species // 16,
    }
    spatial = rng.normal(size=(rows, 3))
    spatial /= np.linalg.norm(spatial, axis=1, keepdims=True)
    spatial[index % 25 == 3] = 0.0  # no coordinates
    day = 2 * np.pi * (index % 365) / 365
    write_labels_h5(
        path, names, taxa, {"spatial": spatial, "temporal": np.stack([np.sin(day), np.cos(day)], 1)}
    )
    return names


def write_species(root: Path, photos: int) -> tuple[Path, Path]:
    """(labels.h5, folder of JPEGs) of ``photos`` rows under ``root``."""
    import numpy as np
    from PIL import Image

    images = root / "images"
    images.mkdir(parents=True)
    rng = np.random.default_rng(SEED)
    for name in write_labels(root / "labels.h5", photos):
        field = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(
            PHOTO, Image.Resampling.BICUBIC
        )
        noisy = np.asarray(field, dtype=np.int16) + rng.integers(-8, 9, (PHOTO[1], PHOTO[0], 3))
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(images / name, quality=90)
    return root / "labels.h5", images


def species_config(spec: dict[str, Any]) -> Any:
    """linnaeus' DATA keys over the files of ``spec`` (``labels``, ``images``, ``workers``), hf_vision,
    the hierarchical task with metadata masking and mixup off (augmentation a hand loop would call
    too, not loop overhead: as ``step_overhead``), ``steps`` optimizer steps, no validation."""
    from linnaeus_accel.config import load_config

    steps = spec.get("steps", 1)
    data = {
        "BATCH_SIZE": BATCH,
        "NUM_WORKERS": spec["workers"],
        "TASK_KEYS_H5": list(RANKS),
        "PARTIAL": {"LEVELS": True},
        "IMG_SIZE": IMG_SIZE,
        "H5": {"LABELS_PATH": spec["labels"], "TRAIN_VAL_SPLIT_RATIO": 0.9},
        "HYBRID": {"USE_HYBRID": True, "IMAGES_DIR": spec["images"]},
        "DATASET": {"OPTIONS": {"augment": "randaugment", "erasing": 0.25}},
    }
    schedule = {
        "METRICS": {"STEP_INTERVAL": 10},
        "VALIDATION": {"INTERVAL_STEPS": steps},
        "CHECKPOINT": {"INTERVAL_STEPS": steps, "KEEP_LAST_N": 1, "KEEP_TOP_N": 0},
    }
    cfg = {
        "EXPERIMENT": {"NAME": spec.get("name", "species"), "SEED": SEED},
        "ENV": {"OUTPUT": {"BASE_DIR": spec.get("out", "outputs")}},
        "DATA": data,
        "MODEL": {"TYPE": "hf_vision", "OPTIONS": {"config": {**CONVNEXT, "image_size": IMG_SIZE}}},
        "TASK": {"NAME": "hierarchical"},
        "TRAIN": {"STEPS": steps, "CLIP_GRAD": 5.0, "AUTO_RESUME": False},
        "LR_SCHEDULER": {"REFERENCE_BS": None},
        "SCHEDULE": schedule,
    }
    return load_config(cfg, MLP_OPTS)


# -- the two loops (sides of the lock-step, in worker processes) ------------------------------------
def run_ours(spec: dict[str, Any], baton: Baton) -> dict[str, Any]:
    """Our ``Trainer.fit``, timed at its ``fault_point("optimizer_step")`` (``workloads.fit_timed``);
    the schedule plot (matplotlib on a thread at start-up) not drawn, as in ``nanogpt_step``."""
    from linnaeus_accel import Trainer
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.run_directory import outputs

    config = species_config(spec)
    train = build_dataset(config, "train")
    model = seeded_model(config, train)
    real_draw = outputs._draw_schedule
    setattr(outputs, "_draw_schedule", lambda *args: None)  # noqa: B010
    try:
        trainer, losses = fit_timed(lambda: Trainer(config, model, train, None), baton)
    finally:
        setattr(outputs, "_draw_schedule", real_draw)  # noqa: B010
    return {"losses": losses, "steps_per_epoch": trainer.plan.optimizer_steps_per_epoch}


def run_hand(spec: dict[str, Any], baton: Baton) -> dict[str, Any]:
    """``workloads.run_hand``'s loop for this task, one micro-batch a step: the dataset and
    DataLoader the Trainer builds (same sampler: the same batches and keyed transforms), a
    cross-entropy per rank over its labelled samples (``ignore_index``), AdamW, clipping, the LR
    set before each step, losses added up on the device and read back with the gradient norm each
    logging interval, a JSON line and a progress bar. Stops when the referee ends the lock-step."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.data.sampling import make_dataloader
    from linnaeus_accel.schedule import resolve_plan

    config = species_config(spec)
    train = build_dataset(config, "train")
    accelerator = Accelerator()
    set_seed(config.EXPERIMENT.SEED)
    model = seeded_model(config, train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    loader = make_dataloader(config.DATA, config.EXPERIMENT.SEED, train, True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    parameters = list(model.parameters())
    plan = resolve_plan(config, len(loader), 1, len(train))
    interval, clip = plan.metrics_interval, config.TRAIN.CLIP_GRAD
    sums = torch.zeros(1 + len(train.levels), device=accelerator.device)  # the loss, each rank's
    logged: dict[int, float] = {}
    step, samples, since = 0, 0, time.perf_counter()
    out = Path(spec["out"]) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    assert plan.epochs is not None  # a map-style dataset: whole epochs
    result = {"losses": logged, "steps_per_epoch": plan.optimizer_steps_per_epoch}
    bar = tqdm(total=plan.total_steps, desc="train", unit="step", dynamic_ncols=True)
    model.train()
    with (out / "metrics.jsonl").open("w") as metrics:
        for epoch in range(1, plan.epochs + 1):  # 1-based, as the trainer counts: it keys the sampler
            loader.set_epoch(epoch)
            for batch in loader:
                labels = batch["labels"]
                logits = model(batch)
                levels = torch.stack(
                    [F.cross_entropy(lg, labels[:, i], ignore_index=-1) for i, lg in enumerate(logits)]
                )
                loss = levels.sum()
                accelerator.backward(loss)
                sums += torch.cat([loss.detach()[None], levels.detach()])
                samples += len(labels)
                for group in optimizer.param_groups:
                    group["lr"] = plan.lr(step)
                norm = accelerator.clip_grad_norm_(parameters, clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if not baton() or step >= plan.total_steps:
                    bar.close()
                    return result
                if step % interval == 0:
                    values = torch.cat([sums, norm[None]]).tolist()
                    sums.zero_()
                    now = time.perf_counter()
                    record = {"global_step": step, "train/loss": values[0] / interval}
                    record |= {f"train/loss_{k}": v / interval for k, v in enumerate(values[1:-1])}
                    record |= {"lr/default": plan.lr(step - 1), "train/grad_norm": values[-1]}
                    record["perf/samples_per_s"] = samples / (now - since)
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    logged[step], samples, since = record["train/loss"], 0, now
                    bar.set_postfix({"loss": f"{record['train/loss']:.4f}"}, refresh=False)
                bar.update(1)
    bar.close()
    return result


def rates(segments: list[Segment]) -> tuple[list[float], list[float]]:
    """Both sides' images/s per optimizer step, pooled over the runs (``lockstep.pooled``)."""
    ours, hand = pooled(segments)
    return [BATCH / t for t in ours], [BATCH / t for t in hand]


def loop_rows(files: dict[str, str], sizes: dict[str, Any], smoke: bool) -> list[Row]:
    pairs, segments = (1, 1) if smoke else (WORKER_PAIRS, 2 * WORKER_PAIRS)
    cases = [(f"whole loop, {w} workers", w, OURS_SIDE, n) for w, n in sizes["rounds"].items()]
    if sizes["aa"]:
        cases.append(("A/A control: hand loop vs hand loop, 0 workers", 0, HAND_SIDE, sizes["aa"]))
    jobs = []
    for case, workers, side, total in cases:
        spec = {**files, "workers": workers, "steps": total // segments + 1}
        jobs.append((case, {**spec, "side": side}, {**spec, "side": HAND_SIDE}, total // segments))
    results = run_segments(jobs, pairs, swap=not smoke)
    out: list[Row] = []
    for case, workers, side, _ in cases:
        stats = paired(*rates(results[case]))
        control = side == HAND_SIDE
        # With DataLoader workers a side's workers fill its queue during the other side's turn, so
        # a step's time depends on the other side's: reported, not judged.
        judged = not control and workers == 0
        per_run = [paired(*rates([segment]))["ratio"] for segment in results[case]]
        notes = [
            "the noise floor" if control else check_same_loss(*results[case][0]),
            "per run " + ", ".join(f"{r:.3f}" for r in per_run),
            f"a step: {BATCH / stats['ours'] * 1e3:.1f} ms vs {BATCH / stats['reference'] * 1e3:.1f} ms",
        ]
        if workers:
            notes.append("each side's workers run during the other's turn: see benchmarks/README.md")
        out.append(
            row(
                BENCHMARK,
                case,
                f"images/s (batch {BATCH} at {IMG_SIZE} px, per optimizer step)",
                HAND,
                **stats,
                target=f"ratio >= {TARGET_RATE}" if judged else None,
                ok=stats["ratio"] >= TARGET_RATE if judged and not smoke else None,
                note="; ".join(notes),
            )
        )
    return out


# -- data loading ------------------------------------------------------------------------------------
def hand_dataset(labels: Path, images: Path, rows: Any, transforms: Any) -> Any:
    """A species dataset as one writes it by hand: the labels file read whole at start (class
    indices per rank, coarse to fine, -1 where null; the metadata arrays), and in ``__getitem__``
    the same decode (``load_image``) and transforms (epoch 0, keyed by the index) as ours."""
    import h5py  # type: ignore[import-untyped]
    import numpy as np
    import torch
    from torch.utils.data import Dataset

    from linnaeus_accel.data.species.images import load_image

    class HandWritten(Dataset[dict[str, Any]]):
        def __init__(self) -> None:
            with h5py.File(labels, "r") as f:
                self.names = f["img_identifiers"].asstr()[()].tolist()
                columns = []
                for key in reversed(RANKS):
                    ids = f[key][()].astype(np.int64)
                    classes = np.unique(ids[ids != 0])  # class 0 is null (partial levels): ids from 1
                    columns.append(np.where(ids == 0, -1, np.searchsorted(classes, ids) + 1))
                self.labels = np.stack(columns, axis=1)
                self.meta = {name: f[name.lower()][()].astype(np.float32) for name in ("TEMPORAL", "SPATIAL")}
            self.rows = np.asarray(rows)

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, Any]:
            r = int(self.rows[i])
            image = transforms(load_image(images / self.names[r], IMG_SIZE), SEED, 0, i)
            meta = {name: torch.from_numpy(values[r]) for name, values in self.meta.items()}
            return {"index": i, "image": image, "meta": meta, "labels": torch.from_numpy(self.labels[r])}

    return HandWritten()


def same_sample(ours: Any, hand: Any) -> None:
    """Both datasets give sample 0 alike (image, labels, metadata), or the comparison is void."""
    import torch

    a, b = ours[(0, 0)], hand[0]
    tensors = [(a["image"], b["image"]), (a["labels"], b["labels"])]
    if not all(torch.equal(x, y) for x, y in tensors + [(a["meta"][k], b["meta"][k]) for k in a["meta"]]):
        raise AssertionError("the hand-written species dataset does not give what ours gives for sample 0")


def turns(sides: dict[str, Endless], rounds: int, per_turn: int, workers: int) -> dict[str, list[float]]:
    """Images/s of each side, per round: turns of ``per_turn`` batches, the first side rotating, as
    ``data_loading`` takes them: the batches a side's workers made ready since its last turn
    (DataLoader's prefetch_factor 2 x workers) taken first, untimed, and a pause after each turn
    (untimed) so that no side's workers run during another's turn."""
    names = list(sides)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(2 * workers):
                next(sides[name])
            started = time.perf_counter()
            images = sum(next(sides[name])["image"].shape[0] for _ in range(per_turn))
            out[name].append(images / (time.perf_counter() - started))
            time.sleep(SETTLE_S if workers else 0.0)
    return out


def measure_loading(
    files: dict[str, str], workers: int, rounds: int, per_turn: int
) -> dict[str, list[float]]:
    """With 0 workers on one core, one torch thread; with 2, the workers on every core."""
    import torch
    from torch.utils.data import DataLoader

    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.data.sampling import make_dataloader

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if workers == 0:
        pin_to_one_core()
    torch.set_num_threads(1)
    try:
        config = species_config({**files, "workers": workers})
        ours = build_dataset(config, "train")
        hand = hand_dataset(Path(files["labels"]), Path(files["images"]), ours.rows, ours.transforms)
        same_sample(ours, hand)

        # Persistent workers on both sides, as the Trainer's: an epoch's end (inside some turns)
        # restarts no worker.
        def plain() -> DataLoader[Any]:
            return DataLoader(hand, BATCH, shuffle=True, num_workers=workers, persistent_workers=workers > 0)

        sides = {
            "ours": Endless(make_dataloader(config.DATA, SEED, ours, train=True)),
            "bare": Endless(plain()),
            "bare again": Endless(plain()),
        }
        turns(sides, 1, per_turn, workers)  # warm-up: workers started, the photos in the page cache
        return turns(sides, rounds, per_turn, workers)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def loading_rows(files: dict[str, str], sizes: dict[str, Any]) -> list[Row]:
    rounds, per_turn, worker_counts = sizes["load"]
    out: list[Row] = []
    for workers in worker_counts:
        started = time.perf_counter()
        rate = measure_loading(files, workers, rounds, per_turn)
        medians = ", ".join(f"{name} {statistics.median(v):.0f}" for name, v in rate.items())
        note = (
            f"{rounds} rounds of {per_turn} batches of {BATCH} per side, {workers} workers; median "
            f"images/s {medians}; {time.perf_counter() - started:.0f} s"
        )
        for name, case in (("ours", "data loading"), ("bare again", "A/A: bare vs bare")):
            stats = paired(rate[name], rate["bare"])
            reference = "DataLoader(shuffle=True) over a hand-written dataset, the same decode and transforms"
            out.append(
                row(BENCHMARK, f"{case}, {workers} workers", "images/s", reference, **stats, note=note)
            )
    return out


# -- memory by rows ----------------------------------------------------------------------------------
def peak_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build_only(labels: Path) -> dict[str, Any]:
    """What ``linnaeus_h5`` builds (``data/species/build.py``) but ``check_images`` (a listing of
    the photos, which are not there): the labels file, the taxonomy from every row, the split, the
    dataset; then one label row read. The peak before (imports done) and after."""
    import h5py  # noqa: F401  (imported before the first peak: its libraries are not the data's)
    import numpy as np

    from linnaeus_accel.data.species.dataset import SpeciesDataset
    from linnaeus_accel.data.species.images import ImageTransforms
    from linnaeus_accel.data.species.labels import ComponentSpec, LabelsFile, split_indices
    from linnaeus_accel.data.species.taxonomy import Taxonomy

    before = peak_mib()
    components = [ComponentSpec("TEMPORAL", "temporal", 2, 0), ComponentSpec("SPATIAL", "spatial", 3, 1)]
    source = LabelsFile(labels, RANKS, components)
    columns = source.taxa_columns()
    ids = [columns[key] for key in RANKS]
    taxonomy = Taxonomy(ids, RANKS, partial_levels=True)
    kept = np.flatnonzero(taxonomy.keep_rows(ids)).astype(np.int64)
    train, _ = split_indices(kept.size, 0.9, SEED)
    del columns, ids
    transforms = ImageTransforms(IMG_SIZE, True)
    dataset = SpeciesDataset(source, kept[train], taxonomy, labels.parent / "images", transforms, seed=SEED)
    dataset.labels_of(source.row(int(dataset.rows[0])))
    return {"rows": len(source), "before": before, "after": peak_mib()}


def memory_rows(root: Path, sizes: dict[str, Any], smoke: bool) -> list[Row]:
    small, large, rounds = sizes["mem"]
    paths = {n: root / f"labels_{n}.h5" for n in (small, large)}
    for n, path in paths.items():
        write_labels(path, n)
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    found: dict[int, list[dict[str, Any]]] = {small: [], large: []}
    command = [sys.executable, "-m", "benchmarks.species", "--memory"]
    for _ in range(rounds):
        # Both at once: a process's peak resident memory does not depend on what else runs.
        children = {
            n: subprocess.Popen(
                [*command, str(path)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for n, path in paths.items()
        }
        for n, child in children.items():
            stdout, stderr = child.communicate(timeout=300)
            if child.returncode:
                raise RuntimeError(f"building the dataset of {n} rows failed:\n{stderr.decode()[-3000:]}")
            found[n].append(json.loads(stdout.decode().splitlines()[-1]))
    stats = paired([r["after"] for r in found[large]], [r["after"] for r in found[small]])
    growth = {n: statistics.median(r["after"] - r["before"] for r in runs) for n, runs in found.items()}
    note = (
        f"a fresh process each, {rounds} round(s); peak after its imports "
        f"{statistics.median(r['before'] for r in found[small]):.0f} MiB; the build's own: {small:,} rows "
        f"+{growth[small]:.1f} MiB, {large:,} rows +{growth[large]:.1f} MiB: "
        f"{stats['diff'] * 2**20 / (large - small):.0f} bytes a row (the taxa columns: {4 * len(RANKS)})"
    )
    case = f"build memory, {large // 1000}k vs {small // 1000}k rows"
    fields = {
        "target": f"ratio <= {TARGET_FLAT:.2f} (flat)",
        "ok": None if smoke else stats["ratio"] <= TARGET_FLAT,
    }
    return [row(BENCHMARK, case, "MiB peak RSS", f"{small:,} rows", **stats, **fields, note=note)]


def run(smoke: bool) -> list[Row]:
    import importlib.util

    sizes = SMOKE if smoke else FULL
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-species-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        labels, images = write_species(Path(tmp) / "photos", sizes["photos"])
        files = {"labels": str(labels), "images": str(images)}
        if importlib.util.find_spec("transformers") is None:
            note = "skipped: pip install -e '.[bench]' (hf_vision builds a transformers model)"
            rows.append(row(BENCHMARK, "whole loop", "images/s", HAND, note=note))
        else:
            rows += loop_rows(files, sizes, smoke)
        rows += loading_rows(files, sizes)
        rows += memory_rows(Path(tmp), sizes, smoke)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] != ["--memory"] or len(sys.argv) != 3:
        sys.exit("python -m benchmarks --only species runs this benchmark")
    print(json.dumps(build_only(Path(sys.argv[2]))))
