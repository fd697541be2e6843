"""A photo that is in the folder but cannot be decoded, met mid-training (in the training process or
in a DataLoader worker): the run stops with one sentence naming the file, its row of labels.h5 and
its identifier, ``summary.json`` says failed with that sentence; or, with
``DATA.DATASET.OPTIONS.skip_unreadable``, the run trains on past it and a warning names the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers.in_process import run_here, run_here_ending_workers
from helpers.runs import Result, TrainRun, read_summary
from helpers.species import TINY_CONVNEXT, species_files
from torch._utils import ExceptionWrapper

from linnaeus_accel.data.species.errors import UnreadablePhoto

# The rows of the tiny labels.h5 that train (split seed 42): [0, 2, 3, 4, 5, 6, 7, 9, 11]. Sample 4
# of the split is row 5: past the first two samples, which the Trainer's checks read before training.
BAD_ROW = 5
EXIT_FAILED = 1  # as a token id outside the vocabulary ends a run (TokenOutOfVocab)


def bad_photo_run(
    root: Path, workers: int, skip: bool, damage: str = "truncated", epochs: int = 1, row: int = BAD_ROW
) -> tuple[TrainRun, Path]:
    """A run of ``epochs`` (3 steps of 4 samples each) on the tiny species data, row ``BAD_ROW``'s
    photo damaged; the run and the damaged file."""
    labels, images = species_files(root / "data")
    bad = images / f"obs_{row}.jpg"
    whole = bad.read_bytes()
    # A JPEG cut short inside its scan, or a file that is no image at all.
    bad.write_bytes(whole[: len(whole) // 3] if damage == "truncated" else b"not a photo\n" * 20)
    options = {"augment": "none", "erasing": 0.0, **({"skip_unreadable": True} if skip else {})}
    config = {
        "DATA": {
            "BATCH_SIZE": 4,
            "NUM_WORKERS": workers,
            "TASK_KEYS_H5": ["taxa_L10", "taxa_L20", "taxa_L30"],
            "PARTIAL": {"LEVELS": True},
            "IMG_SIZE": 32,
            "H5": {"LABELS_PATH": str(labels), "TRAIN_VAL_SPLIT_RATIO": 0.75},
            "HYBRID": {"USE_HYBRID": True, "IMAGES_DIR": str(images)},
            "DATASET": {"OPTIONS": options},
        },
        "MODEL": {"TYPE": "hf_vision", "OPTIONS": {"config": TINY_CONVNEXT}},
        "TASK": {"NAME": "hierarchical"},
        "TRAIN": {"EPOCHS": epochs},
        "LR_SCHEDULER": {"REFERENCE_BS": None},
        "SCHEDULE": {"VALIDATION": {"INTERVAL_EPOCHS": 1}},
    }
    cfg = root / "species.yaml"
    cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
    return TrainRun(root, [], cfg=str(cfg)), bad


def sentence(bad: Path, cause: str) -> str:
    return (
        f"photo {bad} (row {BAD_ROW} of {bad.parents[1] / 'labels.h5'}, identifier 'obs_{BAD_ROW}.jpg') cannot "
        f"be read: {cause}; replace the file, drop its row, or set DATA.DATASET.OPTIONS.skip_unreadable: true "
        "to train on without it"
    )


def assert_stopped_on(result: Result, words: str) -> None:
    assert result.returncode == EXIT_FAILED, result.tail()
    assert f"linnaeus-accel: {words}\n" in result.output, result.tail()
    assert "Traceback" not in result.output, result.tail()
    summary = read_summary(result.dir)
    assert (summary["status"], summary["error"]) == ("failed", words)


@pytest.mark.parametrize(
    ("workers", "damage", "cause"),
    [
        # In the training process: the photo's exception reaches the Trainer as raised.
        (0, "truncated", "it is truncated (Pillow could not decode all of it)"),
        (0, "not an image", "it is not an image Pillow can read"),
        # In a DataLoader worker: torch rebuilds it in the training process from its class and the
        # worker's traceback text, which must come down to the sentence again.
        (2, "truncated", "it is truncated (Pillow could not decode all of it)"),
    ],
)
def test_an_unreadable_photo_stops_the_run_in_one_sentence(
    tmp_path: Path, workers: int, damage: str, cause: str
) -> None:
    run, bad = bad_photo_run(tmp_path, workers, skip=False, damage=damage)
    result = run_here_ending_workers(run) if workers else run_here(run)
    assert_stopped_on(result, sentence(bad, cause))


def warning(bad: Path) -> str:
    return (
        f"skipping unreadable photo {bad} (row {BAD_ROW} of {bad.parents[1] / 'labels.h5'}, identifier "
        "'obs_5.jpg'): it is truncated (Pillow could not decode all of it); its sample trains as a blank image "
        "with no labels (DATA.DATASET.OPTIONS.skip_unreadable), 1 unreadable photo(s) skipped by this process so far"
    )


def warnings_in(result: Result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("skipping unreadable photo")]


def test_skip_unreadable_trains_on_and_names_the_file_once(tmp_path: Path) -> None:
    run, bad = bad_photo_run(tmp_path, 0, skip=True, epochs=2)
    result = run_here(run).check_ok()
    assert read_summary(result.dir)["status"] == "completed"
    assert warnings_in(result) == [warning(bad)]  # read in both epochs, said once


def test_skip_unreadable_warns_from_the_workers(tmp_path: Path) -> None:
    """In DataLoader workers, each its own process: each worker that reads the photo says so once,
    on the run's console (a process of its own: the workers' stderr is the console's)."""
    run, bad = bad_photo_run(tmp_path, 2, skip=True, epochs=2)
    result = run.run().check_ok()
    assert read_summary(result.dir)["status"] == "completed"
    said = warnings_in(result)
    assert set(said) == {warning(bad)}, result.tail()
    assert 1 <= len(said) <= 2, said  # a worker that read it in both epochs said so once
    assert "Traceback" not in result.output


def test_a_skipped_photo_is_the_same_blank_sample_in_every_epoch(tmp_path: Path) -> None:
    """The same sample in every epoch (a resumed run reads what the uninterrupted one read), which no
    loss counts, warned of once in this process."""
    from linnaeus_accel.config import load_config
    from linnaeus_accel.data import build_dataset
    from linnaeus_accel.tasks.hierarchical import level_loss_sums

    run, bad = bad_photo_run(tmp_path, 0, skip=True)
    dataset = build_dataset(load_config(run.cfg, []), "train")
    first, later = dataset[(0, 4)], dataset[(3, 4)]
    assert torch.equal(first["image"], torch.zeros(3, 32, 32))
    assert first["labels"].tolist() == [-1, -1, -1]  # coarse to fine: every rank null
    assert torch.equal(later["image"], first["image"])
    assert torch.equal(later["labels"], first["labels"])
    logits = [torch.randn(1, n) for n in dataset.num_classes]
    assert level_loss_sums(logits, first["labels"][None]).tolist() == [0.0, 0.0, 0.0]
    assert dataset.skipped == {bad}
    assert dataset[(0, 3)]["labels"].min() >= 0  # its neighbours read as ever


def test_a_worker_error_comes_back_as_the_sentence() -> None:
    """How torch hands a worker's exception over (``ExceptionWrapper``): the class called with the
    whole traceback text. The class, and the sentence alone, survive it."""
    try:
        raise UnreadablePhoto("photo a.jpg (row 3 of labels.h5, identifier 'a.jpg') cannot be read: ...")
    except UnreadablePhoto:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(UnreadablePhoto) as rebuilt:
        wrapped.reraise()
    assert str(rebuilt.value) == "photo a.jpg (row 3 of labels.h5, identifier 'a.jpg') cannot be read: ..."


def test_an_unreadable_first_photo_is_refused_before_training(tmp_path: Path) -> None:
    """Row 0 is the split's first sample, which the Trainer reads to check the task against the
    data before the first step: a config error (exit 2) in the photo's sentence, nothing trained."""
    run, bad = bad_photo_run(tmp_path, workers=0, skip=False, row=0)
    result = run_here(run)
    assert result.returncode == 2, result.tail()
    assert f"DATA: photo {bad} (row 0 of" in result.output, result.tail()
    assert "Traceback" not in result.output, result.tail()
