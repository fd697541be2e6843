"""Species photos as training samples for the ``hierarchical`` task: a row source (linnaeus'
``labels.h5``, ``labels.LabelsFile``, or a table of observations, ``table.ObservationTable``), the
rows of one split, the taxonomy, and the photos: in a folder (``pixels.PhotoFolder``) or as pixels in
linnaeus' ``images.h5`` (``pixels.PixelsFile``).

A sample is ``{"index", "image", "meta", "labels"}``: ``labels`` holds one class index per rank,
coarse to fine, as the task takes them (the row source and the taxonomy list ranks finest first, as
linnaeus' ``TASK_KEYS_H5`` does), a null rank as ``-1`` so that its loss and accuracy skip it;
``meta`` holds each metadata component, zeros where the row has no value (a missing value carries
no information, as a masked one: it is never a real point, date or height, whose encodings have
norm 1 per pair). With partial levels the class indices keep linnaeus' layout (index 0 is the null
class at every rank), so heads sized by ``num_classes`` match linnaeus'.

The training transforms are keyed by ``(seed, epoch, sample)``: the dataset's sampler hands each
index over with its epoch (``KeyedEpochSampler``), so a DataLoader worker draws the same crop and
flip for a sample whichever worker or process reads it, and a resumed run draws what the
uninterrupted one drew.

A photo that cannot be decoded (truncated, not an image) stops the run with ``UnreadablePhoto``, one
sentence naming the file, its row and its identifier; with ``skip_unreadable`` its sample is a
blank image with every label null instead (``blank_sample``), and a warning names the file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from ..sampling import EpochSeededSampler
from .errors import UnreadablePhoto
from .images import ImageProblem, ImageTransforms
from .labels import ComponentSpec, LabelRow, LabelRows
from .pixels import ImageSource, Photo, PhotoFolder
from .taxonomy import Taxonomy

SKIP_KEY = "DATA.DATASET.OPTIONS.skip_unreadable"

log = logging.getLogger(__name__)


def _cause(problem: ImageProblem) -> str:
    """Why Pillow could not read the photo, from ``ImageProblem``'s sentence."""
    text = str(problem)
    _, found, rest = text.partition(" cannot be read: ")
    return rest.split("; ", 1)[0] if found else text


class RowSource(Protocol):
    """What a dataset reads its rows from: ``labels.LabelsFile`` or ``table.ObservationTable``."""

    task_keys: list[str]
    components: tuple[ComponentSpec, ...]
    component_slices: dict[str, slice]

    def __len__(self) -> int: ...

    def row(self, index: int) -> LabelRow: ...

    def rows(self, indices: Sequence[int]) -> LabelRows: ...

    def taxa_columns(self) -> dict[str, npt.NDArray[np.uint32]]: ...


class KeyedEpochSampler(EpochSeededSampler):
    """The Trainer's epoch order, each index handed over as ``(epoch, index)``: the key of the
    sample's random transforms travels with it into whichever DataLoader worker reads it (the
    workers persist across epochs, so they cannot learn the epoch otherwise)."""

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        return ((epoch, index) for index in super().__iter__())


class SpeciesDataset(Dataset[dict[str, Any]]):
    """``rows`` of the split (indices into ``source``); ``images``: where the photos are, an
    ``ImageSource`` or a folder, the photo of a row at ``images / identifier`` (``extension``
    appended when the identifier has none, as linnaeus' ``FILE_EXTENSION``).
    ``seed``: EXPERIMENT.SEED, which keys the training transforms. ``skip_unreadable``: a photo that
    cannot be decoded gives ``blank_sample`` (counted in ``skipped``, per process) instead of
    raising ``UnreadablePhoto``."""

    def __init__(
        self,
        source: RowSource,
        rows: npt.NDArray[np.int64] | Sequence[int],
        taxonomy: Taxonomy,
        images: ImageSource | str | Path,
        transforms: ImageTransforms,
        *,
        seed: int,
        extension: str = "",
        skip_unreadable: bool = False,
    ) -> None:
        if list(taxonomy.rank_names) != list(source.task_keys):
            raise ValueError(
                f"the taxonomy's ranks {taxonomy.rank_names} are not the source's {source.task_keys}"
            )
        self.source, self.taxonomy, self.transforms, self.seed = source, taxonomy, transforms, seed
        self.rows = np.asarray(rows, dtype=np.int64)
        self.images: ImageSource = (
            PhotoFolder(images, extension) if isinstance(images, (str, Path)) else images
        )
        # The task's order: coarse to fine.
        self.levels = tuple(reversed(taxonomy.rank_names))
        self.num_classes = tuple(reversed(taxonomy.num_classes))
        self.meta_components = tuple(c.name for c in source.components)
        self.meta_dims = {c.name: c.dim for c in source.components}  # a model need not read a photo for them
        self.skip_unreadable = skip_unreadable
        # Of this process (each DataLoader worker has its own copy): what it warned of, once a file.
        self.skipped: set[Path] = set()

    def __len__(self) -> int:
        return int(self.rows.size)

    def epoch_sampler(self, seed: int, shuffle: bool) -> KeyedEpochSampler:
        """The Trainer's sampler for this dataset (``data.sampling.epoch_sampler``)."""
        return KeyedEpochSampler(self, seed, shuffle=shuffle)

    @property
    def images_dir(self) -> Path:
        """The folder of the photos, when they are in one."""
        if not isinstance(self.images, PhotoFolder):
            raise AttributeError(f"this dataset reads its photos from {self.images!r}, not a folder")
        return self.images.directory

    def check_images(self) -> None:
        """Before training: every photo of the split can be found (in the folder), or one
        ``ConfigError`` naming the first missing ones (file and row)."""
        self.images.check(self.rows, lambda row: self.source.row(row).identifier)

    def run_records(self) -> dict[str, dict[str, Any]]:
        """Kept by the run in ``assets/`` and beside its weights in ``final/``: the taxonomy (class
        index -> taxon id per rank, and names where the source has them), and the preprocessing a
        photo and its metadata need to be served as trained (the evaluation transform, the
        components in the order the model concatenates them, the ranks in the order of its heads)."""
        taxonomy = self.taxonomy.to_json()
        names = getattr(self.source, "names", None)
        if callable(names):
            taxonomy["names"] = {
                key: {str(i): n for i, n in names(key).items()} for key in self.source.task_keys
            }
        evaluation = replace(self.transforms, train=False).describe()
        components = [
            {"name": c.name, "source": c.source, "dim": c.dim, "idx": c.idx} for c in self.source.components
        ]
        preprocessing = {
            "version": 1,
            "image": evaluation,
            "metadata": components,
            "levels": list(self.levels),
        }
        return {"taxonomy.json": taxonomy, "preprocessing.json": preprocessing}

    def labels_of(self, row: LabelRow) -> torch.Tensor:
        """The row's class index per rank, coarse to fine; -1 where the rank is null."""
        out = []
        for r, key in enumerate(self.taxonomy.rank_names):
            taxon = int(row.taxa[key])
            if taxon == 0:
                out.append(-1)
            else:
                out.append(int(self.taxonomy.encode(r, np.array([taxon], dtype=np.uint32))[0]))
        return torch.tensor(out[::-1], dtype=torch.int64)

    def blank_sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What an unreadable photo's sample holds with ``skip_unreadable``: an image of zeros (the
        mean colour, after normalisation) and every label null, so that no loss, gradient or
        per-rank accuracy counts it; the same in every epoch, process and resumed run."""
        size = self.transforms.size
        return torch.zeros(3, size, size), torch.full((len(self.levels),), -1, dtype=torch.int64)

    def _unreadable(self, problem: ImageProblem, row: int, identifier: str) -> None:
        """Raise ``UnreadablePhoto``, or, with ``skip_unreadable``, warn of the file the first time
        this process meets it."""
        source = getattr(self.source, "path", "the labels")
        where = f"{problem.path} (row {row} of {source}, identifier {identifier!r})"
        if not self.skip_unreadable:
            raise UnreadablePhoto(
                f"photo {where} cannot be read: {_cause(problem)}; replace the file, drop its row, or set "
                f"{SKIP_KEY}: true to train on without it"
            ) from None
        if problem.path not in self.skipped:
            self.skipped.add(problem.path)
            log.warning(
                "skipping unreadable photo %s: %s; its sample trains as a blank image with no labels "
                "(%s), %d unreadable photo(s) skipped by this process so far",
                where,
                _cause(problem),
                SKIP_KEY,
                len(self.skipped),
            )

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        # (epoch, index) from the training sampler; a bare index elsewhere (validation, a subset).
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[int | tuple[int, int]]) -> list[dict[str, Any]]:
        """A batch's samples (torch's DataLoader asks for them together): their rows of the labels
        read in one go, each file's datasets (and images.h5's pixels) read once for the batch
        instead of once a sample."""
        pairs = [key if isinstance(key, tuple) else (0, key) for key in keys]
        rows = self.source.rows([int(self.rows[index]) for _, index in pairs])
        photos = self.images.read(rows.indices.tolist(), rows.identifiers, self.transforms.size)
        return [self._sample(epoch, index, rows[j], photos[j]) for j, (epoch, index) in enumerate(pairs)]

    def _sample(self, epoch: int, index: int, row: LabelRow, photo: Photo) -> dict[str, Any]:
        values = torch.from_numpy(np.ascontiguousarray(row.meta, dtype=np.float32))
        meta = {c.name: values[self.source.component_slices[c.name]] for c in self.source.components}
        if isinstance(photo, ImageProblem):
            self._unreadable(photo, int(row.index), row.identifier)
            image, labels = self.blank_sample()
            return {"index": index, "image": image, "meta": meta, "labels": labels}
        image = self.transforms(photo, self.seed, epoch, index)
        return {"index": index, "image": image, "meta": meta, "labels": self.labels_of(row)}
