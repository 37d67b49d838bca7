"""demo-diffusion: text-to-image, image-to-image and inpainting with Stable Diffusion, with a per-stage latency report.

    demo-diffusion "a photo of an astronaut riding a horse" --model tiny
    demo-diffusion "a castle" --model tiny --input-image photo.png --strength 0.6
    demo-diffusion "a castle" --model tiny-inpaint --input-image photo.png --mask-image mask.png
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import replace
from pathlib import Path

from core.atomic import check_writable_directory, write_new_set
from core.errors import RunFailure, at_least, render_fields
from demo.cli.command import flag_name, run_command
from demo.cli.flags import (
    ControlImageFlags,
    ControlNetFlags,
    DemoFlags,
    ImageFlags,
    LoraFlags,
    ModelFlags,
    Parser,
    PrecisionFlags,
    RefinerFlags,
    RequestFlags,
    add_flags,
    add_pipeline_flags,
    parse_flags,
)
from demo.cli.to_spec import request_from_flags, spec_from_flags
from demo.request import recommendation_note
from models.builtin import BUILTIN_MODELS, BUILTIN_NAMES

PROG = "demo-diffusion"


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="Stable Diffusion text-to-image, image-to-image and inpainting with per-stage "
                                      "latency report.")
    add_flags(p, ModelFlags)
    add_flags(p, RequestFlags, required=("prompt",))
    add_flags(p, ImageFlags, "image-to-image and inpainting")
    add_flags(p, DemoFlags)
    add_flags(p, PrecisionFlags)
    add_flags(p, LoraFlags, "LoRA")
    add_flags(p, RefinerFlags)
    add_flags(p, ControlNetFlags, "ControlNet")
    add_flags(p, ControlImageFlags, "ControlNet inputs")
    add_pipeline_flags(p)
    return p


def output_stem(model_name: str, seed: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", Path(model_name).name or model_name).strip("-") or "model"
    return f"{slug}-seed{seed}"


def save_outputs(directory: Path, stem: str, images, report) -> list[Path]:
    """Write the PNGs and the JSON report as one set, all or nothing, under names no other run has: `<stem>-<i>.png`
    and `<stem>.json`, or with `-run<N>` after the stem where those exist. A full disk is one line (exit 1)."""
    pngs = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
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
    demo, images = flags[DemoFlags], flags[ImageFlags]
    at_least("num_warmup_runs", demo.num_warmup_runs, 0)
    check_writable_directory("output directory", Path(demo.output_dir))  # made when the images are saved
    request = request_from_flags(flags)
    spec = spec_from_flags(flags, batch_size=request.batch_size)
    spec.check()
    request.check_inputs()
    # The runtime loads torch (seconds): what needs no model is answered above, without it.
    from tqdm import tqdm

    from demo.runtime.loader import plan_pipeline, to_stderr
    from demo.runtime.plan import lora_recommendations

    plan = plan_pipeline(spec, request=request)
    given, request = request, plan.request
    recommended = recommendation_note(given, request, (*lora_recommendations(plan.loras), plan.source.recommended))
    for note in plan.notes + ([recommended] if recommended else []) + request.unused():
        to_stderr(f"note: {render_fields(note, flag_name)}")
    if plan.source.name in BUILTIN_MODELS:  # generated (the default among them): noise that looks like a fault
        to_stderr(f"note: model '{plan.source.name}' has random weights, so its images look like noise (it runs every "
                  f"path in seconds); --model {BUILTIN_NAMES[0]} is the built-in trained to draw its prompt")
    plan.log(f"[{PROG}] model {plan.source.name} ({plan.source.path}), backend {plan.backend.name} "
             f"({plan.backend_reason}), {plan.device} {plan.dtype}")
    if plan.base.reason:  # where the backend's settings came from, where it says
        plan.log(f"[{PROG}] {plan.backend.name} backend settings: {plan.base.reason}")
    with plan.load() as pipeline:
        for what, text in (("prompt", request.prompt), ("negative prompt", request.negative_prompt or "")):
            dropped = pipeline.dropped_text(text)
            if dropped:
                to_stderr(f"warning: the {what} is longer than the text encoder's {plan.source.text_length} tokens; "
                          f"dropped: {dropped!r}")
        for run in range(demo.num_warmup_runs):
            to_stderr(f"[{PROG}] warm-up run {run + 1}/{demo.num_warmup_runs} (untimed) ...")
            pipeline.run([request])
        with tqdm(total=pipeline.unet_calls(request), desc="denoising", disable=not sys.stderr.isatty(),
                  leave=False) as bar:
            result = pipeline(request, progress=bar)
    report = replace(result.report, input_image=images.input_image, mask_image=images.mask_image)
    written = save_outputs(Path(demo.output_dir), output_stem(plan.source.name, request.seed), result.images, report)
    print(report.table())
    for path in written:
        print(f"saved {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)))
