"""Compare a TensorRT backend with the torch backend on one GPU: per stage on identical inputs, and the
whole pipeline with the same seed and scheduler.

    python scripts/compare_backends.py --model sd1.5-arch --backend tensorrt --json out.json

Per stage: max |engine - torch| (and the torch output's largest magnitude, for scale) on fresh random
inputs. Pipeline: PSNR and max pixel difference (0-255) between the two images. Engines come from the
same cache as demo_diffusion's, so a run after demo_diffusion builds nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.errors import UsageError  # noqa: E402

PROG = "compare_backends"


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import Parser, add_engine_arguments, add_model_arguments, run_command

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--backend", default="tensorrt", help="the TensorRT flavour to compare (default: tensorrt)")
    p.add_argument("--prompt", default="a photo of an astronaut riding a horse")
    p.add_argument("--height", type=int, help="image height (default: model's native)")
    p.add_argument("--width", type=int, help="image width (default: model's native)")
    p.add_argument("--denoising-steps", type=int, default=50)
    p.add_argument("--guidance-scale", type=float, default=7.5)
    p.add_argument("--scheduler", default="DDIM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here too")
    add_engine_arguments(p)
    return run_command(PROG, lambda: compare(p.parse_args(argv)))


def compare(args) -> int:
    import numpy as np
    import torch

    from demo.arguments import check_image_size, engine_settings
    from demo.backends import create_stages, device_and_dtype, select_backend
    from demo.logs import configure_library_logging
    from demo.pipeline import GenerationRequest, Text2ImagePipeline, image_psnr, to_uint8
    from demo.report import StageTimer
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES, stage_batch
    from models.source import resolve_model

    configure_library_logging(args.verbose)
    backend, _ = select_backend(args.backend)
    if backend == "torch":
        raise UsageError("--backend must name a TensorRT flavour to compare with torch")
    source = resolve_model(args.model)
    height, width = args.height or source.native_image_size, args.width or source.native_image_size
    check_image_size(source, height, width)
    guided = args.guidance_scale > 1.0
    settings = engine_settings(args, source, backend, 1, height, width, guided=guided)
    device, dtype = device_and_dtype(backend)
    models = [STAGE_MODELS[name](source) for name in TEXT_TO_IMAGE_STAGES]
    progress = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    stages = {"torch": create_stages("torch", models, device, dtype),
              backend: create_stages(backend, models, device, dtype, settings, log=lambda *_: None, progress=progress)}

    results = {"model": source.name, "backend": backend, "device": torch.cuda.get_device_name(),
               "height": height, "width": width, "scheduler": args.scheduler, "steps": args.denoising_steps,
               "seed": args.seed, "guidance_scale": args.guidance_scale, "stages": {}}
    generator = torch.Generator().manual_seed(args.seed)
    for model in models:
        batch = stage_batch(model.name, 1, guided)
        feed = model.sample_inputs(batch, height, width, device, dtype, generator)
        outputs = {}
        for name, used in stages.items():
            used[model.name].prepare(batch, height, width)
            outputs[name] = next(iter(used[model.name](feed).values())).float()
        reference = outputs["torch"]
        results["stages"][model.name] = {
            "max_abs_diff": (outputs[backend] - reference).abs().max().item(),
            "reference_max_abs": reference.abs().max().item(),
            "finite": bool(torch.isfinite(outputs[backend]).all()),
        }

    request = GenerationRequest([args.prompt], [""], height, width, args.denoising_steps, args.guidance_scale, args.seed)
    images = {name: to_uint8(Text2ImagePipeline(source, used, args.scheduler, device, dtype)(request, StageTimer(device)))
              for name, used in stages.items()}
    difference = np.abs(images[backend].astype(np.int16) - images["torch"].astype(np.int16))
    results["image"] = {"psnr_db": image_psnr(images[backend], images["torch"]), "max_pixel_diff": int(difference.max()),
                        "mean_pixel_diff": float(difference.mean())}

    print(f"{backend} vs torch on {results['device']}, {source.name} {height}x{width}, {args.scheduler} "
          f"{args.denoising_steps} steps, seed {args.seed}")
    print(f"{'stage':<8} {'max |engine - torch|':>21} {'max |torch|':>12}")
    for name, row in results["stages"].items():
        print(f"{name:<8} {row['max_abs_diff']:21.4g} {row['reference_max_abs']:12.4g}")
    image = results["image"]
    print(f"image: PSNR {image['psnr_db']:.2f} dB, max pixel difference {image['max_pixel_diff']}/255, "
          f"mean {image['mean_pixel_diff']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
