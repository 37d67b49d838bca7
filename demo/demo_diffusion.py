"""demo_diffusion: text-to-image with Stable Diffusion, with a per-stage latency report.

    python demo/demo_diffusion.py "a photo of an astronaut riding a horse" --model tiny
"""

from __future__ import annotations

import argparse
import io
import math
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout

from core.errors import UsageError  # noqa: E402

PROG = "demo_diffusion"


def build_parser() -> argparse.ArgumentParser:
    from demo.arguments import Parser, add_engine_arguments, add_model_arguments, add_torch_arguments
    from demo.backends import BACKENDS
    from demo.pipeline import SCHEDULERS

    p = Parser(prog=PROG, description="Stable Diffusion text-to-image with per-stage latency report.")
    p.add_argument("prompt", help="text prompt")
    add_model_arguments(p)
    p.add_argument("--negative-prompt", default="", help="negative prompt (default: empty)")
    p.add_argument("--batch-size", type=int, default=1, help="images per run (default: 1)")
    p.add_argument("--height", type=int, help="image height in pixels, a multiple of 8 (default: model's native)")
    p.add_argument("--width", type=int, help="image width in pixels, a multiple of 8 (default: model's native)")
    p.add_argument("--denoising-steps", type=int, default=50, help="scheduler steps (default: 50)")
    p.add_argument("--guidance-scale", type=float, default=7.5,
                   help="classifier-free guidance scale; <= 1 disables guidance (default: 7.5)")
    p.add_argument("--scheduler", help=f"one of {', '.join(SCHEDULERS)} (default: the model's own)")
    p.add_argument("--seed", type=int, help="random seed (default: a random one, reported)")
    p.add_argument("--backend", default="auto", help=f"one of {', '.join(BACKENDS)} (default: auto)")
    p.add_argument("--output-dir", default="output", help="where images and the report go (default: output)")
    p.add_argument("--num-warmup-runs", type=int, default=1, help="untimed runs before the timed one (default: 1)")
    add_engine_arguments(p)
    add_torch_arguments(p)
    return p


def validate(args, source) -> None:
    """The demo's own argument checks; run() makes these and the engine checks before loading or writing."""
    from demo.arguments import check_image_size, check_writable_directory
    from demo.pipeline import make_scheduler

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.denoising_steps < 1:
        raise UsageError(f"--denoising-steps must be at least 1, got {args.denoising_steps}")
    if args.num_warmup_runs < 0:
        raise UsageError(f"--num-warmup-runs must be 0 or more, got {args.num_warmup_runs}")
    if not (math.isfinite(args.guidance_scale) and args.guidance_scale >= 0):
        raise UsageError(f"--guidance-scale must be a finite number, 0 or more, got {args.guidance_scale}")
    if args.seed is not None and not 0 <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise UsageError(f"--seed must be 0..{2**64 - 1}, got {args.seed}")
    if args.scheduler is not None:
        make_scheduler(args.scheduler, source)  # an unknown name is a UsageError
    check_image_size(source, args.height, args.width)
    check_writable_directory("output directory", Path(args.output_dir))  # made when the images are saved


def accel_options(settings) -> list[str]:
    """The torch backend's settings other than plugins, as the report lists them."""
    options = [name for name, on in (("channels-last", settings.channels_last), ("CUDA graphs", settings.cuda_graph))
               if on]
    return options + ([f"compile {settings.compile}"] if settings.compile != "none" else [])


def output_stem(model_name: str, seed: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", Path(model_name).name or model_name).strip("-") or "model"
    return f"{slug}-seed{seed}"


def save_outputs(directory: Path, stem: str, images, report) -> list[Path]:
    """Write PNGs and the JSON report under fresh names; never overwrites an existing file."""
    from PIL import Image

    from core.atomic import write_new_file
    from demo.pipeline import to_uint8

    pngs = []
    for pixels in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    run = 0
    while True:
        name = stem if run == 0 else f"{stem}-{run}"
        paths = [directory / f"{name}-{i}.png" for i in range(len(pngs))]
        report_path = directory / f"{name}.json"
        if not any(p.exists() for p in (*paths, report_path)):
            written = [write_new_file(p, data) for p, data in zip(paths, pngs)]
            if all(written):
                report.images = [p.name for p in paths]
                if write_new_file(report_path, report.to_json().encode()):
                    return [*paths, report_path]
        run += 1


def run(parser, args) -> int:
    import torch
    from tqdm import tqdm

    from demo.arguments import engine_flags_set, engine_settings, torch_flags_set, torch_settings
    from demo.backends import create_stages, device_and_dtype, select_backend
    from demo.logs import configure_library_logging
    from demo.pipeline import GenerationRequest, Text2ImagePipeline, default_scheduler_name
    from demo.report import LatencyReport, StageTimer, device_name, library_versions
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES
    from models.source import resolve_model

    configure_library_logging(args.verbose)
    log = print if args.verbose else (lambda *_: None)

    def progress(message: str) -> None:  # always shown: a first run may build engines for many minutes
        print(message, file=sys.stderr, flush=True)

    backend, reason = select_backend(args.backend)
    source = resolve_model(args.model)
    args.height = args.height or source.native_image_size
    args.width = args.width or source.native_image_size
    validate(args, source)
    scheduler_name = args.scheduler or default_scheduler_name(source)
    output_dir = Path(args.output_dir)
    device, dtype = device_and_dtype(backend)
    settings = accel = None
    accel_reason = ""
    if backend == "torch":
        accel, accel_reason = torch_settings(args, device)
        unused = engine_flags_set(parser, args)
        if unused:
            print(f"note: {', '.join(unused)} unused by the torch backend", file=sys.stderr)
    else:
        settings = engine_settings(args, source, backend, args.batch_size, args.height, args.width,
                                   guided=args.guidance_scale > 1.0)
        unused = torch_flags_set(parser, args)
        if unused:
            print(f"note: {', '.join(unused)} unused by the {backend} backend", file=sys.stderr)
    seed = args.seed if args.seed is not None else random.randrange(2**31)

    log(f"[{PROG}] model {source.name} ({source.path}), backend {backend} ({reason}), {device} {dtype}")
    if accel is not None:
        log(f"[{PROG}] torch backend: {accel.describe()} ({accel_reason})")
    models = [STAGE_MODELS[name](source) for name in TEXT_TO_IMAGE_STAGES]
    stages = create_stages(backend, models, device, dtype, settings, log=log, progress=progress, torch_settings=accel)
    pipeline = Text2ImagePipeline(source, stages, scheduler_name, device, dtype)
    request = GenerationRequest(
        prompts=[args.prompt] * args.batch_size,
        negative_prompts=[args.negative_prompt] * args.batch_size,
        height=args.height, width=args.width, steps=args.denoising_steps,
        guidance_scale=args.guidance_scale, seed=seed,
    )
    for _ in range(args.num_warmup_runs):
        pipeline(request, StageTimer(device))
    timer = StageTimer(device)
    unet_calls = pipeline.unet_calls(args.denoising_steps)
    with tqdm(total=unet_calls, desc="denoising", disable=not sys.stderr.isatty(), leave=False) as bar:
        images = pipeline(request, timer, progress=bar)

    report = LatencyReport(
        model=source.name, backend=backend, backend_reason=reason, device=device_name(device),
        precision="fp16" if dtype == torch.float16 else "fp32", scheduler=scheduler_name,
        steps=args.denoising_steps, unet_calls=unet_calls, guidance_scale=args.guidance_scale, seed=seed,
        batch_size=args.batch_size, height=args.height, width=args.width,
        latent_shape=list(source.latent_shape(args.batch_size, args.height, args.width)),
        latency_ms=timer.milliseconds(), versions=library_versions(backend),
        plugins=list(settings.plugins if settings else accel.plugins),
        options=accel_options(accel) if accel is not None else (["CUDA graphs"] if settings.use_cuda_graph else []),
        options_reason=accel_reason,
    )
    written = save_outputs(output_dir, output_stem(source.name, seed), images, report)
    print(report.table())
    for path in written:
        print(f"saved {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import run_command

    def body():
        parser = build_parser()
        return run(parser, parser.parse_args(argv))

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
