"""A light RandAugment (Cubuk et al., 2020) on PIL images, with Pillow alone, its random choices given
by the caller (so that ``images.ImageTransforms`` can key every one of them).

N = 2 operations, each applied with probability 0.5 (timm's ``rand-m9-n2``; that half of the draws
leave an operation out is what makes it light), at the fixed magnitude M = 9 of 10, out of 13:

==============  ======================================================  =========================
operation       what it does at M = 9                                   sign
==============  ======================================================  =========================
brightness      ``ImageEnhance.Brightness`` factor 1 ± 0.81             darker or brighter
contrast        ``ImageEnhance.Contrast`` factor 1 ± 0.81               less or more
color           ``ImageEnhance.Color`` (saturation) factor 1 ± 0.81     greyer or more saturated
sharpness       ``ImageEnhance.Sharpness`` factor 1 ± 0.81              blurred or sharpened
rotate          27° about the centre                                    either way
shear_x/_y      shear 0.27 about the centre                             either way
translate_x/_y  shift by 0.405 of the side                              either way
autocontrast    ``ImageOps.autocontrast``                               (none)
equalize        ``ImageOps.equalize``                                   (none)
posterize       ``ImageOps.posterize``: keep 4 bits per channel         (none)
solarize        ``ImageOps.solarize``: invert pixels >= 141             (none)
==============  ======================================================  =========================

The ranges at M = 10 are timm's (factor 1 ± 0.9, 30°, shear 0.3, translate 0.45). Posterize and
solarize grow with M here (8 - 4M/10 bits kept, threshold 256 - 128M/10), unlike timm's original
pair whose solarize gets milder as M grows. Pixels a geometric operation brings in are filled with
the normalisation mean, so they become zeros in the tensor, as erased pixels do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PIL import Image, ImageEnhance, ImageOps

MAGNITUDE = 9
MAX_MAGNITUDE = 10
NUM_OPS = 2
APPLY_PROB = 0.5

_LEVEL = MAGNITUDE / MAX_MAGNITUDE
_ENHANCE = 0.9 * _LEVEL
_ROTATE_DEGREES = 30.0 * _LEVEL
_SHEAR = 0.3 * _LEVEL
_TRANSLATE = 0.45 * _LEVEL
POSTERIZE_BITS = 8 - round(4 * _LEVEL)
SOLARIZE_THRESHOLD = 256 - round(128 * _LEVEL)

Fill = tuple[int, int, int]


def _affine(image: Image.Image, matrix: tuple[float, ...], fill: Fill) -> Image.Image:
    # Pillow's AFFINE data maps each output pixel back to the input pixel it samples.
    return image.transform(
        image.size, Image.Transform.AFFINE, matrix, Image.Resampling.BILINEAR, fillcolor=fill
    )


def _shear_x(image: Image.Image, sign: float, fill: Fill) -> Image.Image:
    shear = sign * _SHEAR
    return _affine(image, (1.0, shear, -shear * image.height / 2, 0.0, 1.0, 0.0), fill)


def _shear_y(image: Image.Image, sign: float, fill: Fill) -> Image.Image:
    shear = sign * _SHEAR
    return _affine(image, (1.0, 0.0, 0.0, shear, 1.0, -shear * image.width / 2), fill)


def _translate_x(image: Image.Image, sign: float, fill: Fill) -> Image.Image:
    return _affine(image, (1.0, 0.0, sign * _TRANSLATE * image.width, 0.0, 1.0, 0.0), fill)


def _translate_y(image: Image.Image, sign: float, fill: Fill) -> Image.Image:
    return _affine(image, (1.0, 0.0, 0.0, 0.0, 1.0, sign * _TRANSLATE * image.height), fill)


def _rotate(image: Image.Image, sign: float, fill: Fill) -> Image.Image:
    return image.rotate(sign * _ROTATE_DEGREES, Image.Resampling.BILINEAR, fillcolor=fill)


def _enhancer(
    kind: Callable[[Image.Image], ImageEnhance._Enhance],
) -> Callable[[Image.Image, float, Fill], Image.Image]:
    def enhance(image: Image.Image, sign: float, fill: Fill) -> Image.Image:
        return kind(image).enhance(1.0 + sign * _ENHANCE)

    return enhance


OPS: dict[str, Callable[[Image.Image, float, Fill], Image.Image]] = {
    "brightness": _enhancer(ImageEnhance.Brightness),
    "contrast": _enhancer(ImageEnhance.Contrast),
    "color": _enhancer(ImageEnhance.Color),
    "sharpness": _enhancer(ImageEnhance.Sharpness),
    "rotate": _rotate,
    "shear_x": _shear_x,
    "shear_y": _shear_y,
    "translate_x": _translate_x,
    "translate_y": _translate_y,
    "autocontrast": lambda image, sign, fill: ImageOps.autocontrast(image),
    "equalize": lambda image, sign, fill: ImageOps.equalize(image),
    "posterize": lambda image, sign, fill: ImageOps.posterize(image, POSTERIZE_BITS),
    "solarize": lambda image, sign, fill: ImageOps.solarize(image, SOLARIZE_THRESHOLD),
}
OP_NAMES: tuple[str, ...] = tuple(OPS)


def chosen_ops(draws: Sequence[tuple[float, float, float]]) -> list[tuple[str, float]]:
    """The operations (name, sign ±1) that ``draws`` pick: one ``(apply, op, sign)`` triple of
    uniforms in [0, 1) per slot; a slot whose ``apply`` is not below ``APPLY_PROB`` picks none."""
    picked = []
    for apply, op, sign in draws:
        if apply < APPLY_PROB:
            picked.append(
                (OP_NAMES[min(int(op * len(OP_NAMES)), len(OP_NAMES) - 1)], 1.0 if sign < 0.5 else -1.0)
            )
    return picked


def rand_augment(image: Image.Image, draws: Sequence[tuple[float, float, float]], fill: Fill) -> Image.Image:
    """``image`` (RGB) with the operations ``draws`` pick applied in order; ``fill`` is the colour
    (0-255) of the pixels a rotation, shear or translation brings in."""
    for name, sign in chosen_ops(draws):
        image = OPS[name](image, sign, fill)
    return image
