"""Species photos decoded (JPEG draft mode, one-sentence errors) and augmented with every random
choice keyed by (seed, epoch, index): the same key gives the same tensor in any process."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from linnaeus_accel.data.species.augment import OP_NAMES, OPS, chosen_ops
from linnaeus_accel.data.species.images import ImageProblem, ImageTransforms, load_image

SIZE = 32
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
KEYS = [(7, epoch, index) for epoch in range(2) for index in range(20)]  # (seed, epoch, index)


def gradient(width: int, height: int) -> Image.Image:
    """Red grows to the right, green downwards, blue with both: no two pixels, nor a photo and its
    mirror image, look alike. Values stay within 40..200, so autocontrast has something to do."""
    x = np.linspace(40, 200, width)[None, :].repeat(height, 0)
    y = np.linspace(40, 200, height)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, (x + y) / 2], -1).astype(np.uint8))


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("photos")
    paths = {name: folder / name for name in ("small.jpg", "small.png", "large.jpg", "solid.png")}
    gradient(96, 64).save(paths["small.jpg"], quality=95)
    gradient(96, 64).save(paths["small.png"])
    gradient(2000, 1500).save(paths["large.jpg"], quality=80)
    Image.new("RGB", (96, 64), (200, 100, 50)).save(paths["solid.png"])
    return paths


def to_tensor(image: Image.Image) -> torch.Tensor:
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0
    return (pixels - MEAN) / STD


# (transform options): every training pipeline, from plain to all of it
PIPELINES = [
    {},  # random resized crop and flip
    {"policy": "randaugment"},
    {"policy": "randaugment", "erasing": 0.5},
]


@pytest.mark.parametrize("options", PIPELINES)
@pytest.mark.parametrize("name", ["small.jpg", "small.png"])
def test_same_key_same_tensor_other_key_another(
    photos: dict[str, Path], name: str, options: dict[str, Any]
) -> None:
    transform = ImageTransforms(SIZE, train=True, **options)
    copy = pickle.loads(pickle.dumps(transform))  # as a DataLoader worker started by spawn has it
    assert copy == transform
    image = load_image(photos[name], SIZE)
    tensors = [transform(image, *key) for key in KEYS]
    for key, tensor in zip(KEYS, tensors, strict=True):
        again = copy(load_image(photos[name], SIZE), *key)
        assert torch.equal(again, tensor)
        assert tensor.dtype == torch.float32
        assert tensor.shape == (3, SIZE, SIZE)
    # Another epoch (same index) or index draws anew: every key its own tensor.
    assert len({t.numpy().tobytes() for t in tensors}) == len(KEYS)
    assert not torch.equal(transform(image, 8, 0, 0), tensors[0])  # another seed too


def _tensors_in_child(blob: bytes, path: str, keys: list[tuple[int, int, int]], queue: Any) -> None:
    transform = pickle.loads(blob)
    image = load_image(Path(path), transform.size)
    queue.put([transform(image, *key).numpy().tobytes() for key in keys])


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_child_process_draws_the_same_tensors(photos: dict[str, Path], method: str) -> None:
    transform = ImageTransforms(SIZE, train=True, policy="randaugment", erasing=0.5)
    keys = KEYS[:8]
    context = multiprocessing.get_context(method)
    queue = context.Queue()
    blob = pickle.dumps(transform)
    child = context.Process(target=_tensors_in_child, args=(blob, str(photos["small.jpg"]), keys, queue))
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    image = load_image(photos["small.jpg"], SIZE)
    assert result == [transform(image, *key).numpy().tobytes() for key in keys]


# (hflip probability, which of the keys' tensors are mirrored)
FLIPS = [
    (0.0, "none"),
    (1.0, "all"),
    (0.5, "some"),
]


@pytest.mark.parametrize(("hflip", "expected"), FLIPS)
def test_flip_mirrors_the_photo_for_some_keys(photos: dict[str, Path], hflip: float, expected: str) -> None:
    # A crop of the whole area at the photo's own aspect (96 x 64) is the whole photo, so each
    # tensor is the photo resized, either as it is or mirrored.
    transform = ImageTransforms(SIZE, train=True, scale=(1.0, 1.0), ratio=(1.5, 1.5), hflip=hflip)
    image = load_image(photos["small.png"], SIZE)
    plain = to_tensor(image.resize((SIZE, SIZE), Image.Resampling.BICUBIC))
    mirrored = torch.flip(plain, dims=[2])
    flipped = []
    for key in KEYS:
        tensor = transform(image, *key)
        is_plain = torch.allclose(tensor, plain, atol=1e-6)
        assert is_plain or torch.allclose(tensor, mirrored, atol=1e-6)
        flipped.append(not is_plain)
    assert {"none": not any(flipped), "all": all(flipped), "some": 10 <= sum(flipped) <= 30}[expected]


# (uniform every draw returns, the crop box (left, top, width, height) of a 96 x 64 photo)
CROP_BOXES = [
    # The smallest area (8%) at the narrowest aspect (3/4), at the top left corner.
    (0.0, (0, 0, 19, 26)),
    # 54% of the area (0.08 + 0.92 / 2) at aspect 1 is 58 x 58, halfway along where it can go.
    (0.5, (19, 3, 58, 58)),
    # The whole area at aspect 4/3 is 91 x 68, taller than the photo, every try: the fallback is the
    # widest centre crop at aspect 4/3.
    (0.999, (5, 0, 85, 64)),
]


@pytest.mark.parametrize(("u", "box"), CROP_BOXES)
def test_crop_box(u: float, box: tuple[int, int, int, int]) -> None:
    transform = ImageTransforms(SIZE, train=True)
    assert transform.crop_box(96, 64, lambda decision, slot: u) == box


def test_random_crops_differ_over_keys(photos: dict[str, Path]) -> None:
    transform = ImageTransforms(SIZE, train=True, hflip=0.0)
    image = load_image(photos["small.png"], SIZE)
    whole = to_tensor(image.resize((SIZE, SIZE), Image.Resampling.BICUBIC))
    tensors = [transform(image, *key) for key in KEYS]
    assert len({t.numpy().tobytes() for t in tensors}) == len(KEYS)
    assert all(not torch.allclose(t, whole, atol=1e-3) for t in tensors)  # none is the photo whole
    # A crop zooms in: its tensor spans less of the gradient's red than the whole photo.
    red_span = [float(t[0].max() - t[0].min()) for t in tensors]
    assert max(red_span) <= float(whole[0].max() - whole[0].min()) + 1e-5
    assert min(red_span) < 0.5 * float(whole[0].max() - whole[0].min())


# (side, the manual resize of the 96 x 64 photo, the centre crop box)
VALIDATION = [
    # round(32 / 0.875) = 37 on the shorter side, 37 * 96 / 64 = 55.5 truncated to 55.
    (32, (55, 37), (12, 2, 44, 34)),
    # round(48 / 0.875) = 55; 82.5 -> 82; (82 - 48) / 2 = 17, (55 - 48) / 2 = 3.5 -> 4 (to even).
    (48, (82, 55), (17, 4, 65, 52)),
]


@pytest.mark.parametrize(("size", "resized", "box"), VALIDATION)
@pytest.mark.parametrize("name", ["small.jpg", "small.png"])
def test_validation_is_resize_and_centre_crop(
    photos: dict[str, Path], name: str, size: int, resized: tuple[int, int], box: tuple[int, int, int, int]
) -> None:
    transform = ImageTransforms(size, train=False)
    image = load_image(photos[name], size)
    expected = to_tensor(image.resize(resized, Image.Resampling.BICUBIC).crop(box))
    first = transform(image, 0, 0, 0)
    assert float((first - expected).abs().max()) <= 1e-6
    for key in KEYS[:5]:  # no randomness: the key changes nothing
        assert torch.equal(transform(image, *key), first)


@pytest.mark.parametrize("train", [True, False])
def test_solid_colour_becomes_its_normalised_constant(photos: dict[str, Path], train: bool) -> None:
    transform = ImageTransforms(SIZE, train=train)
    tensor = transform(load_image(photos["solid.png"], SIZE), 0, 3, 5)
    assert tensor.shape == (3, SIZE, SIZE)
    assert tensor.dtype == torch.float32
    expected = [(200 / 255 - 0.485) / 0.229, (100 / 255 - 0.456) / 0.224, (50 / 255 - 0.406) / 0.225]
    for channel, value in zip(tensor, expected, strict=True):
        assert float((channel - value).abs().max()) <= 1e-5


def _truncated(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


FIX = "replace the file or drop its observation from the labels."
# (how the file is made, the cause the message gives)
BAD_FILES = [
    (lambda path, photo: None, "no such file"),  # never written
    (
        lambda path, photo: path.write_text("not a photo\n"),
        "it is not an image Pillow can read",
    ),  # text named .jpg
    # Cut in the middle of its pixels, or inside its header: both truncated.
    (
        lambda path, photo: (path.write_bytes(photo.read_bytes()), _truncated(path, 0.5)),
        "it is truncated (Pillow could not decode all of it)",
    ),
    (
        lambda path, photo: (path.write_bytes(photo.read_bytes()), _truncated(path, 0.01)),
        "it is truncated (Pillow could not decode all of it)",
    ),
]


@pytest.mark.parametrize(
    ("make", "cause"), BAD_FILES, ids=["missing", "text", "cut_in_pixels", "cut_in_header"]
)
def test_bad_file_is_one_sentence(photos: dict[str, Path], tmp_path: Path, make: Any, cause: str) -> None:
    path = tmp_path / "bad.jpg"
    make(path, photos["large.jpg"])
    with pytest.raises(ImageProblem) as caught:
        load_image(path, SIZE)
    assert str(caught.value) == f"Image {path} cannot be read: {cause}; {FIX}"
    assert caught.value.path == path
    assert isinstance(caught.value, ValueError)
    copy = pickle.loads(pickle.dumps(caught.value))  # as a DataLoader worker sends it back
    assert (str(copy), copy.path) == (str(caught.value), path)


# (target side, the size the 2000 x 1500 JPEG decodes at)
DRAFTS = [
    (32, (250, 188)),  # 1/8 is the smallest scale libjpeg offers
    (64, (250, 188)),  # 1/8: 188 >= 128
    (224, (1000, 750)),  # 1/2: 750 >= 448, while 1/4 (375) would not be
    (360, (1000, 750)),  # 1/2: 750 >= 720
    (400, (2000, 1500)),  # 1/2 would give 750 < 800: whole
]


@pytest.mark.parametrize(("size", "decoded"), DRAFTS)
def test_large_jpeg_decodes_at_reduced_size(
    photos: dict[str, Path], size: int, decoded: tuple[int, int]
) -> None:
    image = load_image(photos["large.jpg"], size)
    assert image.size == decoded
    assert image.mode == "RGB"


def test_randaugment_changes_some_keys_and_stays_keyed(photos: dict[str, Path]) -> None:
    plain = ImageTransforms(SIZE, train=True)
    augmented = ImageTransforms(SIZE, train=True, policy="randaugment")
    image = load_image(photos["small.png"], SIZE)
    changed = [not torch.equal(plain(image, *key), augmented(image, *key)) for key in KEYS]
    # Each of 2 slots applies an op half the time: about 3 keys in 4 change, the others not at all.
    assert 15 <= sum(changed) < len(KEYS)
    assert all(torch.equal(augmented(image, *key), augmented(image, *key)) for key in KEYS[:5])


@pytest.mark.parametrize("name", OP_NAMES)
def test_every_operation_changes_the_photo(name: str) -> None:
    # Checks over the gradient give sharpness edges to act on (it leaves a smooth ramp as it is).
    checks = np.indices((32, 48)).sum(0) // 4 % 2 * 20
    image = Image.fromarray((np.array(gradient(48, 32)) + checks[..., None]).astype(np.uint8))
    fill = (124, 116, 104)
    changed = [np.array(OPS[name](image, sign, fill)) for sign in (1.0, -1.0)]
    assert all(not np.array_equal(c, np.array(image)) for c in changed)
    assert all(c.shape == (32, 48, 3) for c in changed)


# (draws, one (apply, op, sign) triple per slot; the operations they pick)
CHOICES = [
    ([(0.0, 0.0, 0.0)], [("brightness", 1.0)]),  # applied, the first op, the positive sign
    ([(0.7, 0.0, 0.0)], []),  # not applied
    ([(0.1, 0.999, 0.9), (0.49, 4 / 13, 0.2)], [("solarize", -1.0), ("rotate", 1.0)]),
]


@pytest.mark.parametrize(("draws", "ops"), CHOICES)
def test_chosen_ops(draws: list[tuple[float, float, float]], ops: list[tuple[str, float]]) -> None:
    assert chosen_ops(draws) == ops


def test_erasing_zeroes_one_rectangle(photos: dict[str, Path]) -> None:
    plain = ImageTransforms(SIZE, train=True)
    erasing = ImageTransforms(SIZE, train=True, erasing=1.0)
    image = load_image(photos["small.png"], SIZE)
    for key in KEYS:
        before, after = plain(image, *key), erasing(image, *key)
        assert torch.equal(after, erasing(image, *key))
        rows, cols = torch.nonzero((before != after).any(0), as_tuple=True)
        top, bottom, left, right = int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1
        assert not after[:, top:bottom, left:right].any()  # the rectangle is all zeros
        share = (bottom - top) * (right - left) / SIZE**2
        assert 0.015 <= share <= 0.36  # 2% to 1/3 of the image, up to rounding
    half = ImageTransforms(SIZE, train=True, erasing=0.5)
    erased = [not torch.equal(half(image, *key), plain(image, *key)) for key in KEYS]
    assert 10 <= sum(erased) <= 30


# (side, validation's resized shorter side)
RESIZES = [(224, 256), (384, 439), (32, 37)]


@pytest.mark.parametrize(("size", "shorter"), RESIZES)
def test_describe_is_plain_data(size: int, shorter: int) -> None:
    transform = ImageTransforms(size, train=True, policy="randaugment", erasing=0.25)
    described = json.loads(json.dumps(transform.describe()))
    assert described["size"] == size
    assert described["mean"] == [0.485, 0.456, 0.406]
    assert described["std"] == [0.229, 0.224, 0.225]
    assert described["interpolation"] == "bicubic"
    assert described["eval"]["resize"]["shorter_side"] == shorter
    assert described["eval"]["crop"] == {"kind": "centre", "size": [size, size]}
    assert described["train"]["erasing"]["p"] == 0.25
    assert described["train"]["randaugment"]["ops"] == list(OP_NAMES)
    # Validation's transform records the same preprocessing as training's.
    assert ImageTransforms(size, train=False).describe()["eval"] == described["eval"]


# (options, part of the refusal)
BAD_OPTIONS = [
    ({"size": 0}, "size must be a positive number of pixels, not 0"),
    ({"hflip": 1.5}, "hflip is a probability, between 0 and 1, not 1.5"),
    ({"erasing": -0.1}, "erasing is a probability, between 0 and 1, not -0.1"),
    ({"scale": (0.5, 0.2)}, "scale must be (low, high) with 0 < low <= high <= 1, not (0.5, 0.2)"),
    ({"ratio": (0.0, 1.0)}, "ratio must be (low, high) with 0 < low <= high, not (0.0, 1.0)"),
    ({"policy": "autoaugment"}, "policy must be None or 'randaugment', not 'autoaugment'"),
    ({"std": (0.2, 0.2)}, "mean and std need 3 values each"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_options_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ImageTransforms(**{"size": SIZE, "train": True, **options})


def test_a_sideways_phone_photo_is_loaded_upright(tmp_path: Path) -> None:
    """EXIF orientation 6 (stored sideways, shown turned 90 degrees clockwise): loaded as shown."""
    path = tmp_path / "portrait.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    Image.new("RGB", (80, 40), (200, 30, 30)).save(path, exif=exif)
    assert load_image(path, size=64).size == (40, 80)
