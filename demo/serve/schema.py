"""sd-serve's models (txt2img, img2img, inpaint) and their requests: their inputs and outputs, each request parsed into
the one request model (demo.request.Request) and checked as the pipeline checks it, its errors naming the server's
own inputs; and which requests may share one pipeline call (demo.request.batch_key)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from core.errors import UsageError
from demo.request import CONTROL_FIELDS, IMAGE_TO_IMAGE, INPAINTING, MODES, TEXT_TO_IMAGE, Request

# Triton model name -> the mode it runs; a model serves those its UNet can run (demo.request.modes_of).
MODEL_MODES = {"txt2img": TEXT_TO_IMAGE, "img2img": IMAGE_TO_IMAGE, "inpaint": INPAINTING}
MODEL_NAMES = {mode: name for name, mode in MODEL_MODES.items()}
IMAGE_MODES = (IMAGE_TO_IMAGE, INPAINTING)


@dataclass(frozen=True)
class Input:
    name: str
    dtype: type  # numpy's
    field: str  # the Request field it sets
    optional: bool = True  # left out: the request's default (the server's, for size and scheduler; the model's, for
    # the guidance scale: demo.request.Request.resolved)
    shape: tuple[int, ...] = (1,)  # Triton's, less the batch dimension (-1: any size)
    modes: tuple[str, ...] = MODES  # the models that take it


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
    Input("timestep_spacing", np.bytes_, "timestep_spacing"),
    Input("karras_sigmas", np.bool_, "karras_sigmas"),
    Input("eta", np.float32, "eta"),
    Input("timesteps", np.int32, "timesteps", shape=(-1,)),  # noisiest first
    Input("image", np.uint8, "image", optional=False, shape=(-1, -1, 3), modes=IMAGE_MODES),  # RGB
    Input("mask", np.uint8, "mask", optional=False, shape=(-1, -1), modes=(INPAINTING,)),  # white: repaint
    Input("strength", np.float32, "strength", modes=IMAGE_MODES),
    Input("control_guidance_start", np.float32, "control_guidance_start"),  # with ControlNets (a server's
    Input("control_guidance_end", np.float32, "control_guidance_end"),      # --controlnet): inputs_of
    Input("guess_mode", np.bool_, "guess_mode"),
)
CONTROL_IMAGES = "control_images"  # the field the control_image_<i> inputs set, one image per ControlNet
INPUT_OF_FIELD = {item.field: item.name for item in INPUTS} | {CONTROL_IMAGES: "control_image_<i>"}
# Outputs: the image, HxWx3 8-bit RGB, and how many requests its pipeline call ran (1: alone).
IMAGE, BATCH_SIZE = "image", "batch_size"
# A failed request's answer, beside placeholder outputs: the one line, and the Triton error code that triton_model.py
# answers it with instead of the outputs (no output declares them, so no client ever receives them as such).
ERROR, ERROR_CODE = "error", "error_code"
BAD_REQUEST, FAILED, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"  # HTTP 400, 500, 503


def inputs_of(mode: str, controlnets: int = 0) -> tuple[Input, ...]:
    """`mode`'s model's inputs on a server of `controlnets` ControlNets: with any, an image for each
    (control_image_0, control_image_1, ... in the server's --controlnet order) and the ControlNet fields."""
    images = tuple(Input(f"control_image_{index}", np.uint8, CONTROL_IMAGES, optional=False, shape=(-1, -1, 3))
                   for index in range(controlnets))
    return tuple(item for item in INPUTS if mode in item.modes and (controlnets or item.field not in CONTROL_FIELDS)
                 ) + images


def input_name(field: str) -> str:
    """How the server's messages name a field: the input that sets it, else the field itself."""
    return INPUT_OF_FIELD.get(field, field)


class RequestRejected(Exception):
    """A request the server will not run, with the one line that says why, naming the input."""


def check_shape(item: Input, array: np.ndarray) -> None:
    """RequestRejected unless `array` is one value or image of `item`'s shape (Triton's batch dimension 1)."""
    expected = (1, *item.shape)
    if (array.ndim != len(expected) or any(want not in (-1, got) for got, want in zip(array.shape, expected))
            or array.size == 0):  # several images in one request, or none
        kind = {(1,): "value", (-1,): "list"}.get(item.shape, "image")
        sizes = "N" if kind == "list" else "HW"  # what each free dimension counts
        shape = ", ".join(sizes[i - 1] if want == -1 else str(want) for i, want in enumerate(expected))
        raise RequestRejected(f"{item.name}: one {kind} per request (shape [{shape}]), got shape "
                              f"{list(array.shape)}")


def parse_request(data: dict[str, np.ndarray], plan, mode: str = TEXT_TO_IMAGE) -> Request:
    """One request of `mode`'s model, resolved to one image and checked by `plan` (PipelinePlan.checked, in
    demo.runtime.plan: what it leaves out is the server's spec's or the model's; then every check the loaded pipeline
    makes, the engines' limits among them); RequestRejected for the first bad input."""
    items = inputs_of(mode, len(plan.spec.controlnets))
    # The images' shapes first: a request of several images (two control images, each other input repeated along
    # Triton's batch dimension to match) is refused naming the image, not the prompt beside it.
    for item in sorted(items, key=lambda item: item.shape == (1,)):
        if item.name in data:
            check_shape(item, data[item.name])
    values, controls = {}, []
    for item in items:
        array = data.get(item.name)
        if array is None:
            if not item.optional:
                raise RequestRejected(f"{item.name}: required")
            continue
        if item.shape == (-1,):  # a list of values
            values[item.field] = tuple(array[0].tolist())
            continue
        if item.shape != (1,):
            image = Image.fromarray(array[0])  # RGB, or a grayscale mask
            if item.field == CONTROL_IMAGES:
                controls.append(image)
            else:
                values[item.field] = image
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
    if controls:
        values[CONTROL_IMAGES] = tuple(controls)
    try:
        request = plan.checked(Request(**values))
    except UsageError as exc:
        raise RequestRejected(exc.render(input_name)) from None
    return request
