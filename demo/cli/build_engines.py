"""Build TensorRT engines: export -> optimize -> build, for all stages or a chosen subset.

    build-engines --model tiny --backend tensorrt-rtx --target-cc 8.0,8.6,8.9

Works without a GPU with TensorRT for RTX: it builds for --target-cc, by default 8.0, 8.6 and 8.9, in
the precision a GPU run looks for (fp16 unless --onnx-precision says otherwise), so the engines are
reused there. Prints per stage the ONNX size, build time and engine size.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from demo.settings import EngineFlags, ModelFlags, at_least, flag

PROG = "build-engines"


def _flavours_help() -> str:
    from demo.trt_flavour import FLAVOURS

    return f"TensorRT flavour: {', '.join(FLAVOURS)} (default: %(default)s)"


def _stages_help() -> str:
    from models import STAGE_MODELS

    return f"comma-separated subset of {', '.join(STAGE_MODELS)} (default: the model's text-to-image stages)"


@dataclass(frozen=True)
class BuildFlags:
    backend: str = flag(_flavours_help, "tensorrt-rtx")
    stages: str | None = flag(_stages_help)
    batch_size: int = flag("images per run the engines are tuned for (default: %(default)s)", 1)
    max_batch_size: int | None = flag("most images per run the engines take (default: --batch-size, and at least 4 "
                                      "unless --build-static-batch); sd-serve's engines: its --max-batch-size, with "
                                      "its --opt-batch-size as --batch-size")
    height: int | None = flag("image height (default: model's native)")
    width: int | None = flag("image width (default: model's native)")
    no_guidance: bool = flag("CLIP and UNet engines for unguided batches", False)
    onnx_precision: str = flag("ONNX (and so engine) precision (default auto: fp16, what demo-diffusion runs)", "auto",
                               choices=("auto", "fp16", "fp32"))
    report: str | None = flag("write the per-stage table as JSON here too")


def make_parser():
    from demo.arguments import Parser
    from demo.settings import add_flags

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_flags(p, ModelFlags)
    add_flags(p, BuildFlags)
    add_flags(p, EngineFlags, "ONNX and TensorRT engines")
    return p


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import run_command
    from demo.settings import parse_flags

    return run_command(PROG, lambda: build(parse_flags(make_parser(), argv)))


def build(flags) -> int:
    import torch

    from core.atomic import atomic_write_bytes
    from demo.arguments import check_image_size, check_writable_file, engine_settings, parse_stages, stages_of
    from demo.backends import device_and_dtype
    from demo.engine import prepare_stage_engines, stage_int8
    from demo.logs import configure_library_logging
    from demo.trt_flavour import import_flavour
    from models import STAGE_MODELS

    model, build_flags, engine = flags[ModelFlags], flags[BuildFlags], flags[EngineFlags]
    stages = parse_stages(build_flags.stages) if build_flags.stages else None
    at_least("--batch-size", build_flags.batch_size, 1)
    if build_flags.report:
        check_writable_file("report file", Path(build_flags.report))
    import_flavour(build_flags.backend)  # clear error if the flavour is missing
    configure_library_logging(model.verbose)
    source = model.resolve()
    height, width = build_flags.height or source.native_image_size, build_flags.width or source.native_image_size
    check_image_size(source, height, width)
    settings = engine_settings(engine, source, build_flags.backend, build_flags.batch_size, height, width,
                               guided=not build_flags.no_guidance, max_batch=build_flags.max_batch_size)
    device, dtype = device_and_dtype(build_flags.backend, build_flags.onnx_precision)
    precision = "fp16" if dtype == torch.float16 else "fp32"
    start = time.perf_counter()
    log = print if model.verbose else (lambda *_: None)
    models = [STAGE_MODELS[name](source) for name in stages_of(source, stages)]
    quantized = [model.name for model in models if stage_int8(settings, model) is not None]
    if quantized:
        precision += f", int8 {', '.join(quantized)}"
    prepare_stage_engines(models, settings, device, dtype, log=log)
    targets = ",".join(f"{a}.{b}" for a, b in settings.options.resolved_targets())
    print(f"\n{build_flags.backend} engines for {source.name}, {precision}, targets {targets}, "
          f"batch {settings.profile.batch}, height {settings.profile.height}, width {settings.profile.width}")
    print(f"{'stage':<12} {'ONNX MiB':>9} {'export+opt s':>13} {'build s':>8} {'engine MiB':>11}")
    for name, stat in settings.stats.items():
        onnx = ("cached engine: no ONNX needed" if stat["onnx_bytes"] is None
                else f"{stat['onnx_bytes'] / 2**20:9.1f} {stat['onnx_s']:13.1f}")
        print(f"{name:<12} {onnx:>23} {stat['engine_s']:8.1f} {stat['engine_bytes'] / 2**20:11.1f}")
    print(f"total {time.perf_counter() - start:.1f} s; engines in {settings.engine_dir}")
    if build_flags.report:
        atomic_write_bytes(Path(build_flags.report), json.dumps({"model": source.name, "flavour": build_flags.backend,
                                                          "precision": precision, "targets": targets,
                                                          "stages": settings.stats}, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
