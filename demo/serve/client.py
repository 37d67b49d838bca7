"""A client of sd-serve's models (tritonclient, HTTP or gRPC), and the command that writes their images as PNGs:
txt2img, or with --input-image img2img, with --mask-image too inpaint.

    python scripts/client.py "a castle on a hill" --seed 42 --denoising-steps 30
    python scripts/client.py "a castle" --url 127.0.0.1:8001 --protocol grpc --height 64 --width 64
    python scripts/client.py "a castle" --input-image photo.png --strength 0.6
    python scripts/client.py "a castle" --input-image photo.png --mask-image mask.png

Bad flags are one line and exit 2; a server that cannot be reached, or that refused or failed the request, one line
(its own, naming the input it refused) and exit 1.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

from demo.cli.generate import DemoFlags, ImageFlags
from demo.settings import RequestFlags, flag, same_as

PROG = "client"
PROTOCOLS = ("http", "grpc")


class ServeError(Exception):
    """The server answered a request with an error (the message is its one line) or could not be reached."""


@dataclass(frozen=True)
class ClientFlags:
    url: str = flag("the server's HTTP (default port 8000) or gRPC (8001) address (default: %(default)s)",
                    "127.0.0.1:8000")
    protocol: str = flag("how to talk to it (default: %(default)s)", "http", choices=PROTOCOLS)


@dataclass(frozen=True)
class ClientRequestFlags:
    """RequestFlags less the batch size: one request is one image (several requests batch on the server)."""

    prompt: str = same_as(RequestFlags, "prompt")
    negative_prompt: str | None = same_as(RequestFlags, "negative_prompt")
    height: int | None = flag("image height in pixels, a multiple of 8 (default: the server's)")
    width: int | None = flag("image width in pixels, a multiple of 8 (default: the server's)")
    denoising_steps: int = same_as(RequestFlags, "denoising_steps")
    guidance_scale: float = same_as(RequestFlags, "guidance_scale")
    scheduler: str | None = flag("one of the CLI's schedulers (default: the server's)")
    seed: int | None = same_as(RequestFlags, "seed")


def connect(url: str, protocol: str = "http", concurrency: int = 1):
    """(tritonclient module, client) for `url`; a ServeError where tritonclient is missing."""
    try:
        if protocol == "grpc":
            import tritonclient.grpc as module

            return module, module.InferenceServerClient(url)
        import tritonclient.http as module
    except ImportError:
        raise ServeError("needs tritonclient: pip install -e '.[serve]' (docs/serving.md)") from None
    return module, module.InferenceServerClient(url, concurrency=concurrency, network_timeout=3600.0,
                                                connection_timeout=3600.0)


def request_inputs(module, values: dict, mode: str) -> list:
    """tritonclient InferInputs for the given request fields (None: left out) that `mode`'s model takes, the batch
    dimension first: [1, 1] each, an image's array (HxWx3 RGB, a mask HxW) as [1, H, W, 3] and [1, H, W]."""
    import numpy as np

    from demo.serve.schema import inputs_of

    inputs = []
    for item in inputs_of(mode):
        value = values.get(item.field)
        if value is None:
            continue
        array = np.array([[value.encode() if isinstance(value, str) else value]] if item.shape == (1,) else [value],
                         dtype=item.dtype)
        tensor = module.InferInput(item.name, list(array.shape), "BYTES" if item.dtype is np.bytes_ else
                                   {np.uint64: "UINT64", np.int32: "INT32", np.float32: "FP32",
                                    np.uint8: "UINT8"}[item.dtype])
        tensor.set_data_from_numpy(array.astype(object) if item.dtype is np.bytes_ else array)
        inputs.append(tensor)
    return inputs


def server_message(exc: Exception) -> str:
    """The one line a failed request's error carries: Triton wraps the server's message in a traceback."""
    text = str(exc.message() if hasattr(exc, "message") and callable(exc.message) else exc)
    found = re.findall(r"RequestFailed: (.+)", text)
    return found[-1].strip() if found else (text.strip().splitlines() or [type(exc).__name__])[0]


def mode_of(values: dict) -> str:
    """The mode a request's fields ask for: inpainting with a mask, image-to-image with an input image alone."""
    from demo.pipeline import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE

    if values.get("mask_image") is not None:
        return INPAINTING
    return IMAGE_TO_IMAGE if values.get("input_image") is not None else TEXT_TO_IMAGE


def generate(module, client, values: dict):
    """(image HxWx3 uint8, the number of requests its pipeline call ran) for one request, from the model its fields
    ask for (mode_of); ServeError with the server's one line where it failed."""
    from demo.serve.schema import BATCH_SIZE, ERROR, IMAGE, MODEL_NAMES

    mode = mode_of(values)
    outputs = [module.InferRequestedOutput(name) for name in (IMAGE, BATCH_SIZE, ERROR)]
    try:
        result = client.infer(MODEL_NAMES[mode], request_inputs(module, values, mode), outputs=outputs)
    except OSError as exc:  # HTTP: nothing listening, the connection dropped
        raise ServeError(f"cannot reach the server: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 -- tritonclient's InferenceServerException: what the server answered
        raise ServeError(server_message(exc)) from None
    error = result.as_numpy(ERROR).reshape(-1)[0].decode()
    if error:
        raise ServeError(error)
    return result.as_numpy(IMAGE)[0], int(result.as_numpy(BATCH_SIZE).reshape(-1)[0])


@dataclass(frozen=True)
class OutputFlags:
    output_dir: str = same_as(DemoFlags, "output_dir")


def build_parser():
    from demo.arguments import Parser
    from demo.settings import add_flags

    p = Parser(prog=PROG, description="Ask sd-serve for an image and write it as a PNG: model txt2img, or with "
                                      "--input-image img2img, with --mask-image too inpaint.")
    add_flags(p, ClientRequestFlags, required=("prompt",))
    add_flags(p, ImageFlags, "image-to-image and inpainting")
    add_flags(p, ClientFlags)
    add_flags(p, OutputFlags)
    return p


def save_png(directory: Path, stem: str, image) -> Path:
    """`image` as <stem>.png in `directory`, or <stem>-run<N>.png where that exists (never overwriting)."""
    from PIL import Image

    from core.atomic import write_new_set

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    for run in range(1, 10_000):
        name = f"{stem}.png" if run == 1 else f"{stem}-run{run}.png"
        if write_new_set(directory, {name: buffer.getvalue()}):
            return directory / name
    raise ServeError(f"no free file name for {stem}.png in {directory}")


def run(flags) -> int:
    from dataclasses import asdict

    import numpy as np

    from core.errors import RunFailure
    from demo.cli.generate import read_inputs
    from demo.pipeline import random_seed
    from demo.serve.schema import MODEL_NAMES

    request, client_flags, image_flags = flags[ClientRequestFlags], flags[ClientFlags], flags[ImageFlags]
    input_image, mask = read_inputs(image_flags)  # checked as the CLI checks them
    values = {**asdict(request), "strength": image_flags.strength,
              "input_image": None if input_image is None else np.asarray(input_image),
              "mask_image": None if mask is None else np.asarray(mask.convert("L"))}  # grayscale, as the CLI's is made
    values["seed"] = request.seed if request.seed is not None else random_seed()
    module, client = None, None
    try:
        module, client = connect(client_flags.url, client_flags.protocol)
        image, batch_size = generate(module, client, values)
    except ServeError as exc:
        raise RunFailure(str(exc)) from None
    finally:
        if client is not None:
            client.close()
    path = save_png(Path(flags[OutputFlags].output_dir), f"{MODEL_NAMES[mode_of(values)]}-seed{values['seed']}", image)
    print(f"saved {path} ({image.shape[1]}x{image.shape[0]}, seed {values['seed']}, ran in a batch of {batch_size})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import run_command
    from demo.settings import parse_flags

    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)))
