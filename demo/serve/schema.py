"""The txt2img model's requests: their inputs and outputs, each request checked as the CLI checks its flags (the same
functions; errors name the input instead of the flag), and which requests may share one pipeline call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from core.errors import UsageError
from demo.settings import RequestFlags, option_name

MODEL_NAME = "txt2img"


@dataclass(frozen=True)
class Input:
    name: str
    dtype: type  # numpy's
    field: str  # the RequestFlags field it sets
    optional: bool = True  # left out: the CLI's default for the flag (the server's, for size and scheduler)


# One value each per request: Triton's shape [1] (requests carry [1, 1], the batch dimension first).
INPUTS = (
    Input("prompt", np.bytes_, "prompt", optional=False),
    Input("negative_prompt", np.bytes_, "negative_prompt"),
    Input("seed", np.uint64, "seed"),
    Input("steps", np.int32, "denoising_steps"),
    Input("guidance_scale", np.float32, "guidance_scale"),
    Input("height", np.int32, "height"),
    Input("width", np.int32, "width"),
    Input("scheduler", np.bytes_, "scheduler"),
)
# Outputs: the image, HxWx3 8-bit RGB; how many requests its pipeline call ran (1: alone); and where its batch went
# on without it, why it failed (else empty): PyTriton 0.7 fails a batch only whole (see docs/serving.md).
IMAGE, BATCH_SIZE, ERROR = "image", "batch_size", "error"

_INPUT_OF_FLAG = {option_name(item): next(i.name for i in INPUTS if i.field == item.name)
                  for item in dataclasses.fields(RequestFlags) if any(i.field == item.name for i in INPUTS)}


class RequestRejected(Exception):
    """A request the server will not run, with the one line that says why, naming the input."""


def rejected(message: str) -> RequestRejected:
    """A CLI check's message with its flags (--denoising-steps) named as the request's inputs (steps)."""
    for flag, name in sorted(_INPUT_OF_FLAG.items(), key=lambda item: -len(item[0])):
        message = message.replace(flag, name)
    return RequestRejected(message)


def parse_request(data: dict[str, np.ndarray], source, defaults: RequestFlags,
                  check: Callable[[RequestFlags], None] = lambda _: None) -> RequestFlags:
    """One request's inputs as the resolved RequestFlags of one image (batch size 1), checked as the CLI checks them
    and then by `check` (what the served engines can run); RequestRejected for the first bad input. `defaults` fill
    in what it leaves out; the model, its own size, scheduler and a random seed what they leave out."""
    from demo.pipeline import check_request, resolve_request

    values = {}
    for item in INPUTS:
        array = data.get(item.name)
        if array is None:
            continue
        if array.size != 1:  # a batch dimension above 1: several images in one request
            raise RequestRejected(f"{item.name}: one value per request (shape [1, 1]), got shape {list(array.shape)}")
        value = array.reshape(-1)[0]
        if item.dtype is np.bytes_:
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise RequestRejected(f"{item.name}: not UTF-8 text") from None
        else:
            value = value.item()
        values[item.field] = value
    try:
        flags = resolve_request(replace(defaults, batch_size=1, **values), source)
        check_request(flags, source)
        check(flags)
    except UsageError as exc:
        raise rejected(str(exc)) from None
    return flags


def batch_key(flags: RequestFlags) -> tuple:
    """Requests with equal keys can run as one pipeline call: the same size, steps, scheduler and guidance, and
    negative prompts given to all or none (none: the model's empty or zero negative embeddings)."""
    return (flags.height, flags.width, flags.denoising_steps, flags.scheduler, flags.guidance_scale,
            flags.negative_prompt is None)
