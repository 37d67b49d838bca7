"""LoRA by engine refit on a GPU with TensorRT (issue 19, part 4), from the repository root once the engines are built
(refit.sh builds them: refittable in engine-refit, plain in engine-plain, with build-engines' flags otherwise alike):

    python3 results/refit-h200/refit_engines.py MODEL SIZE SCHEDULER LEVEL PHASE OUT_JSON

Batch 1 with guidance, 30 steps of SCHEDULER, seed 0, `--plugins auto` (its fMHA packs Q, K and V into one weight,
which the refit must follow), static shapes, CUDA graphs, builder level LEVEL. PHASE `plain` times the plain engines
and profiles their UNet layer by layer (TensorRT's profiler, by layer kind); it runs on the plain set's GPU while the
refittable set still builds. PHASE `refit`: the refittable engines' time and profile; the first LoRA switch (it reads
the base values from the ONNX) and a second one (the deltas' signs flipped) in ms; the image with the LoRA against the
torch backend's with the LoRA fused (PSNR); after set_loras([]) the image against the one before any LoRA, bit for bit;
last, the plain engines timed again on the same GPU for the refittable/plain ratio. Writes OUT_JSON after each step.
Ran on 2026-11-25 as refit_sd15.py (sd1.5-arch 512 DDIM 0, both sets timed in one process, no phases, no profiles).
"""

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.runner import compare_images, unet_profile
from demo.arguments import engine_settings
from demo.backends import create_stages
from demo.pipeline import GenerationRequest, image_psnr, make_pipeline, to_uint8
from demo.report import StageTimer
from demo.settings import EngineFlags
from models import STAGE_MODELS, text_to_image_stages
from models.plugin_set import parse_plugin_set
from models.source import resolve_model
from tests.test_lora_refit import loras_for

MODEL, SIZE, SCHEDULER, LEVEL, PHASE, OUT = (sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5],
                                             Path(sys.argv[6]))
STEPS = 30
CUDA, HALF = torch.device("cuda"), torch.float16
source = resolve_model(MODEL)
models = [STAGE_MODELS[name](source) for name in text_to_image_stages(source)]
request = GenerationRequest(["a photo of an astronaut riding a horse"], None, SIZE, SIZE, STEPS, 7.5, 0)
found: dict = {"model": source.name, "gpu": torch.cuda.get_device_name(),
               "request": f"{SIZE}x{SIZE}, {STEPS} {SCHEDULER} steps, seed 0",
               "plugins": list(parse_plugin_set("auto", xl=source.is_xl)), "optimization_level": LEVEL}


def save() -> None:
    OUT.write_text(json.dumps(found, indent=1))


def pipeline_of(refit: bool):
    kind = "refit" if refit else "plain"  # the folders refit.sh's builds wrote, with its flags
    flags = EngineFlags(onnx_dir=f"onnx-{kind}", engine_dir=f"engine-{kind}", build_static_batch=True,
                        build_enable_refit=refit, optimization_level=LEVEL, disable_tactic_sources="CUDNN",
                        use_cuda_graph=True)
    settings = replace(engine_settings(flags, source, "tensorrt", 1, SIZE, SIZE, guided=True), build_missing=False)
    stages = create_stages("tensorrt", models, CUDA, HALF, settings, log=print, progress=print)
    return make_pipeline(source, stages, SCHEDULER, CUDA, HALF)


def timed(pipeline, label: str, profile: bool = True) -> np.ndarray:
    images, runs = pipeline.timed_runs(request, 1, 5)
    found[label] = {"pipeline_ms": statistics.median(r["pipeline"] for r in runs),
                    "unet_ms_per_step": statistics.median(r["unet"] for r in runs) / pipeline.unet_calls(STEPS)}
    if profile:  # on the last step's inputs
        found[label]["unet_ms_by_kind"], found[label]["unet_slowest_layers"] = unet_profile(
            pipeline.stages["unet"].engine)
    print(label, {k: v for k, v in found[label].items() if k != "unet_slowest_layers"}, flush=True)
    save()
    return to_uint8(images)


def release(pipeline) -> None:
    for stage in pipeline.stages.values():
        stage.close()
    torch.cuda.empty_cache()


if PHASE == "plain":
    plain = pipeline_of(refit=False)
    timed(plain, "plain")
    sys.exit(0)
loras = loras_for(source, Path("/tmp"))
found["loras"] = [{"path": str(lora.path), "scale": scale} for lora, scale in loras]
refit = pipeline_of(refit=True)
base = timed(refit, "refittable")
start = time.perf_counter()
found["first_switch_ms"] = refit.set_loras(loras)
found["first_switch_wall_ms"] = (time.perf_counter() - start) * 1e3
with_lora = timed(refit, "refittable_with_lora", profile=False)
found["second_switch_ms"] = refit.set_loras([(lora, -scale) for lora, scale in loras])
found["back_switch_ms"] = refit.set_loras([])
back = timed(refit, "refittable_back_to_base", profile=False)
found["back_equals_base_bit_for_bit"] = bool(np.array_equal(back, base))
# where not equal: restore_check.py tells drift from run-to-run noise
found["back_vs_base_psnr_db"], found["back_vs_base_max_diff"] = compare_images(back, base)
found["lora_changes_the_image_psnr_db"] = image_psnr(with_lora, base)
save()
release(refit)
reference = make_pipeline(source, create_stages("torch", models, CUDA, HALF, log=print, progress=print), SCHEDULER,
                          CUDA, HALF)
reference.set_loras(loras)
torch_image = to_uint8(reference(request, StageTimer(CUDA)))
psnr, max_diff = compare_images(with_lora, torch_image)
found["engine_lora_vs_torch_lora_psnr_db"], found["engine_lora_vs_torch_lora_max_diff"] = psnr, max_diff
save()
del reference
torch.cuda.empty_cache()
plain = pipeline_of(refit=False)  # on this GPU, for the ratio
timed(plain, "plain_same_gpu", profile=False)
found["refittable_vs_plain"] = found["refittable"]["unet_ms_per_step"] / found["plain_same_gpu"]["unet_ms_per_step"]
save()
print(json.dumps({key: {k: v for k, v in value.items() if k != "unet_slowest_layers"} if isinstance(value, dict)
                  else value for key, value in found.items()}, indent=1))
