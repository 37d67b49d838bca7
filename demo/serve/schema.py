"""sd-serve's models (txt2img, img2img, inpaint) and their requests: their inputs and outputs, each request checked as
the CLI checks its flags (the same functions; errors name the input instead of the flag), and which requests may
share one pipeline call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from core.errors import UsageError
from demo.cli.generate import ImageFlags
from demo.pipeline import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE
from demo.settings import RequestFlags, option_name

if TYPE_CHECKING:
    from PIL.Image import Image

# Triton model name -> the mode it runs (demo.pipeline); a model serves those its UNet can run (served_modes).
MODES = {"txt2img": TEXT_TO_IMAGE, "img2img": IMAGE_TO_IMAGE, "inpaint": INPAINTING}
MODEL_NAMES = {mode: name for name, mode in MODES.items()}
ALL_MODES = tuple(MODES.values())
IMAGE_MODES = (IMAGE_TO_IMAGE, INPAINTING)


@dataclass(frozen=True)
class Input:
    name: str
    dtype: type  # numpy's
    field: str  # the RequestFlags (or, for the input image, ImageFlags) field it sets
    optional: bool = True  # left out: the CLI's default for the flag (the server's, for size and scheduler)
    shape: tuple[int, ...] = (1,)  # Triton's, less the batch dimension (-1: any size)
    modes: tuple[str, ...] = ALL_MODES  # the models that take it


# One per request: requests carry the batch dimension first ([1, 1] for a value, [1, H, W, 3] for an image).
INPUTS = (
    Input("prompt", np.bytes_, "prompt", optional=False),
    Input("negative_prompt", np.bytes_, "negative_prompt"),
    Input("seed", np.uint64, "seed"),
    Input("steps", np.int32, "denoising_steps"),
    Input("guidance_scale", np.float32, "guidance_scale"),
    Input("height", np.int32, "height"),
    Input("width", np.int32, "width"),
    Input("scheduler", np.bytes_, "scheduler"),
    Input("image", np.uint8, "input_image", optional=False, shape=(-1, -1, 3), modes=IMAGE_MODES),  # RGB
    Input("mask", np.uint8, "mask_image", optional=False, shape=(-1, -1), modes=(INPAINTING,)),  # white: repaint
    Input("strength", np.float32, "strength", modes=IMAGE_MODES),
)
# Outputs: the image, HxWx3 8-bit RGB; how many requests its pipeline call ran (1: alone); and where its batch went
# on without it, why it failed (else empty): PyTriton 0.7 fails a batch only whole (see docs/serving.md).
IMAGE, BATCH_SIZE, ERROR = "image", "batch_size", "error"

_INPUT_OF_FLAG = {option_name(item): next(i.name for i in INPUTS if i.field == item.name)
                  for flags in (RequestFlags, ImageFlags) for item in dataclasses.fields(flags)
                  if any(i.field == item.name for i in INPUTS)}


def inputs_of(mode: str) -> tuple[Input, ...]:
    return tuple(item for item in INPUTS if mode in item.modes)


def served_modes(source) -> tuple[str, ...]:
    """The modes the model's UNet can run (an inpainting UNet only inpaints; an ordinary one runs all three, inpainting
    by the latent blend), as check_mode decides; its UsageError where it runs none."""
    from demo.pipeline import check_mode

    modes, error = [], None
    for mode in ALL_MODES:
        try:
            check_mode(source, mode)
        except UsageError as exc:
            error = exc
        else:
            modes.append(mode)
    if not modes:
        raise error
    return tuple(modes)


@dataclass(frozen=True, eq=False)  # each request is itself (batch_key), images are not compared
class Request:
    """One parsed request: its resolved flags (one image) and, for img2img and inpaint, the input image, mask and
    strength as the CLI's GenerationRequest takes them."""

    flags: RequestFlags
    image: Image | None = None
    mask: Image | None = None
    strength: float = 1.0


class RequestRejected(Exception):
    """A request the server will not run, with the one line that says why, naming the input."""


def rejected(message: str) -> RequestRejected:
    """A CLI check's message with its flags (--denoising-steps) named as the request's inputs (steps)."""
    for flag, name in sorted(_INPUT_OF_FLAG.items(), key=lambda item: -len(item[0])):
        message = message.replace(flag, name)
    return RequestRejected(message)


def parse_request(data: dict[str, np.ndarray], source, defaults: RequestFlags,
                  check: Callable[[RequestFlags], None] = lambda _: None, mode: str = TEXT_TO_IMAGE) -> Request:
    """One request of `mode`'s model, resolved to one image and checked as the CLI checks its flags (an image request
    as `demo-diffusion --input-image [--mask-image]` of that image and mask) and then by `check` (what the served
    engines can run); RequestRejected for the first bad input. `defaults` fill in what it leaves out (but an image
    request's size: its image's, as in the CLI); the model, its own size, scheduler and a random seed what they leave
    out."""
    from PIL import Image

    from demo.cli.generate import check_mask, image_size
    from demo.pipeline import GenerationRequest, check_request, resolve_request

    values, images = {}, {}
    for item in inputs_of(mode):
        array = data.get(item.name)
        if array is None:
            if not item.optional:
                raise RequestRejected(f"{item.name}: required")
            continue
        expected = (1, *item.shape)
        if (array.ndim != len(expected) or any(want not in (-1, got) for got, want in zip(array.shape, expected))
                or array.size == 0):  # several images in one request, or none
            shape = ", ".join("HW"[i - 1] if want == -1 else str(want) for i, want in enumerate(expected))
            raise RequestRejected(f"{item.name}: one {'value' if item.shape == (1,) else 'image'} per request (shape "
                                  f"[{shape}]), got shape {list(array.shape)}")
        if item.shape != (1,):
            images[item.field] = Image.fromarray(array[0])  # RGB, or a grayscale mask
            continue
        value = array.reshape(-1)[0]
        if item.dtype is np.bytes_:
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise RequestRejected(f"{item.name}: not UTF-8 text") from None
        elif item.dtype is np.float32:  # the decimal the client meant (0.7, not 0.699999988), as the CLI parses it
            value = float(str(value))
        else:
            value = value.item()
        values[item.field] = value
    strength = values.pop("strength", None)
    image, mask = images.get("input_image"), images.get("mask_image")
    try:
        flags = replace(defaults, batch_size=1, **values)
        size = None
        if image is not None:  # as the CLI sizes it: its own size where height and width are not given
            if mask is not None:
                check_mask(image, mask, "--mask-image")
            flags = replace(flags, height=values.get("height"), width=values.get("width"))
            size = image_size(image, flags, source)
        flags = resolve_request(flags, source, size=size)
        generation = GenerationRequest.from_flags(flags, image, mask, strength)
        check_request(flags, source, generation.mode, generation.strength)
        check(flags)
    except UsageError as exc:
        raise rejected(str(exc)) from None
    return Request(flags, image, mask, generation.strength)


def batch_key(request: Request) -> tuple:
    """Requests with equal keys can run as one pipeline call: the same size, steps, scheduler and guidance, and
    negative prompts given to all or none (none: the model's empty or zero negative embeddings). A pipeline call takes
    one input image for the whole batch, so each image request runs alone."""
    if request.image is not None:
        return (id(request),)
    flags = request.flags
    return (flags.height, flags.width, flags.denoising_steps, flags.scheduler, flags.guidance_scale,
            flags.negative_prompt is None)
