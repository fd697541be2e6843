"""Species photos decoded and augmented in DataLoader workers, with Pillow and torch alone.

``load_image`` decodes a photo as RGB (a JPEG at a reduced scale when it is much larger than the
model's input); ``ImageTransforms`` turns it into the normalised ``[3, size, size]`` float tensor.

Training draws every random choice (crop, flip, RandAugment, erasing) from
``python_keyed_uniform(seed, epoch, index, stream)``, one fixed stream per decision: the tensor of a
sample is a pure function of (seed, epoch, index), the same in any process or DataLoader worker and
after a resume, and another epoch or sample draws anew. Validation is a fixed resize and centre crop,
which ``describe`` records as plain data, so that serving preprocesses as training validated.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..keyed_random import python_keyed_uniform
from .augment import MAGNITUDE, NUM_OPS, OP_NAMES, rand_augment

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_FRACTION = 0.875  # validation: the centre crop is this share of the resized shorter side
DRAFT_MARGIN = 2  # a JPEG is decoded at the smallest scale whose shorter side is >= this x size
POLICIES = (None, "randaugment")
INTERPOLATION = Image.Resampling.BICUBIC
_CROP_ATTEMPTS = 10  # torchvision's and timm's: then a centre crop of the whole image
_ERASE_ATTEMPTS = 10
_ERASE_AREA = (0.02, 1 / 3)  # Zhong et al.'s defaults, as shares of the image
_ERASE_ASPECT = (0.3, 3.3)
_TRUNCATED = "it is truncated (Pillow could not decode all of it)"

# Keyed-draw streams: "img\0" + (decision << 4) + slot (a crop attempt, a RandAugment slot, an
# erasing attempt, each < 16). Apart from every other stream of the project, so that a photo's crop
# never correlates with the same sample's metadata masking.
_STREAM_BASE = 0x696D_6700
_CROP_SCALE, _CROP_ASPECT, _CROP_X, _CROP_Y, _FLIP = range(5)
_RA_APPLY, _RA_OP, _RA_SIGN = range(5, 8)
_ERASE, _ERASE_SIZE, _ERASE_SHAPE, _ERASE_X, _ERASE_Y = range(8, 13)

Box = tuple[int, int, int, int]  # left, top, width, height
Draw = Callable[[int, int], float]  # (decision, slot) -> a keyed uniform in [0, 1)


class ImageProblem(ValueError):
    """A photo that cannot be decoded; ``path`` is the file."""

    def __init__(self, path: Path, cause: str) -> None:
        super().__init__(
            f"Image {path} cannot be read: {cause}; replace the file or drop its observation from the labels."
        )
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # A DataLoader worker pickles the exception to the main process: keep the path and message.
        return (_rebuild_problem, (self.path, str(self)))


def _rebuild_problem(path: Path, message: str) -> ImageProblem:
    problem = ImageProblem.__new__(ImageProblem)
    ValueError.__init__(problem, message)
    problem.path = path
    return problem


def load_image(path: Path, size: int, data: bytes | None = None) -> Image.Image:
    """The photo at ``path`` as an RGB image, a JPEG decoded at a reduced scale that keeps its
    shorter side >= ``DRAFT_MARGIN`` x ``size`` (the model's input side), or at full scale when it
    is smaller than that; any other format whole. ``data``: the file's bytes, when they are held
    elsewhere (a dataset's column; ``path`` then only names them). Raises ``ImageProblem``."""
    path = Path(path)
    try:
        opened = Image.open(path if data is None else io.BytesIO(data))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        raise ImageProblem(path, "no such file") from exc
    except UnidentifiedImageError as exc:
        raise ImageProblem(path, "it is not an image Pillow can read") from exc
    except PermissionError as exc:
        raise ImageProblem(path, "permission denied") from exc
    except OSError as exc:  # Pillow's "Truncated File Read": the file ends inside the header
        raise ImageProblem(path, _TRUNCATED) from exc
    with opened:
        try:
            if opened.format == "JPEG":
                # libjpeg scales by 1/2, 1/4 or 1/8 while decoding, far cheaper than decoding a
                # 12-megapixel photo whole. The 2x margin: the last reduction is Pillow's antialiased
                # bicubic resize (DCT scaling is a cruder filter), validation's resize to
                # size / 0.875 stays a reduction, and a training crop of a quarter of the image
                # (half its side) still samples at full target resolution.
                target = DRAFT_MARGIN * size
                opened.draft("RGB", (target, target))
            # A phone stores a portrait photo sideways with an EXIF orientation: upright, as shown.
            return ImageOps.exif_transpose(opened).convert("RGB")
        except (OSError, SyntaxError) as exc:
            raise ImageProblem(path, _TRUNCATED) from exc


@dataclass(frozen=True)
class ImageTransforms:
    """An RGB photo to a normalised float32 ``[3, size, size]`` tensor.

    ``size`` is the square side (``DATA.IMG_SIZE``); ``train`` selects the random pipeline (random
    resized crop of ``scale`` of the area at an aspect ratio within ``ratio``, a horizontal flip with
    probability ``hflip``, the ``policy`` "randaugment" or none (``augment`` documents it), then
    random erasing with probability ``erasing``) over the fixed one (shorter side resized to
    ``round(size / 0.875)``, centre crop). ``mean``/``std`` normalise RGB values in [0, 1].
    """

    size: int
    train: bool
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    policy: str | None = None
    erasing: float = 0.0

    def __post_init__(self) -> None:
        for name in ("mean", "std", "scale", "ratio"):  # lists from a config become tuples
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        problems = []
        if self.size < 1:
            problems.append(f"size must be a positive number of pixels, not {self.size}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            problems.append(f"mean and std need 3 values each, std positive (got {self.mean} and {self.std})")
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1:
            problems.append(f"scale must be (low, high) with 0 < low <= high <= 1, not {self.scale}")
        if len(self.ratio) != 2 or not 0 < self.ratio[0] <= self.ratio[1]:
            problems.append(f"ratio must be (low, high) with 0 < low <= high, not {self.ratio}")
        for name in ("hflip", "erasing"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name} is a probability, between 0 and 1, not {getattr(self, name)}")
        if self.policy not in POLICIES:
            problems.append(f"policy must be None or 'randaugment', not {self.policy!r}")
        if problems:
            raise ValueError("; ".join(problems) + ".")

    @property
    def resize_to(self) -> int:
        """Validation's shorter side before the centre crop."""
        return round(self.size / CROP_FRACTION)

    def __call__(self, image: Image.Image, seed: int, epoch: int, index: int) -> torch.Tensor:
        """``image``'s tensor; in training, a pure function of (``seed``, ``epoch``, ``index``:
        the sample's index in the dataset). Validation ignores them."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        if not self.train:
            return self._to_tensor(self._centre(image))

        def draw(decision: int, slot: int) -> float:
            return python_keyed_uniform(seed, epoch, index, _STREAM_BASE + (decision << 4) + slot)

        left, top, width, height = self.crop_box(image.width, image.height, draw)
        box = (left, top, left + width, top + height)
        image = image.resize((self.size, self.size), INTERPOLATION, box=box)
        if draw(_FLIP, 0) < self.hflip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.policy == "randaugment":
            draws = [(draw(_RA_APPLY, s), draw(_RA_OP, s), draw(_RA_SIGN, s)) for s in range(NUM_OPS)]
            image = rand_augment(image, draws, self._fill())
        tensor = self._to_tensor(image)
        if self.erasing > 0 and draw(_ERASE, 0) < self.erasing:
            self._erase(tensor, draw)
        return tensor

    def crop_box(self, width: int, height: int, draw: Draw) -> Box:
        """The random resized crop of a ``width`` x ``height`` image (torchvision's rule): up to 10
        tries of an area share within ``scale`` and a log-uniform aspect within ``ratio`` that fits,
        else the largest centre crop whose aspect is within ``ratio``."""
        area = width * height
        log_low, log_high = math.log(self.ratio[0]), math.log(self.ratio[1])
        for attempt in range(_CROP_ATTEMPTS):
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * draw(_CROP_SCALE, attempt))
            aspect = math.exp(log_low + (log_high - log_low) * draw(_CROP_ASPECT, attempt))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                x = int(draw(_CROP_X, attempt) * (width - w + 1))
                y = int(draw(_CROP_Y, attempt) * (height - h + 1))
                return x, y, w, h
        aspect = width / height
        if aspect < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif aspect > self.ratio[1]:
            w, h = round(height * self.ratio[1]), height
        else:
            w, h = width, height
        return (width - w) // 2, (height - h) // 2, w, h

    def _centre(self, image: Image.Image) -> Image.Image:
        short = self.resize_to
        width, height = image.size
        # torchvision's Resize(int): the longer side scaled in proportion, truncated.
        if width <= height:
            new = (short, int(short * height / width))
        else:
            new = (int(short * width / height), short)
        image = image.resize(new, INTERPOLATION)
        left = round((new[0] - self.size) / 2.0)
        top = round((new[1] - self.size) / 2.0)
        return image.crop((left, top, left + self.size, top + self.size))

    def _fill(self) -> tuple[int, int, int]:
        red, green, blue = (round(255 * m) for m in self.mean)
        return red, green, blue

    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        return ((pixels.to(torch.float32) / 255.0 - mean) / std).contiguous()

    def _erase(self, tensor: torch.Tensor, draw: Draw) -> None:
        """Zhong et al.'s random erasing in place: a rectangle of 2% to 1/3 of the image at an aspect
        log-uniform in 0.3 to 3.3, set to zero (the mean, after normalisation)."""
        _, height, width = tensor.shape
        log_low, log_high = math.log(_ERASE_ASPECT[0]), math.log(_ERASE_ASPECT[1])
        for attempt in range(_ERASE_ATTEMPTS):
            share = _ERASE_AREA[0] + (_ERASE_AREA[1] - _ERASE_AREA[0]) * draw(_ERASE_SIZE, attempt)
            area = height * width * share
            aspect = math.exp(log_low + (log_high - log_low) * draw(_ERASE_SHAPE, attempt))
            h = round(math.sqrt(area * aspect))
            w = round(math.sqrt(area / aspect))
            if 0 < h < height and 0 < w < width:
                top = int(draw(_ERASE_Y, attempt) * (height - h + 1))
                left = int(draw(_ERASE_X, attempt) * (width - w + 1))
                tensor[:, top : top + h, left : left + w] = 0.0
                return

    def describe(self) -> dict[str, Any]:
        """The preprocessing as plain (JSON) data: what serving must do to a photo (``eval``), and
        the training augmentation this run drew from (``train``)."""
        return {
            "size": self.size,
            "mode": "RGB",
            "mean": list(self.mean),
            "std": list(self.std),
            "scale_to_unit": "pixel / 255, then (value - mean) / std per channel",
            "interpolation": "bicubic",
            "decode": {
                "jpeg_draft": f"smallest libjpeg scale keeping the shorter side >= {DRAFT_MARGIN} x size",
                "exif_orientation": "applied (the photo upright, as shown)",
            },
            "eval": {
                "resize": {"shorter_side": self.resize_to, "rule": f"round(size / {CROP_FRACTION})"},
                "crop": {"kind": "centre", "size": [self.size, self.size]},
            },
            "train": {
                "crop": {"kind": "random_resized", "scale": list(self.scale), "ratio": list(self.ratio)},
                "hflip": self.hflip,
                "policy": self.policy,
                "randaugment": {"n": NUM_OPS, "m": MAGNITUDE, "ops": list(OP_NAMES)}
                if self.policy == "randaugment"
                else None,
                "erasing": {
                    "p": self.erasing,
                    "area": list(_ERASE_AREA),
                    "aspect": list(_ERASE_ASPECT),
                    "fill": 0.0,
                },
            },
        }
