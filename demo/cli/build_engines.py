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

from core.atomic import check_writable_file, save_file
from demo.backends.tensorrt.flavour import FLAVOURS, flavour
from demo.cli.command import run_command
from demo.cli.flags import (
    CacheFlags,
    ControlNetFlags,
    EngineFlags,
    ModelFlags,
    Parser,
    add_flags,
    flag,
    parse_flags,
    summary,
)
from demo.cli.to_spec import spec_from_flags
from demo.runtime.spec import PRECISIONS, PipelineSpec
from models import STAGE_NAMES

PROG = "build-engines"
SPEC = PipelineSpec()
# The flags whose field in the spec is named otherwise.
FLAG_NAMES = {"precision": "--onnx-precision", "guided": "--no-guidance"}


def _flavours_help() -> str:
    return f"TensorRT flavour: {', '.join(FLAVOURS)} (default: %(default)s)"


def _stages_help() -> str:
    return f"comma-separated subset of {', '.join(STAGE_NAMES)} (default: the model's text-to-image stages)"


@dataclass(frozen=True)
class BuildFlags:
    backend: str = flag(_flavours_help, "tensorrt-rtx")
    stages: str | None = flag(_stages_help)
    batch_size: int = flag("images per run the engines are tuned for (default: %(default)s)", SPEC.batch_size)
    max_batch_size: int | None = flag("most images per run the engines take (default: --batch-size, and at least 4 "
                                      "unless --build-static-batch); sd-serve's engines: its --max-batch-size, with "
                                      "its --opt-batch-size as --batch-size", SPEC.max_batch_size)
    height: int | None = flag("image height (default: model's native)", SPEC.height)
    width: int | None = flag("image width (default: model's native)", SPEC.width)
    no_guidance: bool = flag("CLIP and UNet engines for unguided batches", not SPEC.guided)
    onnx_precision: str = flag("ONNX (and so engine) precision (default auto: fp16, what demo-diffusion runs)",
                               SPEC.precision, choices=PRECISIONS)
    report: str | None = flag("write the per-stage table as JSON here too")


def make_parser() -> Parser:
    p = Parser(prog=PROG, description=summary(__doc__))
    add_flags(p, ModelFlags)
    add_flags(p, BuildFlags)
    add_flags(p, ControlNetFlags, "ControlNet", description="with --controlnet, each ControlNet's engine and the "
              "UNet's that takes their residuals, in place of the plain UNet's")
    add_flags(p, CacheFlags, "step cache", description="with --cache-interval above 1 or --cache-threshold above 0, "
              "the UNet's engines for the cache (its full pass and its shallow pass) in place of the plain UNet's")
    add_flags(p, EngineFlags, "ONNX and TensorRT engines")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: build(parse_flags(make_parser(), argv)), FLAG_NAMES)


def build_spec(flags) -> PipelineSpec:
    """The spec of the engines these flags build."""
    build = flags[BuildFlags]
    stages = None if build.stages is None else tuple(name for name in build.stages.split(",") if name)
    return spec_from_flags(flags, backend=build.backend, stages=stages, batch_size=build.batch_size,
                           max_batch_size=build.max_batch_size, height=build.height, width=build.width,
                           guided=not build.no_guidance, precision=build.onnx_precision)


def build(flags) -> int:
    build_flags = flags[BuildFlags]
    flavour(build_flags.backend)  # a TensorRT flavour: what builds engines
    if build_flags.report:
        check_writable_file("report file", Path(build_flags.report))
    spec = build_spec(flags)
    spec.check()
    # The runtime loads torch (seconds): what needs no model is answered above, without it.
    from demo.backends.tensorrt.build import engine_dtype
    from demo.runtime.loader import plan_pipeline
    from demo.runtime.report import precision_name

    plan = plan_pipeline(spec, runs=False, progress=print)  # on stdout, before the table (docs/engines.md)
    start = time.perf_counter()
    stats = plan.build()
    settings = [plan.base.settings_of(model) for model in plan.base.models]
    quantized = [model.name for model, stage in zip(plan.base.models, settings)
                 if stage.int8 is not None and model.takes_int8]
    precision = precision_name(plan.dtype)
    others: dict = {}  # the stages built in another precision than the pipeline's (Family.bf16_engines, an upcast VAE)
    for model, stage in zip(plan.base.models, settings):
        built_in = engine_dtype(model, stage, plan.dtype)
        if built_in != plan.dtype:
            others.setdefault(precision_name(built_in), []).append(model.name)
    precision += "".join(f", {name} {', '.join(names)}" for name, names in others.items())
    if quantized:
        precision += f", int8 {', '.join(quantized)}"
    first = settings[0]
    targets = ",".join(f"{a}.{b}" for a, b in first.options.resolved_targets())
    print(f"\n{plan.backend.name} engines for {plan.source.name}, {precision}, targets {targets}, "
          f"batch {first.profile.batch}, height {first.profile.height}, width {first.profile.width}")
    width = max([12, *map(len, stats)])  # controlnet0_image and the like
    print(f"{'stage':<{width}} {'ONNX MiB':>9} {'export+opt s':>13} {'build s':>8} {'engine MiB':>11}")
    for name, stat in stats.items():
        onnx = ("cached engine: no ONNX needed" if stat["onnx_bytes"] is None
                else f"{stat['onnx_bytes'] / 2**20:9.1f} {stat['onnx_s']:13.1f}")
        print(f"{name:<{width}} {onnx:>23} {stat['engine_s']:8.1f} {stat['engine_bytes'] / 2**20:11.1f}")
    print(f"total {time.perf_counter() - start:.1f} s; engines in {first.engine_dir}")
    if build_flags.report:
        report = {"model": plan.source.name, "flavour": plan.backend.name, "precision": precision,
                  "targets": targets, "stages": stats}
        save_file("report file", Path(build_flags.report), json.dumps(report, indent=1).encode())
    return 0


if __name__ == "__main__":  # python -m demo.cli.build_engines: answered as the console command is, signals too
    from demo.cli.entry import build_engines

    sys.exit(build_engines())
