"""The `shapes` world: scenes of one shape on a plain background, their prompts, and the renderer.

The same definitions train the `shapes` model (models/shapes/train.py), draw the input images of its edits, and
tell the detector (models/shapes/detector.py) what to look for, so the three can never disagree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

SIZE = 128  # image side in pixels (latents 16x16)
SHAPES = ("circle", "square", "triangle")
# One palette for objects and backgrounds; an object never has its background's colour.
COLOURS = {
    "red": (215, 40, 40),
    "yellow": (240, 205, 30),
    "green": (40, 160, 70),
    "blue": (40, 80, 215),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
# Where the shape's bounding box is centred, as fractions of the side, and how a prompt says it.
POSITIONS = {
    "top left": ((0.25, 0.25), "at the top left"),
    "top": ((0.5, 0.25), "at the top"),
    "top right": ((0.75, 0.25), "at the top right"),
    "left": ((0.25, 0.5), "on the left"),
    "center": ((0.5, 0.5), "in the center"),
    "right": ((0.75, 0.5), "on the right"),
    "bottom left": ((0.25, 0.75), "at the bottom left"),
    "bottom": ((0.5, 0.75), "at the bottom"),
    "bottom right": ((0.75, 0.75), "at the bottom right"),
}
SIZES = {"small": 26, "large": 50}  # the bounding box's side in pixels
STYLES = ("filled", "outline")  # the base model draws filled shapes; the outline LoRA draws outlines
JITTER_PIXELS = 3  # training and edit inputs move the centre and the side by up to this much
OUTLINE_FRACTION = 0.12  # an outline's width, as a fraction of the side


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    position: str
    size: str
    style: str = "filled"

    @property
    def prompt(self) -> str:
        return (f"a {self.size} {self.colour} {self.shape} {POSITIONS[self.position][1]} on a {self.background} "
                "background")

    def with_(self, **changes) -> Scene:
        return replace(self, **changes)


ATTRIBUTES = ("shape", "colour", "background", "position", "size")  # what a prompt names and the detector reads


def random_scene(rng: random.Random) -> Scene:
    colour, background = rng.sample(list(COLOURS), 2)
    return Scene(rng.choice(SHAPES), colour, background, rng.choice(list(POSITIONS)), rng.choice(list(SIZES)))


def partial_prompt(scene: Scene, keep: dict[str, bool]) -> str:
    """The scene's prompt naming only the attributes `keep` marks (the shape is always named): what the model
    learns besides full prompts, so that "a red circle" draws a red circle somewhere on some background."""
    words = ["a"]
    if keep.get("size", True):
        words.append(scene.size)
    if keep.get("colour", True):
        words.append(scene.colour)
    words.append(scene.shape)
    if keep.get("position", True):
        words.append(POSITIONS[scene.position][1])
    if keep.get("background", True):
        words += ["on a", scene.background, "background"]
    return " ".join(words)


def unplaced_prompt(scene: Scene) -> str:
    """The scene's prompt without its position: what shapes-controlnet's control image gives."""
    return partial_prompt(scene, {"position": False})


def render_batch(shape: torch.Tensor, colour: torch.Tensor, background: torch.Tensor, centre: torch.Tensor,
                 side: torch.Tensor, outline: torch.Tensor, supersample: int = 2) -> torch.Tensor:
    """Scenes drawn as float images in [0, 1], [N, 3, SIZE, SIZE], on the inputs' device.

    shape: [N] indices into SHAPES; colour, background: [N, 3] RGB in [0, 1]; centre: [N, 2] (x, y) in pixels;
    side: [N] the bounding box's side in pixels; outline: [N] bool. Edges are antialiased by supersampling.
    """
    n, device = shape.shape[0], shape.device
    grid = (torch.arange(SIZE * supersample, device=device, dtype=torch.float32) + 0.5) / supersample
    y, x = grid.view(1, -1, 1), grid.view(1, 1, -1)
    kind = shape.view(n, 1, 1)

    def inside(cx: torch.Tensor, cy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        dx, dy = (x - cx).abs(), y - cy
        circle = dx ** 2 + dy ** 2 <= h ** 2
        square = (dx <= h) & (dy.abs() <= h)
        triangle = (dy <= h) & (dx <= (dy + h) / 2)  # pointing up: apex at the box's top, base along its bottom
        return torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))

    cx, cy, half = centre[:, 0].view(n, 1, 1), centre[:, 1].view(n, 1, 1), (side / 2).view(n, 1, 1)
    mask = inside(cx, cy, half)
    if outline.any():
        # The hole is the shape shrunk about its incentre, so the band left has one width all round.
        width = OUTLINE_FRACTION * 2 * half
        inradius = torch.where(kind == 2, half * 2 / (1 + 5 ** 0.5), half)
        scale = 1 - width / inradius
        incentre_y = torch.where(kind == 2, cy + half - inradius, cy)
        hole = inside(cx, incentre_y + scale * (cy - incentre_y), half * scale)
        mask = mask & ~(hole & outline.view(n, 1, 1))
    mask = mask.float().unsqueeze(1)
    if supersample > 1:
        mask = torch.nn.functional.avg_pool2d(mask, supersample)
    return background.view(n, 3, 1, 1) * (1 - mask) + colour.view(n, 3, 1, 1) * mask


def scene_tensors(scenes: list[Scene], rng: random.Random | None = None, device="cpu") -> dict[str, torch.Tensor]:
    """render_batch's inputs for these scenes; with `rng`, the centre and side jittered as in training."""
    def jitter() -> float:
        return rng.uniform(-JITTER_PIXELS, JITTER_PIXELS) if rng else 0.0

    palette = {name: [c / 255 for c in rgb] for name, rgb in COLOURS.items()}
    return {
        "shape": torch.tensor([SHAPES.index(s.shape) for s in scenes], device=device),
        "colour": torch.tensor([palette[s.colour] for s in scenes], device=device),
        "background": torch.tensor([palette[s.background] for s in scenes], device=device),
        "centre": torch.tensor([[POSITIONS[s.position][0][0] * SIZE + jitter(), POSITIONS[s.position][0][1] * SIZE
                                 + jitter()] for s in scenes], device=device),
        "side": torch.tensor([SIZES[s.size] + jitter() for s in scenes], device=device),
        "outline": torch.tensor([s.style == "outline" for s in scenes], device=device),
    }


def to_pil(image: torch.Tensor):
    """One drawn image ([3, SIZE, SIZE] in [0, 1]) as a PIL image."""
    from PIL import Image

    return Image.fromarray((image.permute(1, 2, 0) * 255).round().to(torch.uint8).cpu().numpy())


def render(scene: Scene, rng: random.Random | None = None):
    """One scene as a PIL image (SIZE x SIZE, RGB)."""
    return to_pil(render_batch(**scene_tensors([scene], rng))[0])


def silhouettes(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """render_batch's scenes as their shapes' silhouettes, white on black, [N, 3, SIZE, SIZE] in [0, 1]: what
    shapes-controlnet is steered by."""
    n, device = tensors["shape"].shape[0], tensors["shape"].device
    return render_batch(**{**tensors, "colour": torch.ones(n, 3, device=device),
                           "background": torch.zeros(n, 3, device=device),
                           "outline": torch.zeros(n, dtype=torch.bool, device=device)})


def silhouette(scene: Scene):
    """One scene's silhouette (no jitter) as a PIL image: its control image for shapes-controlnet."""
    return to_pil(silhouettes(scene_tensors([scene]))[0])


def object_box(scene: Scene, margin: int = 6) -> tuple[int, int, int, int]:
    """The scene's object's bounding box (left, top, right, bottom) in pixels, grown by `margin`: an inpainting
    mask that covers the object whatever its jitter."""
    (fx, fy), _ = POSITIONS[scene.position]
    half = SIZES[scene.size] / 2 + JITTER_PIXELS + margin
    return (max(0, round(fx * SIZE - half)), max(0, round(fy * SIZE - half)),
            min(SIZE, round(fx * SIZE + half)), min(SIZE, round(fy * SIZE + half)))
