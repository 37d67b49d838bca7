"""client: ask sd-serve for an image and write it as a PNG: model txt2img, or with --input-image img2img, with
--mask-image too inpaint.

    python scripts/client.py "a castle on a hill" --seed 42 --denoising-steps 30
    python scripts/client.py "a castle" --url 127.0.0.1:8001 --protocol grpc --height 64 --width 64
    python scripts/client.py "a castle" --input-image photo.png --strength 0.6
    python scripts/client.py "a castle" --input-image photo.png --mask-image mask.png

Bad flags (a seed outside 0..2**64-1, an output directory that cannot be written, ...) are one line and exit 2, before
anything is sent; a server that cannot be reached, or that refused or failed the request, one line (its own, naming the
input it refused) and exit 1.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from core.atomic import check_writable_directory, write_new_set
from core.errors import RunFailure
from demo.cli.command import run_command
from demo.cli.flags import DemoFlags, ImageFlags, Parser, RequestFlags, add_flags, flag, parse_flags, same_as
from demo.request import Request, load_image, random_seed
from demo.serve.client import PROTOCOLS, ServeError, connect, generate, mode_of
from demo.serve.schema import MODEL_NAMES

PROG = "client"


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
    denoising_steps: int | None = same_as(RequestFlags, "denoising_steps")
    guidance_scale: float | None = same_as(RequestFlags, "guidance_scale")
    scheduler: str | None = flag("one of the CLI's schedulers (default: the server's)")
    timestep_spacing: str | None = same_as(RequestFlags, "timestep_spacing")
    karras_sigmas: bool | None = same_as(RequestFlags, "karras_sigmas")
    eta: float | None = same_as(RequestFlags, "eta")
    timesteps: tuple[int, ...] | None = same_as(RequestFlags, "timesteps")
    seed: int | None = same_as(RequestFlags, "seed")


@dataclass(frozen=True)
class OutputFlags:
    output_dir: str = flag("where the PNG goes, as txt2img-seed<seed>.png (img2img-, inpaint-), never over an "
                           "earlier one; no report is written (default: %(default)s)", DemoFlags.output_dir)


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="Ask sd-serve for an image and write it as a PNG: model txt2img, or with "
                                      "--input-image img2img, with --mask-image too inpaint.")
    add_flags(p, ClientRequestFlags, required=("prompt",))
    add_flags(p, ImageFlags, "image-to-image and inpainting")
    add_flags(p, ClientFlags)
    add_flags(p, OutputFlags)
    return p


def save_png(directory: Path, stem: str, image) -> Path:
    """`image` as <stem>.png in `directory`, or <stem>-run<N>.png where that exists (never overwriting)."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    for run in range(1, 10_000):
        name = f"{stem}.png" if run == 1 else f"{stem}-run{run}.png"
        if write_new_set(directory, {name: buffer.getvalue()}):
            return directory / name
    raise ServeError(f"no free file name for {stem}.png in {directory}")


def run(flags) -> int:
    client_flags, images = flags[ClientFlags], flags[ImageFlags]
    image = None if images.input_image is None else load_image("image", images.input_image)
    mask = None if images.mask_image is None else load_image("mask", images.mask_image, "L")
    request = Request(**dataclasses.asdict(flags[ClientRequestFlags]), image=image, mask=mask,
                      strength=images.strength)
    request.check_inputs()  # as the CLI checks them (the seed's range: the wire's UINT64 would wrap -1 around)
    output_dir = Path(flags[OutputFlags].output_dir)
    check_writable_directory("output directory", output_dir)  # before the server makes the image
    values = {**dataclasses.asdict(request), "seed": request.seed if request.seed is not None else random_seed(),
              "image": None if image is None else np.asarray(image),
              "mask": None if mask is None else np.asarray(mask)}
    module, client = None, None
    try:
        module, client = connect(client_flags.url, client_flags.protocol)
        pixels, batch_size = generate(module, client, values)
    except ServeError as exc:
        raise RunFailure(str(exc)) from None
    finally:
        if client is not None:
            client.close()
    path = save_png(output_dir, f"{MODEL_NAMES[mode_of(values)]}-seed{values['seed']}", pixels)
    print(f"saved {path} ({pixels.shape[1]}x{pixels.shape[0]}, seed {values['seed']}, ran in a batch of {batch_size})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)))
