"""Compare a TensorRT backend with the torch backend on one GPU: per stage on identical inputs, and the
whole pipeline with the same seed and scheduler.

    compare-backends --model sd1.5-arch --backend tensorrt --json out.json

Per stage: max |engine - torch| (and the torch output's largest magnitude, for scale) on fresh random
inputs. Pipeline: PSNR and max pixel difference (0-255) between the two images. Engines come from the
same cache as demo_diffusion's, so a run after demo_diffusion builds nothing.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from core.errors import UsageError
from demo.settings import EngineFlags, ModelFlags, RequestFlags, flag

PROG = "compare-backends"


@dataclass(frozen=True)
class CompareFlags:
    backend: str = flag("the TensorRT flavour to compare (default: %(default)s)", "tensorrt")
    json: str | None = flag("write the results here too")


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import Parser, run_command
    from demo.settings import add_flags, parse_flags

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_flags(p, ModelFlags)
    add_flags(p, RequestFlags)
    add_flags(p, CompareFlags)
    add_flags(p, EngineFlags, "ONNX and TensorRT engines")
    return run_command(PROG, lambda: compare(parse_flags(p, argv)))


def compare(flags) -> int:
    import numpy as np
    import torch

    from core.atomic import atomic_write_bytes
    from demo.arguments import engine_settings
    from demo.backends import create_stages, device_and_dtype, select_backend
    from demo.logs import configure_library_logging
    from demo.pipeline import (
        GenerationRequest,
        check_request,
        image_psnr,
        make_pipeline,
        resolve_request,
        to_uint8,
    )
    from demo.report import StageTimer
    from models import STAGE_MODELS, stage_batch, text_to_image_stages

    compare_flags = flags[CompareFlags]
    configure_library_logging(flags[ModelFlags].verbose)
    backend, _ = select_backend(compare_flags.backend)
    if backend == "torch":
        raise UsageError("--backend must name a TensorRT flavour to compare with torch")
    source = flags[ModelFlags].resolve()
    request = resolve_request(flags[RequestFlags], source)
    check_request(request, source)
    height, width, guided = request.height, request.width, request.guided
    settings = engine_settings(flags[EngineFlags], source, backend, request.batch_size, height, width, guided=guided)
    device, dtype = device_and_dtype(backend)
    models = [STAGE_MODELS[name](source) for name in text_to_image_stages(source)]
    progress = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    stages = {"torch": create_stages("torch", models, device, dtype),
              backend: create_stages(backend, models, device, dtype, settings, log=lambda *_: None, progress=progress)}

    results = {"model": source.name, "backend": backend, "device": torch.cuda.get_device_name(),
               "height": height, "width": width, "scheduler": request.scheduler, "steps": request.denoising_steps,
               "seed": request.seed, "guidance_scale": request.guidance_scale, "stages": {}}
    generator = torch.Generator().manual_seed(request.seed)
    for model in models:
        batch = stage_batch(model.name, request.batch_size, guided)
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

    generation = GenerationRequest.from_flags(request)
    images = {name: to_uint8(make_pipeline(source, used, request.scheduler, device, dtype)(generation,
                                                                                               StageTimer(device)))
              for name, used in stages.items()}
    difference = np.abs(images[backend].astype(np.int16) - images["torch"].astype(np.int16))
    results["image"] = {"psnr_db": image_psnr(images[backend], images["torch"]),
                        "max_pixel_diff": int(difference.max()), "mean_pixel_diff": float(difference.mean())}

    print(f"{backend} vs torch on {results['device']}, {source.name} {height}x{width}, {request.scheduler} "
          f"{request.denoising_steps} steps, seed {request.seed}")
    print(f"{'stage':<8} {'max |engine - torch|':>21} {'max |torch|':>12}")
    for name, row in results["stages"].items():
        print(f"{name:<8} {row['max_abs_diff']:21.4g} {row['reference_max_abs']:12.4g}")
    image = results["image"]
    print(f"image: PSNR {image['psnr_db']:.2f} dB, max pixel difference {image['max_pixel_diff']}/255, "
          f"mean {image['mean_pixel_diff']:.3f}")
    if compare_flags.json:
        atomic_write_bytes(Path(compare_flags.json), json.dumps(results, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
