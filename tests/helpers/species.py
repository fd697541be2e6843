"""A small species dataset in linnaeus' layout: a ``labels.h5`` and a folder of real JPEGs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from linnaeus_accel.data.species.labels import write_labels_h5

ROWS = 12
# A one-stage ConvNeXt of 8 channels (MODEL.OPTIONS.config of hf_vision): the smallest that trains.
TINY_CONVNEXT = {
    "model_type": "convnext",
    "num_channels": 3,
    "depths": [1],
    "hidden_sizes": [8],
    "num_stages": 1,
    "image_size": 32,
}


def species_files(root: Path) -> tuple[Path, Path]:
    images = root / "images"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(ROWS):
        name = f"obs_{i}.jpg"
        pixels = rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / name, quality=90)
        names.append(name)
    species = [11, 12, 13, 14] * 3
    species[5] = 0  # identified to genus only
    taxa = {
        "taxa_L10": species,
        "taxa_L20": [21, 21, 22, 22] * 3,
        "taxa_L30": [31] * ROWS,
    }
    spatial = rng.normal(size=(ROWS, 3))
    spatial /= np.linalg.norm(spatial, axis=1, keepdims=True)
    spatial[7] = 0.0  # no coordinates
    temporal = np.stack([np.sin(np.arange(ROWS)), np.cos(np.arange(ROWS))], axis=1)
    labels = write_labels_h5(root / "labels.h5", names, taxa, {"spatial": spatial, "temporal": temporal})
    return labels, images
