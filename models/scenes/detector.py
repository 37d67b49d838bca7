"""Reads a `scenes` image back into what its prompt names: deterministic, numpy and scipy.ndimage, no learned weights.

The background's two halves are the majority palette colours (nearest of the palette and the pattern ink's grey) of
a strip along each half's border: its outer rows and side columns; two-tone where they differ. A pixel is the
background's where it is nearer its half's colour than any other colour and any blend of another colour with the
ink (a pattern's antialiased edge, black and the ink halfway, is nearest green: an object's even on green). Where
the halves differ, the split row's seam in a blurred, resized or compressed image (blends of the two colours, or
runs of a row or two of any colour, that end within a few rows of the split) is background too.

The objects are the connected pieces of the other pixels: crumbs and thin slivers along the split are dropped, and
the pieces whose boxes are centred in one cell of the 3x3 grid are one object (a blurred pattern or outline may
break an object into pieces; no object leaves its cell). For each object:

- its silhouette is its pixels with the holes filled; the centre of its box gives the place (the nearest cell's);
- its colour: each of its pixels, the edge eroded and the ink's left out, votes for the palette colour whose blend
  with the background or with the ink lies nearest (a blurred thin outline has no pixel of its pure colour);
- its cover: each pixel's share of the object's colour against the background's (on the split, against a blend of
  the halves'), 1 inside a patterned or outlined silhouette; an antialiased or blurred edge's pixels count as much
  as they cover, so blurring changes nothing of what follows. The box's sides (the sums of the columns' and rows'
  largest cover) give the size against the midpoints between the sizes; the shape is a triangle where the rows'
  masses are skewed as a triangle's pointing up (blurring keeps a third moment), else a square or a circle by the
  share of the box the cover fills (1 against pi/4);
- its fill: outlined where the hole (the silhouette less its own pixels) is a large share of the silhouette; else,
  inside the silhouette eroded clear of its edge, each pixel lies a share of the way from the object's colour to
  the ink, and the mean share (the share of ink) and the colour<->ink changes per pixel along rows (x) and along
  columns (y) (with hysteresis: a noisy line of halfway pixels along a pattern's edge is no change) tell the
  patterns apart: no ink is solid (and so is an object too small to hold a dot's period); changes along x only are
  stripes, 2/16 per pixel striped and 2/8 pinstriped; changes along both are dotted (a fifth of the pixels ink) or
  checkered (half of them). The frequency reported is the changes along x plus those along y (striped 2/16,
  pinstriped and checkered 2/8, dotted about 0.15).

A model's or a VAE's image is read the same way: nothing here assumes the renderer's exact pixels, only the palette,
the grid, the shapes and the patterns' frequencies (each threshold sits halfway between the values the world draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from models.scenes.world import (
    COLOURS,
    DOT_PERIOD,
    DOT_RADIUS,
    INK,
    PINSTRIPE_PERIOD,
    PLACES,
    SIZE,
    SIZES,
    STRIPE_PERIOD,
    cell_centre,
)

_NAMES = (*COLOURS, "ink")  # a pixel's label indexes these
_INK = len(COLOURS)
_PALETTE = np.array([*COLOURS.values(), INK], dtype=np.float32)
_CELL = SIZE / 3  # a grid cell's side
SPLIT = SIZE // 2  # the first row of a two-tone background's bottom half

BORDER = 4  # rows (and side columns) of each half's edge that sample its background; no object comes this near
SPLIT_BAND = 4  # rows either side of the split where a blend of the two background colours is background
SEAM_DISTANCE = 40.0  # RGB distance from the line between the two background colours that counts as their blend
SEAM_RUN = 2  # a run of this many rows or fewer across the split is a seam's whatever its colour
MIN_PIECE_PIXELS = 6  # a connected piece smaller than this is a crumb (noise, a stray antialiased pixel)
MIN_OBJECT_PIXELS = 30  # an object has at least this many pixels (a tiny triangle has 72)
SLIVER_ASPECT = 2.0  # a piece within the split band at least this many times wider than tall is a seam's sliver
EDGE_RING = 3  # pixels around a silhouette where a blurred edge's partial cover may lie
# Less cover than this is none: noise's, not an edge's (the ring's noisy pixels would widen a box by their maxima;
# a blurred edge's cover below it is a tenth of a pixel per pixel of edge).
COVER_FLOOR = 0.2

# The bounding box's longer side against the midpoints between the sizes (12 | 21 | 30 | 45 | 60).
_SIZE_NAMES = tuple(sorted(SIZES, key=SIZES.get))
SIZE_SPLITS = tuple((SIZES[a] + SIZES[b]) / 2 for a, b in zip(_SIZE_NAMES, _SIZE_NAMES[1:]))
# A triangle (pointing up) has its mass low: its rows' masses grow linearly downwards, a skewness of -2 sqrt(2) / 5
# = -0.566 (a circle's and a square's is 0); split halfway. Blurring keeps the third moment, so a blurred triangle
# stays skewed though its corners round off.
TRIANGLE_SKEW = -np.sqrt(2) / 5
# Share of the bounding box a circle covers: pi/4 = 0.785, a square 1.0; split halfway.
SQUARE_ABOVE = (np.pi / 4 + 1) / 2
# A hole taking more than this share of the silhouette is an outline's (a small outlined triangle's hole takes 0.46,
# a large square's 0.81; a patterned or solid object has none).
OUTLINE_HOLE_SHARE = 0.2
COLOUR_EROSION = 1  # pixels off an object's edge for its colour (an outline's band is 3 wide: 1 pixel remains)
FILL_EROSION = 3  # pixels off the silhouette's edge for the pattern (clear of the antialiased, blurred edge)
# Fewer pixels than a dot's period square in what is left: too small to show a pattern, solid (a tiny object's 12
# pixels leave 6 across, a small triangle's 200 pixels).
MIN_PATTERN_PIXELS = DOT_PERIOD ** 2
# A pixel is ink where it lies past this fraction of the way from the object's colour to the ink's.
INK_SPLIT = 0.5
INK_MARGIN = 0.15  # how far past INK_SPLIT a pixel must lie to change a line from colour to ink or back
# Ink shares: solid has none; a dotted fill pi r^2 / period^2 = 0.2; striped, pinstriped and checkered half.
DOTTED_INK_SHARE = np.pi * DOT_RADIUS ** 2 / DOT_PERIOD ** 2
SOLID_INK_BELOW = DOTTED_INK_SHARE / 4
CHECKERED_INK_ABOVE = (DOTTED_INK_SHARE + 0.5) / 2
# Changes along y as a share of changes along both: stripes (vertical) have none, dots and checkers half.
STRIPES_BELOW = 0.25
# Changes per pixel along x: striped 2/16, pinstriped 2/8; split halfway (geometric, on a scale of frequencies).
PINSTRIPED_ABOVE = float(np.sqrt(2 / STRIPE_PERIOD * 2 / PINSTRIPE_PERIOD))


@dataclass(frozen=True)
class ObjectReading:
    shape: str
    colour: str
    size: str
    fill: str
    place: str
    mask: np.ndarray  # bool [SIZE, SIZE]: the silhouette (the object's pixels, holes filled)
    centroid: tuple[float, float]  # (x, y) of the silhouette, in pixels
    rgb: tuple[float, float, float]  # mean colour (0..255) of its own colour's pixels (no ink, no antialiased edge)
    frequency: float  # colour<->ink changes a pixel in the eroded silhouette, along x plus along y (0: solid, outline)

    def attributes(self) -> dict[str, str]:
        return {"shape": self.shape, "colour": self.colour, "size": self.size, "fill": self.fill, "place": self.place}


@dataclass(frozen=True)
class SceneReading:
    background: str  # as Scene.backdrop names it: "white" or "white over blue"
    objects: tuple[ObjectReading, ...]  # in the reading order of their places

    def as_dict(self) -> dict:
        """JSON-able (no masks): the background, the count and each object's attributes."""
        return {"background": self.background, "count": str(len(self.objects)),
                "objects": [o.attributes() for o in self.objects]}


def expected_reading(scene) -> dict:
    """What a right reading's as_dict() is for a world.Scene (a tiny object's fill is solid: the world draws it so)."""
    return {"background": scene.backdrop, "count": str(len(scene.objects)),
            "objects": [{"shape": o.shape, "colour": o.colour, "size": o.size, "fill": o.fill, "place": o.place}
                        for o in scene.objects]}


def _pixels(image) -> np.ndarray:
    """A PIL image or an HxWx3 uint8 array as float RGB [SIZE, SIZE, 3] (resized bilinearly where not SIZE)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        array = np.asarray(image)
        if array.shape[:2] == (SIZE, SIZE) and array.ndim == 3 and array.shape[2] == 3:
            return array.astype(np.float32)
        image = Image.fromarray(array.astype(np.uint8))
    image = image.convert("RGB")
    if image.size != (SIZE, SIZE):
        image = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(image).astype(np.float32)


def _nearest(pixels: np.ndarray) -> np.ndarray:
    """Index of the nearest of the palette's colours and the ink for each RGB pixel ([..., 3] -> [...])."""
    # |p - c|^2 less |p|^2, the same for every c
    return np.argmin((_PALETTE ** 2).sum(-1) - 2 * pixels @ _PALETTE.T, axis=-1)


def _blend_distances(pixels: np.ndarray) -> np.ndarray:
    """Each pixel's squared distance from each palette colour's line to the ink (its blends with the ink, both ends
    included): [..., 3] -> [..., len(COLOURS)]."""
    ends = _PALETTE[:_INK]
    directions = _PALETTE[_INK] - ends  # [C, 3]
    lengths = (directions ** 2).sum(-1)
    along = pixels @ directions.T - (ends * directions).sum(-1)  # (pixel - end) . direction
    offsets = (pixels ** 2).sum(-1, keepdims=True) - 2 * pixels @ ends.T + (ends ** 2).sum(-1)  # |pixel - end|^2
    t = np.clip(along / lengths, 0, 1)
    return offsets - 2 * t * along + t ** 2 * lengths


def _background(pixels: np.ndarray, top: int, bottom: int) -> np.ndarray:
    """Whether each pixel is nearer its half's background colour than any other colour or any blend of one with the
    ink (a pattern's antialiased edge, black's and the ink's halfway, is nearest green: an object's, not the
    background's)."""
    blends = _blend_distances(pixels)
    halves = []
    for rows, colour in ((slice(0, SPLIT), top), (slice(SPLIT, SIZE), bottom)):
        others = np.delete(blends[rows], colour, axis=-1).min(-1)
        halves.append(((pixels[rows] - _PALETTE[colour]) ** 2).sum(-1) <= others)
    return np.concatenate(halves)


def _majority(labels: np.ndarray) -> int:
    """The most common palette label (ink never is a background): the lowest index on a tie."""
    counts = np.bincount(labels.ravel(), minlength=len(_NAMES))[:_INK]
    return int(counts.argmax())


def _backgrounds(labels: np.ndarray) -> tuple[int, int]:
    """The top and bottom halves' background labels, from each half's outer rows and side columns."""
    def strip(rows: slice, edge: slice) -> np.ndarray:
        half = labels[rows]
        return np.concatenate([half[edge].ravel(), half[:, :BORDER].ravel(), half[:, -BORDER:].ravel()])

    top = strip(slice(0, SPLIT - SPLIT_BAND), slice(0, BORDER))
    bottom = strip(slice(SPLIT + SPLIT_BAND, SIZE), slice(-BORDER, None))
    return _majority(top), _majority(bottom)


def _seam_colours(pixels: np.ndarray, top: int, bottom: int) -> np.ndarray:
    """Pixels of the split band whose colour blends the two halves' background colours (a blurred or resized
    image's seam has them; so may an object's ink): bool [SIZE, SIZE]."""
    seam = np.zeros(pixels.shape[:2], dtype=bool)
    if top == bottom:
        return seam
    a, b = SPLIT - SPLIT_BAND, SPLIT + SPLIT_BAND
    band = pixels[a:b]
    start, direction = _PALETTE[top], _PALETTE[bottom] - _PALETTE[top]
    t = np.clip(((band - start) @ direction) / float(direction @ direction), 0, 1)
    seam[a:b] = np.linalg.norm(band - (start + t[..., None] * direction), axis=-1) < SEAM_DISTANCE
    return seam


def _seam(foreground: np.ndarray, seam_colours: np.ndarray) -> np.ndarray:
    """The foreground pixels of the split band whose runs up and down their column end in background within the
    band, of seam colours or in runs of at most SEAM_RUN rows (a compressed image's seam may be of any colour): a
    seam's, not an object's (an object straddling the split runs further; its ink stays)."""
    a, b = SPLIT - SPLIT_BAND, SPLIT + SPLIT_BAND
    outside = SIZE  # a run reaching past the band is no seam's, however short in it
    up = np.zeros((b - a, SIZE), dtype=np.int64)  # foreground pixels from each up to its run's top, itself included
    down = np.zeros_like(up)
    before, after = np.where(foreground[a - 1], outside, 0), np.where(foreground[b], outside, 0)
    for r in range(b - a):
        before = up[r] = np.where(foreground[a + r], before + 1, 0)
        after = down[-1 - r] = np.where(foreground[b - 1 - r], after + 1, 0)
    run = up + down - 1
    bounded = foreground[a:b] & (run < outside)
    seam = np.zeros_like(foreground)
    seam[a:b] = bounded & (seam_colours[a:b] | (run <= SEAM_RUN))
    return seam


def _pieces(foreground: np.ndarray, two_tone: bool) -> dict[int, np.ndarray]:
    """The foreground's connected pieces, less crumbs and seam slivers, merged by the grid cell their boxes centre
    in: cell index (row * 3 + column) -> mask."""
    pieces, count = ndimage.label(foreground, structure=np.ones((3, 3), dtype=bool))
    sizes = np.bincount(pieces.ravel(), minlength=count + 1)
    cells: dict[int, list[int]] = {}
    for index, box in enumerate(ndimage.find_objects(pieces), start=1):
        if box is None or sizes[index] < MIN_PIECE_PIXELS:
            continue
        rows, cols = box
        height, width = rows.stop - rows.start, cols.stop - cols.start
        if (two_tone and rows.start >= SPLIT - SPLIT_BAND and rows.stop <= SPLIT + SPLIT_BAND
                and width >= SLIVER_ASPECT * height):
            continue
        x, y = (cols.start + cols.stop) / 2, (rows.start + rows.stop) / 2
        cell = min(int(y // _CELL), 2) * 3 + min(int(x // _CELL), 2)
        cells.setdefault(cell, []).append(index)
    merged = {}
    for cell, indices in cells.items():
        mask = np.isin(pieces, indices)
        if mask.sum() >= MIN_OBJECT_PIXELS:
            merged[cell] = mask
    return merged


def _changes(t: np.ndarray, inside: np.ndarray, axis: int) -> float:
    """Colour<->ink changes per pair of neighbouring pixels along an axis (1: along rows, x; 0: along columns, y),
    over pairs both inside; t: each pixel's share of the way from the object's colour to the ink.

    A line's pixels are colour or ink with hysteresis: ink from where t rises past INK_SPLIT + INK_MARGIN until it
    falls below INK_SPLIT - INK_MARGIN. A pattern's edge halfway between two pixels leaves a line of halfway pixels
    along it, which noise would otherwise turn to ink and back at random: changes along the edge."""
    lines, inner = (t, inside) if axis == 1 else (t.T, inside.T)
    state = np.zeros(lines.shape, dtype=bool)  # ink, along each line
    for j in range(lines.shape[1]):
        value = lines[:, j]
        carried = value > INK_SPLIT  # a line's first pixel, or the first past a gap, by INK_SPLIT alone
        if j:
            carried = np.where(inner[:, j - 1], state[:, j - 1], carried)
        state[:, j] = np.where(value > INK_SPLIT + INK_MARGIN, True,
                               np.where(value < INK_SPLIT - INK_MARGIN, False, carried))
    pairs = inner[:, :-1] & inner[:, 1:]
    count = int(pairs.sum())
    return float((state[:, :-1] != state[:, 1:])[pairs].sum()) / count if count else 0.0


def _fill(pixels: np.ndarray, own: np.ndarray, silhouette: np.ndarray, colour: int) -> tuple[str, float]:
    """An object's fill and its pattern's frequency (changes along x plus along y per pixel; an outline's 0)."""
    area = int(silhouette.sum())
    if area - int(own.sum()) > OUTLINE_HOLE_SHARE * area:
        return "outlined", 0.0  # no pattern: a band of its colour round a hole
    core = ndimage.binary_erosion(silhouette, iterations=FILL_EROSION) & own
    colour_rgb, ink_rgb = _PALETTE[colour], _PALETTE[_INK]
    direction = ink_rgb - colour_rgb
    t = ((pixels - colour_rgb) @ direction) / float(direction @ direction)
    along_x, along_y = _changes(t, core, 1), _changes(t, core, 0)
    frequency = along_x + along_y
    # Each pixel counts its share of ink: an antialiased pattern edge's halfway pixels, which fall to one side of
    # INK_SPLIT or the other alike, count half (a count of ink pixels would be biased by a pixel a period).
    ink_share = float(np.clip(t[core], 0, 1).mean()) if core.any() else 0.0
    if core.sum() < MIN_PATTERN_PIXELS or ink_share < SOLID_INK_BELOW or frequency == 0:
        return "solid", frequency
    if along_y < STRIPES_BELOW * frequency:
        return ("pinstriped" if along_x > PINSTRIPED_ABOVE else "striped"), frequency
    return ("checkered" if ink_share > CHECKERED_INK_ABOVE else "dotted"), frequency


def _backdrop(rows: np.ndarray, width: int, top: int, bottom: int) -> np.ndarray:
    """The background's colour behind each pixel of these rows: [len(rows), width, 3]."""
    return np.repeat(np.where((rows < SPLIT)[:, None], _PALETTE[top], _PALETTE[bottom])[:, None], width, 1)


def _segment_distances(points: np.ndarray, starts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Squared distances of points [n, 3] from the segments from starts ([n, 3] or [3]) to one end [3]."""
    directions = end - starts
    lengths = np.maximum((directions ** 2).sum(-1), 1e-9)
    t = np.clip(((points - starts) * directions).sum(-1) / lengths, 0, 1)
    return (((points - starts) - t[..., None] * directions) ** 2).sum(-1)


def _colour(pixels: np.ndarray, backdrop: np.ndarray) -> int:
    """The palette colour whose blends with the background or with the ink explain most of these pixels (each votes
    for the nearest such blend: a thin blurred outline has no pixel of its pure colour, and a blend of two colours
    may be nearest a third)."""
    distances = np.empty((len(pixels), _INK))
    for colour in range(_INK):
        end = _PALETTE[colour]
        distances[:, colour] = np.minimum(_segment_distances(pixels, backdrop, end),
                                          _segment_distances(pixels, end, _PALETTE[_INK]))
        distances[np.all(backdrop == end, -1), colour] = np.inf  # no object has the colour behind it
    return _majority(distances.argmin(-1))


def _coverage(pixels: np.ndarray, backdrop: np.ndarray, rows: np.ndarray, silhouette: np.ndarray, colour: int,
              top: int, bottom: int, solid: bool) -> np.ndarray:
    """How much of each pixel the object covers, in [0, 1]: the object colour's share of the pixel's colour (an
    antialiased or blurred edge's partial cover), the rest its half's background colour or, along the split, a
    blend of the two halves' (a blurred seam's); a pattern's or an outline's object counts 1 inside its silhouette
    (its ink, its hole) and so only on its edge."""
    near = np.broadcast_to((np.abs(rows + 0.5 - SPLIT) <= SPLIT_BAND)[:, None], silhouette.shape)
    towards = _PALETTE[colour] - backdrop
    cover = ((pixels - backdrop) * towards).sum(-1) / np.maximum((towards ** 2).sum(-1), 1.0)
    if top != bottom and near.any():  # pixel - top = cover (colour - top) + share (bottom - top), least squares
        basis = np.stack([_PALETTE[colour] - _PALETTE[top], _PALETTE[bottom] - _PALETTE[top]], 1)  # [3, 2]
        solved = (pixels[near] - _PALETTE[top]) @ np.linalg.pinv(basis).T
        cover[near] = solved[:, 0]
    cover = np.where(cover < COVER_FLOOR, 0.0, np.clip(cover, 0, 1))
    if not solid:
        cover[ndimage.binary_erosion(silhouette)] = 1
    cover[~ndimage.binary_dilation(silhouette, iterations=EDGE_RING)] = 0
    return cover


def _skew(profile: np.ndarray) -> float:
    """The skewness of a mass profile (along its one axis)."""
    at = np.arange(profile.size, dtype=np.float64)
    mass = max(float(profile.sum()), 1e-9)
    mean = float((profile * at).sum()) / mass
    variance = float((profile * (at - mean) ** 2).sum()) / mass
    return float((profile * (at - mean) ** 3).sum()) / mass / max(variance, 1e-9) ** 1.5


def _object(pixels: np.ndarray, labels: np.ndarray, top: int, bottom: int, own: np.ndarray) -> ObjectReading:
    """One object's reading from its pixels (own: a bool mask of the whole image)."""
    rows, cols = np.nonzero(own)
    # Work in the object's box with a margin (erosions, dilations and hole filling see the margin as outside).
    margin = EDGE_RING + 1
    r0, r1 = max(rows.min() - margin, 0), min(rows.max() + 1 + margin, SIZE)
    c0, c1 = max(cols.min() - margin, 0), min(cols.max() + 1 + margin, SIZE)
    window = (slice(r0, r1), slice(c0, c1))
    own_w, labels_w, pixels_w = own[window], labels[window], pixels[window]
    silhouette_w = ndimage.binary_fill_holes(own_w)

    backdrop_w = _backdrop(np.arange(r0, r1), c1 - c0, top, bottom)
    eroded = ndimage.binary_erosion(own_w, iterations=COLOUR_EROSION)
    voters = next((m for m in (eroded & (labels_w != _INK), own_w & (labels_w != _INK)) if m.any()), own_w)
    colour = _colour(pixels_w[voters], backdrop_w[voters])
    # Its own colour's pixels away from any edge, the background's or the ink's (a thin blurred outline may have
    # none such: then its pixels of its colour, or the palette's colour).
    labelled = own_w & (labels_w == colour)
    body = next((m for m in (ndimage.binary_erosion(labelled, iterations=COLOUR_EROSION), labelled) if m.any()), None)
    rgb = tuple(float(v) for v in (pixels_w[body].mean(0) if body is not None else _PALETTE[colour]))

    # The box's sides and the area covered, each pixel counting its cover: an edge's partial pixels, antialiased or
    # blurred, count as much as they cover (a hard mask's count of them would depend on the blur).
    fill, frequency = _fill(pixels_w, own_w, silhouette_w, colour)
    cover = _coverage(pixels_w, backdrop_w, np.arange(r0, r1), silhouette_w, colour, top, bottom, fill == "solid")
    width, height = float(cover.max(0).sum()), float(cover.max(1).sum())
    share = float(cover.sum()) / max(width * height, 1.0)
    skew = _skew(cover.sum(1))
    shape = "triangle" if skew < TRIANGLE_SKEW else "square" if share > SQUARE_ABOVE else "circle"
    size = _SIZE_NAMES[sum(max(width, height) > split for split in SIZE_SPLITS)]
    ys, xs = np.nonzero(silhouette_w)
    upper, lower, left, right = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    centre = np.array([c0 + (left + right) / 2, r0 + (upper + lower) / 2])
    place = min(PLACES, key=lambda p: float(((np.array(cell_centre(p)) - centre) ** 2).sum()))

    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[window] = silhouette_w
    centroid = (float(xs.mean() + c0 + 0.5), float(ys.mean() + r0 + 0.5))
    return ObjectReading(shape, _NAMES[colour], size, fill, place, mask, centroid, rgb, frequency)


def read_image(image) -> SceneReading:
    """What a PIL image (any size: resized to SIZE bilinearly) or an HxWx3 uint8 array shows."""
    pixels = _pixels(image)
    labels = _nearest(pixels)
    top, bottom = _backgrounds(labels)
    foreground = ~_background(pixels, top, bottom)
    if top != bottom:
        foreground &= ~_seam(foreground, _seam_colours(pixels, top, bottom))
    objects = [_object(pixels, labels, top, bottom, mask)
               for _, mask in sorted(_pieces(foreground, top != bottom).items())]
    objects.sort(key=lambda o: PLACES.index(o.place))
    background = _NAMES[top] if top == bottom else f"{_NAMES[top]} over {_NAMES[bottom]}"
    return SceneReading(background, tuple(objects))
