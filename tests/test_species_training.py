"""A linnaeus config trains on its own files: labels.h5 and a folder of JPEGs, a transformers
ConvNeXt with the metadata branch, per-rank and chain metrics; killed with SIGKILL mid-epoch (two
DataLoader workers, RandAugment and random erasing on), the same command ends with the same bytes
in final/ as the run that was never interrupted."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from helpers.in_process import run_cli
from helpers.processes import AFTER_FIRST_COMMIT
from helpers.runs import KILLED, TrainRun, assert_same_run, read_metrics, read_summary
from helpers.species import species_files

from linnaeus_accel.data.species.labels import write_labels_h5
from linnaeus_accel.data.species.taxonomy import Taxonomy

CONVNEXT = {
    "model_type": "convnext",
    "num_channels": 3,
    "depths": [1, 1],
    "hidden_sizes": [8, 16],
    "num_stages": 2,
    "image_size": 32,
}


def species_config(root: Path) -> str:
    """linnaeus' DATA keys, MODEL.TYPE hf_vision, a checkpoint every 2 of the 6 steps."""
    labels, images = species_files(root / "data")
    config = {
        "DATA": {
            "BATCH_SIZE": 4,
            "NUM_WORKERS": 2,
            "TASK_KEYS_H5": ["taxa_L10", "taxa_L20", "taxa_L30"],
            "PARTIAL": {"LEVELS": True},
            "IMG_SIZE": 32,
            "H5": {"LABELS_PATH": str(labels), "TRAIN_VAL_SPLIT_RATIO": 0.75},
            "HYBRID": {"USE_HYBRID": True, "IMAGES_DIR": str(images)},
            "DATASET": {"OPTIONS": {"augment": "randaugment", "erasing": 0.5}},
        },
        "MODEL": {"TYPE": "hf_vision", "OPTIONS": {"config": CONVNEXT, "heads": "conditioned"}},
        "TASK": {"NAME": "hierarchical"},
        "TRAIN": {"EPOCHS": 2},
        "LR_SCHEDULER": {"REFERENCE_BS": None},
        "SCHEDULE": {"VALIDATION": {"INTERVAL_EPOCHS": 1}, "CHECKPOINT": {"INTERVAL_STEPS": 2}},
    }
    path = root / "species.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def evaluate(cfg: str, weights: Path, *opts: str) -> tuple[int, str, str]:
    """``linnaeus-accel evaluate`` on ``weights``, in this process."""
    return run_cli(
        "evaluate", "--cfg", cfg, "--checkpoint", str(weights), *(("--opts", *opts) if opts else ())
    )


@pytest.mark.slow
def test_killed_mid_epoch_with_workers_resumes_to_the_same_final_weights(tmp_path: Path) -> None:
    cfg = species_config(tmp_path)
    (tmp_path / "reference").mkdir()
    reference = TrainRun(tmp_path / "reference", [], cfg=cfg).run().check_ok()
    summary = read_summary(reference.dir)
    assert (summary["status"], summary["global_step"]) == ("completed", 6)
    validated = [r for r in read_metrics(reference.dir) if "val/loss" in r]
    assert len(validated) == 2
    assert {"val/chain_acc", "val/acc_taxa_L30", "val/acc_taxa_L20", "val/acc_taxa_L10"} <= set(validated[-1])
    # Beside the weights: the taxonomy (predictions can be named) and the preprocessing to serve with.
    taxonomy = Taxonomy.load(reference.dir / "final" / "taxonomy.json")
    assert taxonomy.num_classes == (5, 3, 2)  # finest first, as TASK_KEYS_H5: species, genus, family
    preprocessing = json.loads((reference.dir / "final" / "preprocessing.json").read_text())
    assert [c["name"] for c in preprocessing["metadata"]] == ["TEMPORAL", "SPATIAL"]  # by IDX
    assert preprocessing["image"]["size"] == 32
    assert preprocessing["levels"] == ["taxa_L30", "taxa_L20", "taxa_L10"]  # the heads, coarse to fine
    assert (reference.dir / "assets" / "taxonomy.json").read_bytes() == (
        reference.dir / "final" / "taxonomy.json"
    ).read_bytes()

    evaluated = evaluate(cfg, reference.dir / "final")
    assert evaluated[0] == 0, evaluated[2]
    # Labels of another taxonomy: the run's class indices would mean other taxa.
    labels = Path(yaml.safe_load(Path(cfg).read_text())["DATA"]["H5"]["LABELS_PATH"])
    other = labels.with_name("other.h5")
    with h5py.File(labels) as src:
        taxa = {k: src[k][()] for k in ("taxa_L10", "taxa_L20", "taxa_L30")}
        taxa["taxa_L10"] = np.where(taxa["taxa_L10"] == 11, 15, taxa["taxa_L10"])  # a species renumbered
        meta = {k: src[k][()] for k in ("spatial", "temporal")}
        write_labels_h5(other, [s.decode() for s in src["img_identifiers"][()]], taxa, meta)
    rc, _, err = evaluate(cfg, reference.dir / "final", "DATA.H5.LABELS_PATH", str(other))
    assert rc == 2
    assert "was trained with another taxonomy" in err, err
    assert "at taxa_L10 it has taxa this config's labels lack (11) or lacks taxa they have (15)" in err, err

    (tmp_path / "killed").mkdir()
    run = TrainRun(tmp_path / "killed", [], cfg=cfg)
    # inside epoch 2, after epoch 1's checkpoint (step 3; the kill waits for its background commit)
    killed = run.run(kill_at="optimizer_step:5", extra_env=AFTER_FIRST_COMMIT)
    assert killed.returncode == KILLED, killed.tail()
    assert_same_run(run.run(), reference)
