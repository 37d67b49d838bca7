"""Compare a TensorRT backend with the torch backend on one GPU: per stage on identical inputs, and the whole
pipeline with the same seed and scheduler.

    compare-backends --model sd1.5-arch --backend tensorrt --json out.json

Per stage: max |engine - torch| (and the torch output's largest magnitude, for scale) on fresh random
inputs. Pipeline: PSNR and max pixel difference (0-255) between the two images. Engines come from the
same cache as demo-diffusion's, so a run after demo-diffusion builds nothing. The torch side is the
reference: the model's own modules as they are, in the engines' precision.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from core.atomic import check_writable_file, save_file
from core.errors import UsageError, field
from demo.backends.tensorrt.flavour import FLAVOURS
from demo.cli.command import run_command
from demo.cli.flags import (
    CacheFlags,
    EngineFlags,
    ModelFlags,
    Parser,
    RequestFlags,
    add_flags,
    flag,
    parse_flags,
    summary,
)
from demo.cli.to_spec import request_from_flags, spec_from_flags
from demo.request import TEXT_TO_IMAGE

PROG = "compare-backends"


@dataclass(frozen=True)
class CompareFlags:
    backend: str = flag("the TensorRT flavour to compare (default: %(default)s)", "tensorrt")
    json: str | None = flag("write the results here too")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=PROG, description=summary(__doc__))
    add_flags(p, ModelFlags)
    add_flags(p, RequestFlags)
    add_flags(p, CompareFlags)
    add_flags(p, CacheFlags, "step cache")
    add_flags(p, EngineFlags, "ONNX and TensorRT engines")
    return run_command(PROG, lambda: compare(parse_flags(p, argv)))


def compare(flags) -> int:
    compare_flags = flags[CompareFlags]
    if compare_flags.backend not in FLAVOURS:
        raise UsageError(f"{field('backend')} must name a TensorRT flavour to compare with torch ({', '.join(FLAVOURS)}"
                         f"), got '{compare_flags.backend}'")
    if compare_flags.json:
        check_writable_file("--json", Path(compare_flags.json))
    request = request_from_flags(flags)
    spec = spec_from_flags(flags, backend=compare_flags.backend, batch_size=request.batch_size, modes=(TEXT_TO_IMAGE,))
    spec.check()
    request.check_inputs()
    # The runtime loads torch (seconds): what needs no model is answered above, without it.
    import numpy as np
    import torch

    from demo.pipelines import image_psnr, to_uint8
    from demo.runtime.loader import plan_pipeline
    from demo.runtime.report import device_name, precision_name
    from demo.runtime.spec import reference_spec
    from models.stages import stage_batch

    plan = plan_pipeline(spec, request=request)
    request, device = plan.request, plan.device
    # Under the step cache, both run their cached path (the UNet that also returns its deep features, its shallow
    # pass): the same stages, the same calls, compared as they are.
    reference = plan_pipeline(replace(reference_spec(plan.spec), precision=precision_name(plan.dtype),
                                      cache_interval=plan.spec.cache_interval, cache_branch=plan.spec.cache_branch,
                                      cache_threshold=plan.spec.cache_threshold,
                                      cache_max_skips=plan.spec.cache_max_skips),
                              request=request)
    with reference.load() as torch_pipeline, plan.load() as engine_pipeline:
        pipelines = {"torch": torch_pipeline, plan.backend.name: engine_pipeline}
        results = {"model": plan.source.name, "backend": plan.backend.name, "device": device_name(device),
                   "height": request.height, "width": request.width, "scheduler": request.scheduler,
                   "steps": request.denoising_steps, "seed": request.seed, "guidance_scale": request.guidance_scale,
                   "cache_interval": plan.spec.cache_interval, "cache_branch": plan.spec.cached_branch,
                   "cache_threshold": plan.spec.cache_threshold,
                   "stages": {}}
        generator = torch.Generator().manual_seed(request.seed)
        for model in plan.base.models:
            batch = stage_batch(model.name, request.batch_size, request.guided)
            feed = model.sample_inputs(batch, request.height, request.width, device, plan.dtype, generator)
            outputs = {}
            for name, pipeline in pipelines.items():
                stage = pipeline.stages[model.name]
                stage.prepare(batch, request.height, request.width)
                outputs[name] = stage(feed)
            # Every output, by name (a cached UNet's deep features too; an engine's come in its bindings' order).
            got, expected = ([outputs[name][output].float() for output in model.output_names]
                             for name in (plan.backend.name, "torch"))
            results["stages"][model.name] = {
                "max_abs_diff": max((g - e).abs().max().item() for g, e in zip(got, expected)),
                "reference_max_abs": max(e.abs().max().item() for e in expected),
                "finite": all(bool(torch.isfinite(g).all()) for g in got),
            }
        images = {name: to_uint8(pipeline.run([request])) for name, pipeline in pipelines.items()}
    difference = np.abs(images[plan.backend.name].astype(np.int16) - images["torch"].astype(np.int16))
    results["image"] = {"psnr_db": image_psnr(images[plan.backend.name], images["torch"]),
                        "max_pixel_diff": int(difference.max()), "mean_pixel_diff": float(difference.mean())}

    cache = ("" if plan.spec.cached_branch is None else
             f", adaptive step cache (threshold {plan.spec.cache_threshold:g}) from branch {plan.spec.cache_branch} "
             "on both" if plan.spec.step_cache.adaptive else
             f", step cache every {plan.spec.cache_interval} calls from branch {plan.spec.cache_branch} on both")
    print(f"{plan.backend.name} vs torch on {results['device']}, {plan.source.name} {request.height}x"
          f"{request.width}, {request.scheduler} {request.denoising_steps} steps, seed {request.seed}{cache}")
    width = max(8, *map(len, results["stages"]))  # unet_shallow and the like
    print(f"{'stage':<{width}} {'max |engine - torch|':>21} {'max |torch|':>12}")
    for name, row in results["stages"].items():
        print(f"{name:<{width}} {row['max_abs_diff']:21.4g} {row['reference_max_abs']:12.4g}")
    image = results["image"]
    print(f"image: PSNR {image['psnr_db']:.2f} dB, max pixel difference {image['max_pixel_diff']}/255, "
          f"mean {image['mean_pixel_diff']:.3f}")
    if compare_flags.json:
        save_file("--json", Path(compare_flags.json), json.dumps(results, indent=1).encode())
    return 0


if __name__ == "__main__":  # python -m demo.cli.compare_backends: answered as the console command is, signals too
    from demo.cli.entry import compare_backends

    sys.exit(compare_backends())
