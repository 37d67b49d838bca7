"""demo-diffusion: text-to-image, image-to-image and inpainting with Stable Diffusion, with a per-stage latency report.

    demo-diffusion "a photo of an astronaut riding a horse" --model tiny
    demo-diffusion "a castle" --model tiny --input-image photo.png --strength 0.6
    demo-diffusion "a castle" --model tiny-inpaint --input-image photo.png --mask-image mask.png
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from demo.settings import EngineFlags, ModelFlags, RequestFlags, TorchFlags, at_least, changed, flag

PROG = "demo-diffusion"


def _backends_help() -> str:
    from demo.backends import BACKENDS

    return f"one of {', '.join(BACKENDS)} (default: %(default)s)"


def _strength_help() -> str:
    from demo.pipeline import DEFAULT_STRENGTH

    defaults = ", ".join(f"{value} for {mode}" for mode, value in DEFAULT_STRENGTH.items())
    return f"with --input-image: how much of the schedule re-draws it, above 0 and at most 1 (default: {defaults})"


@dataclass(frozen=True)
class ImageFlags:
    input_image: str | None = flag("image-to-image: start from this image, resized to --height/--width where given "
                                   "(default: its own size, rounded down to a multiple of 8)", metavar="PATH")
    strength: float | None = flag(_strength_help, metavar="F")
    mask_image: str | None = flag("inpainting, with --input-image: repaint where this mask is white, keep where it is "
                                  "black (resized with the image)", metavar="PATH")


@dataclass(frozen=True)
class RefinerFlags:
    refiner: str | None = flag("SDXL: then refine with this model (a built-in such as tiny-xl-refiner, or a "
                               "StableDiffusionXLImg2ImgPipeline folder), an ensemble of experts", metavar="MODEL")
    high_noise_frac: float = flag("with --refiner: the part of the schedule the base denoises, the rest is the "
                                  "refiner's (default: %(default)s)", 0.8)


@dataclass(frozen=True)
class LoraFlags:
    lora: tuple[str, ...] | None = flag("fuse this LoRA file (.safetensors: diffusers/PEFT or kohya keys) into the "
                                        "UNet and text encoders, its delta times SCALE (default 1.0); repeatable, the "
                                        "deltas add up; engines take it by refit, with --build-enable-refit",
                                        metavar="PATH[:SCALE]", repeatable=True)


@dataclass(frozen=True)
class DemoFlags:
    backend: str = flag(_backends_help, "auto")
    output_dir: str = flag("where images and the report go (default: %(default)s)", "output")
    num_warmup_runs: int = flag("untimed runs before the timed one (default: %(default)s)", 1)


def build_parser():
    from demo.arguments import Parser
    from demo.settings import TORCH_USES_ENGINE_FLAGS, add_flags

    p = Parser(prog=PROG, description="Stable Diffusion text-to-image, image-to-image and inpainting with per-stage "
                                      "latency report.")
    add_flags(p, ModelFlags)
    add_flags(p, RequestFlags, required=("prompt",))
    add_flags(p, ImageFlags, "image-to-image and inpainting")
    add_flags(p, DemoFlags)
    add_flags(p, LoraFlags, "LoRA")
    add_flags(p, RefinerFlags)
    add_flags(p, EngineFlags, "ONNX and TensorRT engines")
    shared = ", ".join("--" + name.replace("_", "-") for name in TORCH_USES_ENGINE_FLAGS)
    add_flags(p, TorchFlags, "PyTorch backend", description=f"unset, each comes from the torch defaults measured "
              f"on this GPU's compute capability; {shared} apply to it too")
    return p


def read_image(option: str, path: str):
    """An image file, loaded (a one-line UsageError where it is missing or not an image PIL can read)."""
    from PIL import Image

    from core.errors import UsageError

    try:
        image = Image.open(path)
        image.load()
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:  # a folder, not an image, truncated, huge
        reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"{option} {path}: cannot be read as an image ({reason})") from None
    return image


def read_inputs(flags: ImageFlags):
    """The input image (RGB) and mask as read (None where not given), each flag checked against those it needs."""
    from core.errors import UsageError

    if flags.input_image is None:
        for option, value in (("--mask-image", flags.mask_image), ("--strength", flags.strength)):
            if value is not None:
                raise UsageError(f"{option} needs --input-image (the image to start from)")
        return None, None
    image = read_image("--input-image", flags.input_image).convert("RGB")  # as diffusers' image processor takes it
    if flags.mask_image is None:
        return image, None
    mask = read_image("--mask-image", flags.mask_image)
    check_mask(image, mask, f"--mask-image {flags.mask_image}")
    return image, mask


def check_mask(image, mask, what: str) -> None:
    """A UsageError, naming the mask as `what`, where it has not the input image's proportions."""
    from core.errors import UsageError

    if abs(mask.width / mask.height - image.width / image.height) > 0.01 * image.width / image.height:
        raise UsageError(f"{what} is {mask.width}x{mask.height}, --input-image {image.width}x{image.height}: the mask "
                         "must have the image's proportions (it is resized with it)")


def image_size(image, flags: RequestFlags, source) -> tuple[int, int] | None:
    """The request's size where --height/--width are not given: the input image's, rounded down to a multiple of 8
    (None: no input image, the model's native size); a UsageError where that size is one the model cannot take."""
    from core.errors import UsageError

    if image is None:
        return None
    size = (image.height - image.height % 8, image.width - image.width % 8)
    low, high = source.image_size_range
    if any(given is None and not low <= value <= high for given, value in zip((flags.height, flags.width), size)):
        raise UsageError(f"--input-image is {image.width}x{image.height}; model '{source.name}' takes {low}..{high} "
                         "pixels a side: give --height and --width to resize it")
    return size


def validate(request: RequestFlags, demo: DemoFlags, source, mode: str, strength: float) -> None:
    """The demo's own checks of a request whose size is resolved; run() makes these and the engine checks before
    loading or writing."""
    from demo.arguments import check_writable_directory
    from demo.pipeline import check_request

    check_request(request, source, mode, strength)
    at_least("--num-warmup-runs", demo.num_warmup_runs, 0)
    check_writable_directory("output directory", Path(demo.output_dir))  # made when the images are saved


def read_loras(flags: LoraFlags, backend: str, refit: bool) -> list:
    """The --lora files, read and checked for what they hold (run checks them against the model next), with their
    scales; engines take them only where built refittable (`refit`: --build-enable-refit)."""
    from core.errors import UsageError
    from demo.lora import ENGINES_NEED_REFIT
    from models.lora import parse_lora_spec, read_lora

    specs = [parse_lora_spec(text) for text in flags.lora or ()]
    if specs and backend != "torch" and not refit:
        raise UsageError(ENGINES_NEED_REFIT)
    return [(read_lora(path), scale) for path, scale in specs]


def resolve_refiner(flags: RefinerFlags, source, request: RequestFlags, mode: str):
    """The --refiner model (None: no refiner), checked against the base and the request."""
    from core.errors import UsageError
    from demo.pipeline import TEXT_TO_IMAGE, check_steps, make_scheduler
    from models.source import resolve_model

    if flags.refiner is None:
        return None
    if mode != TEXT_TO_IMAGE:
        raise UsageError(f"--refiner refines SDXL text-to-image, not {mode}: drop --refiner, or --input-image")
    if not source.is_xl:
        raise UsageError(f"--refiner refines an SDXL base model; model '{source.name}' is not one")
    if not 0 < flags.high_noise_frac < 1:
        raise UsageError(f"--high-noise-frac must be between 0 and 1 (both excluded), got {flags.high_noise_frac}")
    refiner = resolve_model(flags.refiner)
    if not refiner.is_xl or "text_encoder_2" not in refiner.components:
        raise UsageError(f"--refiner {flags.refiner} is not an SDXL model (its model_index.json names "
                         f"{refiner.index.get('_class_name')})")
    check_steps(make_scheduler(request.scheduler, refiner), request.scheduler, request.denoising_steps)
    return refiner


def refiner_engine_settings(engine: EngineFlags, base_settings, refiner, backend: str, request: RequestFlags):
    """The refiner's engine settings: the base's flags, its ONNX and engines in refiner/ beside the base's (stage
    names are the same, the engines are not); its UNet stays fp16 under --int8 (calibration runs text-to-image
    pipelines, which a refiner is not)."""
    from dataclasses import replace

    from demo.arguments import engine_settings

    if base_settings is None:  # the torch backend
        return None
    if engine.int8:
        print("note: --int8 quantizes the base UNet; the refiner's stays fp16", file=sys.stderr)
    folders = replace(engine, onnx_dir=str(Path(engine.onnx_dir) / "refiner"),
                      engine_dir=str(Path(engine.engine_dir) / "refiner"), int8=False, calibration_prompts=None)
    return engine_settings(folders, refiner, backend, request.batch_size, request.height, request.width,
                           guided=request.guided)


def engine_options(settings) -> list[str]:
    """The engine settings the report lists beside the plugins."""
    return [name for name, on in (("CUDA graphs", settings.use_cuda_graph), ("INT8 UNet", settings.int8 is not None))
            if on]


def accel_options(settings) -> list[str]:
    """The torch backend's settings other than plugins, as the report lists them."""
    options = [name for name, on in (("channels-last", settings.channels_last), ("CUDA graphs", settings.cuda_graph))
               if on]
    return options + ([f"compile {settings.compile}"] if settings.compile != "none" else [])


def output_stem(model_name: str, seed: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", Path(model_name).name or model_name).strip("-") or "model"
    return f"{slug}-seed{seed}"


def save_outputs(directory: Path, stem: str, images, report) -> list[Path]:
    """Write the PNGs and the JSON report as one set, all or nothing, under names no other run has: `<stem>-<i>.png`
    and `<stem>.json`, or with `-run<N>` after the stem where those exist. A full disk is one line (exit 1)."""
    from PIL import Image

    from core.atomic import write_new_set
    from core.errors import RunFailure
    from demo.pipeline import to_uint8

    pngs = []
    for pixels in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    run = 1
    while True:
        name = stem if run == 1 else f"{stem}-run{run}"
        report.images = [f"{name}-{i}.png" for i in range(len(pngs))]
        files = {**dict(zip(report.images, pngs)), f"{name}.json": report.to_json().encode()}
        try:
            if write_new_set(directory, files):
                return [directory / file for file in files]
        except OSError as exc:
            raise RunFailure(f"cannot save the images in {directory}: {exc.strerror or exc} (nothing was "
                             "written)") from None
        run += 1


def run(flags) -> int:
    import torch
    from tqdm import tqdm

    from demo.arguments import engine_settings, torch_settings
    from demo.backends import create_stages, device_and_dtype, select_backend
    from demo.logs import configure_library_logging
    from demo.memory import check_memory
    from demo.pipeline import TEXT_TO_IMAGE, ExpertsPipeline, GenerationRequest, make_pipeline, resolve_request
    from demo.report import LatencyReport, StageTimer, device_name, library_versions
    from demo.settings import TORCH_USES_ENGINE_FLAGS
    from models import STAGE_MODELS, image_to_image_stages, text_to_image_stages
    from models.lora import check_loras, model_targets

    model, demo, engine, torch_flags = flags[ModelFlags], flags[DemoFlags], flags[EngineFlags], flags[TorchFlags]
    configure_library_logging(model.verbose)
    log = print if model.verbose else (lambda *_: None)

    def progress(message: str) -> None:  # always shown: a first run may build engines for many minutes
        print(message, file=sys.stderr, flush=True)

    backend, reason = select_backend(demo.backend)
    loras = read_loras(flags[LoraFlags], backend, engine.build_enable_refit)
    image_flags = flags[ImageFlags]
    image, mask = read_inputs(image_flags)
    source = model.resolve()
    request = resolve_request(flags[RequestFlags], source, size=image_size(image, flags[RequestFlags], source))
    generation = GenerationRequest.from_flags(request, image, mask, image_flags.strength)
    validate(request, demo, source, generation.mode, generation.strength)
    refiner = resolve_refiner(flags[RefinerFlags], source, request, generation.mode)
    if loras:
        check_loras(loras, model_targets(source))
    device, dtype = device_and_dtype(backend)
    check_memory(source, request.batch_size, request.height, request.width, device, dtype)
    settings = accel = None
    accel_reason = ""
    if backend == "torch":
        accel, accel_reason = torch_settings(engine, torch_flags, device, source)
        unused = changed(engine, ignore=TORCH_USES_ENGINE_FLAGS)
    else:
        settings = engine_settings(engine, source, backend, request.batch_size, request.height, request.width,
                                   guided=request.guided)
        unused = changed(torch_flags)
    if unused:
        print(f"note: {', '.join(unused)} unused by the {backend} backend", file=sys.stderr)

    log(f"[{PROG}] model {source.name} ({source.path}), backend {backend} ({reason}), {device} {dtype}")
    if accel is not None:
        log(f"[{PROG}] torch backend: {accel.describe()} ({accel_reason})")
    def pipeline_of(model_source, engine_settings_):
        names = (text_to_image_stages if generation.mode == TEXT_TO_IMAGE else image_to_image_stages)(model_source)
        stages = create_stages(backend, [STAGE_MODELS[name](model_source) for name in names], device, dtype,
                               engine_settings_, log=log, progress=progress, torch_settings=accel)
        return make_pipeline(model_source, stages, request.scheduler, device, dtype, generation.mode)

    pipeline = pipeline_of(source, settings)
    if refiner is not None:  # its own stages, and its own engines beside the base's (text-to-image only)
        pipeline = ExpertsPipeline(pipeline, pipeline_of(refiner, refiner_engine_settings(
            engine, settings, refiner, backend, request)), flags[RefinerFlags].high_noise_frac)
        unet_calls = pipeline.unet_calls(request.denoising_steps)
    else:
        unet_calls = pipeline.unet_calls(request.denoising_steps, generation.strength)
    refit_ms = pipeline.set_loras(loras)
    for what, text in (("prompt", request.prompt), ("negative prompt", request.negative_prompt or "")):
        dropped = pipeline.dropped_text(text)
        if dropped:
            print(f"warning: the {what} is longer than the text encoder's {source.text_length} tokens; dropped: "
                  f"{dropped!r}", file=sys.stderr)
    for run in range(demo.num_warmup_runs):
        progress(f"[{PROG}] warm-up run {run + 1}/{demo.num_warmup_runs} (untimed) ...")
        pipeline(generation, StageTimer(device))
    timer = StageTimer(device)
    with tqdm(total=unet_calls, desc="denoising", disable=not sys.stderr.isatty(), leave=False) as bar:
        images = pipeline(generation, timer, progress=bar)

    report = LatencyReport(
        prompt=request.prompt, negative_prompt=request.negative_prompt,
        model=source.name if refiner is None else f"{source.name} + {refiner.name}",
        backend=backend, backend_reason=reason, device=device_name(device),
        precision="fp16" if dtype == torch.float16 else "fp32", scheduler=request.scheduler,
        steps=request.denoising_steps, unet_calls=unet_calls, guidance_scale=request.guidance_scale,
        seed=request.seed, batch_size=request.batch_size, height=request.height, width=request.width,
        latent_shape=list(source.latent_shape(request.batch_size, request.height, request.width)),
        latency_ms=timer.milliseconds(), versions=library_versions(backend),
        plugins=list(settings.plugins if settings else accel.plugins),
        options=accel_options(accel) if accel is not None else engine_options(settings),
        options_reason=accel_reason, input_image=image_flags.input_image,
        mask_image=image_flags.mask_image,
        strength=None if generation.mode == TEXT_TO_IMAGE else generation.strength,
        loras=[{"path": lora.path, "scale": scale} for lora, scale in loras], lora_refit_ms=refit_ms,
    )
    written = save_outputs(Path(demo.output_dir), output_stem(source.name, request.seed), images, report)
    print(report.table())
    for path in written:
        print(f"saved {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import run_command
    from demo.settings import parse_flags

    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)))
