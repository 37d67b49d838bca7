"""Build TensorRT engines: export -> optimize -> build, for all stages or a chosen subset.

    python scripts/build_engines.py --model tiny --backend tensorrt-rtx --target-cc 8.0,8.6,8.9

Works without a GPU with TensorRT for RTX: it builds for --target-cc, by default 8.0, 8.6 and 8.9, in
the precision a GPU run looks for (fp16 unless --onnx-precision says otherwise), so the engines are
reused there. Prints per stage the ONNX size, build time and engine size.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.errors import UsageError  # noqa: E402

PROG = "build_engines"


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import run_command

    p = make_parser()
    return run_command(PROG, lambda: build(p.parse_args(argv)))


def make_parser():
    from demo.arguments import Parser, add_engine_arguments, add_model_arguments
    from demo.trt_flavour import FLAVOURS

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--backend", default="tensorrt-rtx", help=f"TensorRT flavour: {', '.join(FLAVOURS)}")
    p.add_argument("--stages", default="clip,unet,vae", help="comma-separated subset of clip, unet, vae, vae_encoder")
    p.add_argument("--batch-size", type=int, default=1, help="images per run the engines serve (default: 1)")
    p.add_argument("--height", type=int, help="image height (default: model's native)")
    p.add_argument("--width", type=int, help="image width (default: model's native)")
    p.add_argument("--no-guidance", action="store_true", help="CLIP and UNet engines for unguided batches")
    p.add_argument("--onnx-precision", choices=("auto", "fp16", "fp32"), default="auto",
                   help="ONNX (and so engine) precision (default auto: fp16, what demo_diffusion runs)")
    p.add_argument("--report", help="write the per-stage table as JSON here too")
    add_engine_arguments(p)
    return p


def build(args) -> int:
    import torch

    from core.atomic import atomic_write_bytes
    from demo.arguments import check_image_size, check_writable_file, engine_settings, parse_stages
    from demo.backends import device_and_dtype
    from demo.engine import prepare_stage_engines
    from demo.logs import configure_library_logging
    from demo.trt_flavour import import_flavour
    from models import STAGE_MODELS
    from models.source import resolve_model

    stages = parse_stages(args.stages)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.report:
        check_writable_file("report file", Path(args.report))
    import_flavour(args.backend)  # clear error if the flavour is missing
    configure_library_logging(args.verbose)
    source = resolve_model(args.model)
    height, width = args.height or source.native_image_size, args.width or source.native_image_size
    check_image_size(source, height, width)
    settings = engine_settings(args, source, args.backend, args.batch_size, height, width,
                               guided=not args.no_guidance)
    device, dtype = device_and_dtype(args.backend, args.onnx_precision)
    precision = "fp16" if dtype == torch.float16 else "fp32"
    start = time.perf_counter()
    log = print if args.verbose else (lambda *_: None)
    prepare_stage_engines([STAGE_MODELS[name](source) for name in stages], settings, device, dtype, log=log)
    targets = ",".join(f"{a}.{b}" for a, b in settings.options.resolved_targets())
    print(f"\n{args.backend} engines for {source.name}, {precision}, targets {targets}, "
          f"batch {settings.profile.batch}, height {settings.profile.height}, width {settings.profile.width}")
    print(f"{'stage':<12} {'ONNX MiB':>9} {'export+opt s':>13} {'build s':>8} {'engine MiB':>11}")
    for name, stat in settings.stats.items():
        onnx = ("cached engine: no ONNX needed" if stat["onnx_bytes"] is None
                else f"{stat['onnx_bytes'] / 2**20:9.1f} {stat['onnx_s']:13.1f}")
        print(f"{name:<12} {onnx:>23} {stat['engine_s']:8.1f} {stat['engine_bytes'] / 2**20:11.1f}")
    print(f"total {time.perf_counter() - start:.1f} s; engines in {settings.engine_dir}")
    if args.report:
        atomic_write_bytes(Path(args.report), json.dumps({"model": source.name, "flavour": args.backend,
                                                          "precision": precision, "targets": targets,
                                                          "stages": settings.stats}, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
