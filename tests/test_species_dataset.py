"""Species photos as samples: linnaeus' labels.h5 and a folder of JPEGs, read as the hierarchical
task takes them, the training transforms keyed by (seed, epoch, sample) through any number of
DataLoader workers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.species import ROWS, species_files
from torch.utils.data import DataLoader

from linnaeus_accel.config import ConfigError
from linnaeus_accel.data.species.dataset import KeyedEpochSampler, SpeciesDataset
from linnaeus_accel.data.species.images import ImageTransforms
from linnaeus_accel.data.species.labels import ComponentSpec, LabelsFile
from linnaeus_accel.data.species.taxonomy import Taxonomy

TASKS = ["taxa_L10", "taxa_L20", "taxa_L30"]  # species, genus, family: finest first, as linnaeus
SPATIAL = ComponentSpec("SPATIAL", "spatial", dim=3, idx=0)
TEMPORAL = ComponentSpec("TEMPORAL", "temporal", dim=2, idx=1)


@pytest.fixture
def dataset(tmp_path: Path) -> SpeciesDataset:
    labels, images = species_files(tmp_path)
    source = LabelsFile(labels, TASKS, [SPATIAL, TEMPORAL])
    taxonomy = Taxonomy(list(source.taxa_columns().values()), TASKS, partial_levels=True)
    transforms = ImageTransforms(size=24, train=True)
    return SpeciesDataset(source, np.arange(ROWS), taxonomy, images, transforms, seed=7)


def test_a_sample_is_what_the_hierarchical_task_takes(dataset: SpeciesDataset) -> None:
    assert dataset.levels == ("taxa_L30", "taxa_L20", "taxa_L10")  # coarse to fine
    assert dataset.num_classes == (2, 3, 5)  # the null class 0 at each rank, then the taxa
    assert dataset.meta_components == ("SPATIAL", "TEMPORAL")
    sample = dataset[(0, 0)]
    assert sample["index"] == 0
    assert sample["image"].shape == (3, 24, 24)
    assert sample["image"].dtype == torch.float32
    assert sample["labels"].tolist() == [1, 1, 1]  # family 31, genus 21, species 11: the first of each
    assert {k: v.shape for k, v in sample["meta"].items()} == {"SPATIAL": (3,), "TEMPORAL": (2,)}


@pytest.mark.parametrize(
    ("row", "labels", "spatial_norm"),
    [
        (5, [1, 1, -1], 1.0),  # species null: masked (-1) from its rank's loss, genus 21 kept
        (7, [1, 2, 4], 0.0),  # no coordinates: zeros, never a real point on the sphere
        (3, [1, 2, 4], 1.0),  # everything known
    ],
)
def test_null_ranks_and_missing_metadata(
    dataset: SpeciesDataset, row: int, labels: list[int], spatial_norm: float
) -> None:
    sample = dataset[row]
    assert sample["labels"].tolist() == labels
    assert float(sample["meta"]["SPATIAL"].norm()) == pytest.approx(spatial_norm, abs=1e-6)


def test_training_transforms_are_keyed_by_epoch_and_sample(dataset: SpeciesDataset) -> None:
    first, again = dataset[(3, 2)]["image"], dataset[(3, 2)]["image"]
    assert torch.equal(first, again)
    assert not torch.equal(first, dataset[(4, 2)]["image"])  # another epoch: another crop
    assert not torch.equal(first, dataset[(3, 6)]["image"])


def _epoch(dataset: SpeciesDataset, workers: int, epoch: int) -> list[torch.Tensor]:
    sampler = dataset.epoch_sampler(seed=7, shuffle=True)
    assert isinstance(sampler, KeyedEpochSampler)
    sampler.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)
    return [torch.cat([b["image"].flatten(), b["labels"].flatten().float()]) for b in loader]


def test_two_workers_read_what_the_main_process_reads(dataset: SpeciesDataset) -> None:
    """The key travels with the index: the same batches, bit for bit, however they are loaded."""
    alone = _epoch(dataset, 0, epoch=2)
    workers = _epoch(dataset, 2, epoch=2)
    assert all(torch.equal(a, b) for a, b in zip(alone, workers, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(alone, _epoch(dataset, 0, epoch=3), strict=True))


def test_a_missing_photo_is_named_before_training(dataset: SpeciesDataset) -> None:
    (dataset.images_dir / "obs_4.jpg").unlink()
    with pytest.raises(ConfigError) as caught:
        dataset.check_images()
    assert caught.value.problems == [
        (
            "DATA.HYBRID.IMAGES_DIR",
            f"1 photo(s) of the labels are not in {dataset.images_dir}: {dataset.images_dir / 'obs_4.jpg'} "
            "(row 4); put them there, or point DATA.HYBRID.IMAGES_DIR at the folder that holds them",
        )
    ]


def test_a_batch_read_together_is_the_samples_read_one_by_one(dataset: SpeciesDataset) -> None:
    """The DataLoader reads a batch's label rows in one go (``__getitems__``): the same samples."""
    keys = [(2, 5), (2, 0), (2, 7), (2, 5)]  # out of order, one twice
    together = dataset.__getitems__(keys)
    for key, sample in zip(keys, together, strict=True):
        alone = dataset[key]
        assert sample["index"] == alone["index"]
        assert torch.equal(sample["image"], alone["image"])
        assert torch.equal(sample["labels"], alone["labels"])
        assert all(torch.equal(sample["meta"][k], alone["meta"][k]) for k in alone["meta"])
