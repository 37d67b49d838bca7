"""Reads a `shapes` image back into the attributes its prompt names: deterministic, no learned weights.

The background is the border's colour, the object the most common other palette colour; the object's pixels are
those nearer its colour than the background's. Its bounding box gives the position (nearest of the nine centres)
and the size (the box's side against the two sizes' midpoint); the holes filled, the share of the box it covers
gives the shape (a triangle covers 1/2, a circle pi/4, a square all of it), and how much of that a hole takes
tells an outline from a filled shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from models.shapes.scenes import COLOURS, POSITIONS, SIZE, SIZES

NONE = "none"  # an attribute the image does not show (no object found)
_PALETTE_NAMES = tuple(COLOURS)
_PALETTE = np.array([COLOURS[name] for name in _PALETTE_NAMES], dtype=np.float32)
BORDER = 4  # pixels of each edge that make up the background's sample
MIN_OBJECT_PIXELS = 40  # fewer pixels of any other colour: no object
# Fill ratios of a filled shape's bounding box: triangle 0.5, circle pi/4 = 0.785, square 1.0; split halfway.
TRIANGLE_BELOW, SQUARE_ABOVE = 0.64, 0.89
OUTLINE_HOLE_SHARE = 0.15  # a hole taking more than this share of the filled shape: an outline
SIZE_SPLIT = sum(SIZES.values()) / 2


@dataclass(frozen=True)
class Reading:
    shape: str
    colour: str
    background: str
    position: str
    size: str
    style: str

    def as_dict(self) -> dict[str, str]:
        return dict(self.__dict__)


def _nearest(pixels: np.ndarray) -> np.ndarray:
    """Index of the nearest palette colour for each RGB pixel ([..., 3] -> [...])."""
    return np.argmin(((pixels[..., None, :] - _PALETTE) ** 2).sum(-1), axis=-1)


def read_image(image) -> Reading:
    """The attributes a PIL image (or an HxWx3 uint8 array) shows, resized to SIZE x SIZE first."""
    from PIL import Image

    if isinstance(image, Image.Image):
        if image.size != (SIZE, SIZE):
            image = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        image = np.asarray(image.convert("RGB"))
    pixels = image.astype(np.float32)
    labels = _nearest(pixels)
    border = np.concatenate([labels[:BORDER].ravel(), labels[-BORDER:].ravel(), labels[:, :BORDER].ravel(),
                             labels[:, -BORDER:].ravel()])
    background = int(np.bincount(border, minlength=len(_PALETTE)).argmax())
    counts = np.bincount(labels.ravel(), minlength=len(_PALETTE))
    counts[background] = 0
    colour = int(counts.argmax())
    if counts[colour] < MIN_OBJECT_PIXELS:
        return Reading(NONE, NONE, _PALETTE_NAMES[background], NONE, NONE, NONE)

    # Object pixels: nearer the object's colour than the background's; the largest connected piece of them.
    to_object = ((pixels - _PALETTE[colour]) ** 2).sum(-1)
    to_background = ((pixels - _PALETTE[background]) ** 2).sum(-1)
    pieces, count = ndimage.label(to_object < to_background)
    sizes = ndimage.sum_labels(np.ones_like(pieces), pieces, index=np.arange(1, count + 1))
    mask = pieces == (int(np.argmax(sizes)) + 1)
    rows, cols = np.nonzero(mask)
    top, bottom, left, right = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    width, height = right - left, bottom - top

    solid = ndimage.binary_fill_holes(mask)
    fill = solid.sum() / float(width * height)
    shape = "triangle" if fill < TRIANGLE_BELOW else "square" if fill > SQUARE_ABOVE else "circle"
    style = "outline" if (solid.sum() - mask.sum()) > OUTLINE_HOLE_SHARE * solid.sum() else "filled"
    centre = np.array([(left + right) / 2, (top + bottom) / 2]) / SIZE
    position = min(POSITIONS, key=lambda name: float(((np.array(POSITIONS[name][0]) - centre) ** 2).sum()))
    size = "large" if max(width, height) > SIZE_SPLIT else "small"
    return Reading(shape, _PALETTE_NAMES[colour], _PALETTE_NAMES[background], position, size, style)
