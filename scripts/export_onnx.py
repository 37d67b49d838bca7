"""Export and optimize a model's stages to ONNX through the artifact cache.

    python scripts/export_onnx.py --model tiny --onnx-dir onnx [--stages clip,unet,vae]

Prints, per stage, the node counts after each optimizer pass and the files written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.errors import UsageError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import torch

    from demo.logs import configure_library_logging
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES
    from models.source import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--onnx-dir", default="onnx")
    parser.add_argument("--stages", default=",".join(TEXT_TO_IMAGE_STAGES),
                        help=f"comma-separated subset of {', '.join(STAGE_MODELS)}")
    parser.add_argument("--force-onnx-export", action="store_true")
    parser.add_argument("--force-onnx-optimize", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    try:
        stages = [s for s in args.stages.split(",") if s]
        unknown = [s for s in stages if s not in STAGE_MODELS]
        if unknown or not stages:
            raise UsageError(f"unknown stage(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(STAGE_MODELS)}")
        configure_library_logging(args.verbose)
        source = resolve_model(args.model)
    except UsageError as exc:
        print(f"export_onnx: error: {exc}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    onnx_dir = Path(args.onnx_dir)
    for name in stages:
        start = time.perf_counter()
        path = STAGE_MODELS[name](source).prepare_onnx(
            onnx_dir, device, dtype, args.force_onnx_export, args.force_onnx_optimize
        )
        size = sum(p.stat().st_size for p in onnx_dir.glob(path.name + "*") if p.suffix != ".json")
        print(f"{name}: {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
