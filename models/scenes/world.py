"""The `scenes` world: one to four objects on a 3x3 grid of places, with fill patterns of a spatial frequency, thin
outlines, objects down to 12 pixels and plain or two-tone backgrounds; their prompts and the renderer.

The same definitions train the `scenes` model (models/scenes/train.py), tell the detector (models/scenes/detector.py)
what to look for and make sd-quality's `scenes` case set, so the three can never disagree. A prompt names every
attribute the detector reads: each object's size, colour, fill, shape and place (which gives the relations between
objects: left of, above), the background, and so the count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from models.shapes.scenes import COLOURS

SIZE = 256  # image side in pixels (latents 32x32)
SHAPES = ("circle", "square", "triangle")
# COLOURS: `shapes`' palette, for objects and backgrounds; an object never has a colour of its background.
INK = (128, 128, 128)  # a pattern's second colour: grey, in no object's or background's palette
# The places: a 3x3 grid, rows top to bottom, columns left to right; an object's box is centred in its cell.
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
PLACES = tuple(f"{row} {column}" for row in ROWS for column in COLUMNS)
PLACE_PHRASES = {place: "in the center" if place == "middle center" else f"at the {place}" for place in PLACES}
SIZES = {"tiny": 12, "small": 30, "large": 60}  # the bounding box's side in pixels
# A fill is solid, a pattern of grey ink at one spatial frequency, or a thin outline. Periods in pixels.
FILLS = ("solid", "striped", "pinstriped", "dotted", "checkered", "outlined")
STRIPE_PERIOD, PINSTRIPE_PERIOD, DOT_PERIOD, CHECKER_PERIOD = 16, 8, 10, 16
DOT_RADIUS = 2.5
OUTLINE_PIXELS = 3.0  # an outline's width, whatever the object's size
PATTERNED_SIZES = ("small", "large")  # a tiny object is solid: 12 pixels hold no period of a pattern
MAX_OBJECTS = 4
JITTER_PIXELS = 5  # training and judged scenes move each centre by up to this much (the detector reads places)
TWO_TONE_SHARE = 0.4  # of random scenes with a background of two colours, the top half's over the bottom's


def cell_centre(place: str) -> tuple[float, float]:
    """The (x, y) pixel centre of a place's cell."""
    row, column = place.split(" ")
    return ((COLUMNS.index(column) + 0.5) * SIZE / 3, (ROWS.index(row) + 0.5) * SIZE / 3)


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    fill: str
    place: str

    @property
    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.fill} {self.shape} {PLACE_PHRASES[self.place]}"


@dataclass(frozen=True)
class Scene:
    """Objects in reading order of their places (row by row), each place at most once; a background's top half
    colour and its bottom half's (the same for a plain one)."""

    objects: tuple[SceneObject, ...]
    background: str
    background_bottom: str | None = None  # None: plain

    @property
    def backdrop(self) -> str:
        """How a prompt and the detector name the background."""
        return self.background if self.background_bottom is None else f"{self.background} over {self.background_bottom}"

    @property
    def prompt(self) -> str:
        phrases = [o.phrase for o in self.objects]
        listed = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
        return f"{listed} on a {self.backdrop} background"

    def with_(self, **changes) -> Scene:
        return replace(self, **changes)

    def background_colours(self) -> tuple[str, ...]:
        return (self.background,) if self.background_bottom is None else (self.background, self.background_bottom)


def ordered(objects) -> tuple[SceneObject, ...]:
    return tuple(sorted(objects, key=lambda o: PLACES.index(o.place)))


def random_scene(rng: random.Random, count: int | None = None) -> Scene:
    """A scene of `count` objects (None: one to four, evenly), in distinct places; object colours drawn from those
    neither background half has."""
    count = rng.randint(1, MAX_OBJECTS) if count is None else count
    background = rng.choice(list(COLOURS))
    bottom = rng.choice([c for c in COLOURS if c != background]) if rng.random() < TWO_TONE_SHARE else None
    free = [c for c in COLOURS if c not in (background, bottom)]
    objects = []
    for place in rng.sample(PLACES, count):
        size = rng.choice(list(SIZES))
        fill = rng.choice(FILLS) if size in PATTERNED_SIZES else "solid"
        objects.append(SceneObject(rng.choice(SHAPES), rng.choice(free), size, fill, place))
    return Scene(ordered(objects), background, bottom)


# ---- rendering ---------------------------------------------------------------------------------------------------

def scene_tensors(scenes: list[Scene], rng: random.Random | None = None, device="cpu") -> dict[str, torch.Tensor]:
    """render_batch's inputs for these scenes (object slots padded to MAX_OBJECTS); with `rng`, each centre
    jittered by up to JITTER_PIXELS."""
    def jitter() -> float:
        return rng.uniform(-JITTER_PIXELS, JITTER_PIXELS) if rng else 0.0

    palette = {name: [c / 255 for c in rgb] for name, rgb in COLOURS.items()}
    absent = (False, 0, 0, [0.0, 0.0, 0.0], 1.0, [0.0, 0.0])
    slots = []  # per scene, per slot: present, shape, fill, colour, side, centre (lists first: one tensor each)
    for scene in scenes:
        row = []
        for o in scene.objects:
            x, y = cell_centre(o.place)
            row.append((True, SHAPES.index(o.shape), FILLS.index(o.fill), palette[o.colour], float(SIZES[o.size]),
                        [x + jitter(), y + jitter()]))
        slots.append(row + [absent] * (MAX_OBJECTS - len(row)))
    columns = list(zip(*(zip(*row) for row in slots))) if scenes else [()] * 6
    names = ("present", "shape", "fill", "colour", "side", "centre")
    types = (torch.bool, torch.long, torch.long, torch.float32, torch.float32, torch.float32)
    tensors = {name: torch.tensor([list(column) for column in columns[index]], dtype=kind)
               for index, (name, kind) in enumerate(zip(names, types))}
    tensors["top"] = torch.tensor([palette[s.background] for s in scenes])
    tensors["bottom"] = torch.tensor([palette[s.background_bottom or s.background] for s in scenes])
    return {name: value.to(device) for name, value in tensors.items()}


def _inside(kind: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """Whether each point (offset dx, dy from a box's centre) is inside the shape of that box's half side."""
    circle = dx ** 2 + dy ** 2 <= half ** 2
    square = (dx.abs() <= half) & (dy.abs() <= half)
    triangle = (dy <= half) & (dx.abs() <= (dy + half) / 2)  # pointing up: apex at the box's top
    return torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))


def _ink(fill: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Where a pattern puts its grey ink, in the object's own frame (offsets from its centre)."""
    def band(d, period):
        return torch.remainder(torch.floor(d / (period / 2)), 2) == 1

    dot_x = torch.remainder(dx, DOT_PERIOD) - DOT_PERIOD / 2
    dot_y = torch.remainder(dy, DOT_PERIOD) - DOT_PERIOD / 2
    patterns = {
        "striped": band(dx, STRIPE_PERIOD),  # vertical stripes
        "pinstriped": band(dx, PINSTRIPE_PERIOD),
        "dotted": dot_x ** 2 + dot_y ** 2 <= DOT_RADIUS ** 2,
        "checkered": band(dx, CHECKER_PERIOD) ^ band(dy, CHECKER_PERIOD),
    }
    ink = torch.zeros_like(dx, dtype=torch.bool)
    for name, where in patterns.items():
        ink = ink | ((fill == FILLS.index(name)) & where)
    return ink


def object_layers(tensors: dict[str, torch.Tensor], supersample: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Each object slot's coverage and its ink's coverage, [N, MAX_OBJECTS, SIZE, SIZE] in [0, 1] each (edges
    antialiased by supersampling; an absent slot covers nothing)."""
    n, device = tensors["shape"].shape[0], tensors["shape"].device
    grid = (torch.arange(SIZE * supersample, device=device, dtype=torch.float32) + 0.5) / supersample
    y, x = grid.view(1, 1, -1, 1), grid.view(1, 1, 1, -1)

    def per_object(name):
        return tensors[name].view(n, MAX_OBJECTS, 1, 1)

    kind, fill = per_object("shape"), per_object("fill")
    half = per_object("side") / 2
    dx, dy = x - tensors["centre"][..., 0].view(n, MAX_OBJECTS, 1, 1), y - tensors["centre"][..., 1].view(
        n, MAX_OBJECTS, 1, 1)
    mask = _inside(kind, dx, dy, half) & per_object("present")
    # An outline: the shape less the shape shrunk about its incentre, a band of one width all round.
    inradius = torch.where(kind == 2, half * 2 / (1 + 5 ** 0.5), half)
    scale = (1 - OUTLINE_PIXELS / inradius).clamp(min=0)
    incentre = torch.where(kind == 2, half - inradius, torch.zeros_like(half))  # below the centre, for a triangle
    hole = _inside(kind, dx, dy - incentre * (1 - scale), half * scale)
    mask = mask & ~(hole & (fill == FILLS.index("outlined")))
    ink = mask & _ink(fill, dx, dy)
    layers = torch.stack([mask, ink], 0).float().flatten(0, 1)
    if supersample > 1:
        layers = torch.nn.functional.avg_pool2d(layers, supersample)
    mask, ink = layers.view(2, n, MAX_OBJECTS, SIZE, SIZE)
    return mask, ink


def render_batch(tensors: dict[str, torch.Tensor], supersample: int = 2) -> torch.Tensor:
    """Scenes drawn as float images in [0, 1], [N, 3, SIZE, SIZE], on the inputs' device (scene_tensors' dict)."""
    n, device = tensors["shape"].shape[0], tensors["shape"].device
    rows = torch.arange(SIZE, device=device).view(1, 1, SIZE, 1)
    image = torch.where(rows < SIZE // 2, tensors["top"].view(n, 3, 1, 1), tensors["bottom"].view(n, 3, 1, 1))
    image = image.expand(n, 3, SIZE, SIZE)
    mask, ink = object_layers(tensors, supersample)
    grey = torch.tensor([c / 255 for c in INK], device=device).view(1, 3, 1, 1)
    for k in range(MAX_OBJECTS):  # objects never overlap (distinct cells), so the order does not matter
        cover, inked = mask[:, k:k + 1], ink[:, k:k + 1]
        paint = tensors["colour"][:, k].view(n, 3, 1, 1) * (cover - inked) + grey * inked
        image = image * (1 - cover) + paint
    return image


def to_pil(image: torch.Tensor):
    """One drawn image ([3, SIZE, SIZE] in [0, 1]) as a PIL image."""
    from PIL import Image

    return Image.fromarray((image.permute(1, 2, 0) * 255).round().to(torch.uint8).cpu().numpy())


def render(scene: Scene, rng: random.Random | None = None):
    """One scene as a PIL image (SIZE x SIZE, RGB); with `rng`, jittered as in training."""
    return to_pil(render_batch(scene_tensors([scene], rng))[0])
