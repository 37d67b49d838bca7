"""Export and optimize a model's stages to ONNX through the artifact cache.

    python scripts/export_onnx.py --model tiny --onnx-dir onnx [--stages clip,unet,vae]

Prints, per stage, the node counts after each optimizer pass and the files written.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "export_onnx"


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import Parser, add_model_arguments, run_command
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES

    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--onnx-dir", default="onnx")
    parser.add_argument("--stages", default=",".join(TEXT_TO_IMAGE_STAGES),
                        help=f"comma-separated subset of {', '.join(STAGE_MODELS)}")
    parser.add_argument("--force-onnx-export", action="store_true")
    parser.add_argument("--force-onnx-optimize", action="store_true")
    return run_command(PROG, lambda: export(parser.parse_args(argv)))


def export(args) -> int:
    import torch

    from demo.arguments import parse_stages
    from core.artifacts import artifact_bytes
    from demo.logs import configure_library_logging
    from models import STAGE_MODELS
    from models.source import resolve_model

    stages = parse_stages(args.stages)
    configure_library_logging(args.verbose)
    source = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    onnx_dir = Path(args.onnx_dir)
    for name in stages:
        start = time.perf_counter()
        path = STAGE_MODELS[name](source).prepare_onnx(
            onnx_dir, device, dtype, args.force_onnx_export, args.force_onnx_optimize
        )
        size = artifact_bytes(path)
        print(f"{name}: {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
