"""Does set_loras([]) give back a refittable engine set's base image bit for bit, and is the image the same run to run
at all? (issue 19: sdxl-arch's back-to-base image was not bit-identical on 2026-11-26). On a GPU with TensorRT, from the
repository root: python3 results/refit-h200/restore_check.py MODEL SIZE LEVEL PLUGINS OUT_JSON

Builds MODEL's engines refittable (into onnx-check, engine-check), then, under CUDA graphs, with Euler, 4 steps: the
image twice (determinism), the UNet's per-layer profile (a second execution context), the image again, a LoRA set,
back to the base, the image, and a fresh engine set's image; each image against the first (equal, PSNR, largest
difference). Then each stage twice on one random feed ("stage_repeat": bit-identical or not), which says where a
run-to-run difference starts; PLUGINS none asks the same of TensorRT's own layers.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from bench.runner import compare_images, unet_profile
from demo.arguments import engine_settings
from demo.backends import create_stages
from demo.pipeline import GenerationRequest, make_pipeline, to_uint8
from demo.report import StageTimer
from demo.settings import EngineFlags
from models import STAGE_MODELS, stage_batch, text_to_image_stages
from models.source import resolve_model
from tests.test_lora_refit import loras_for

MODEL, SIZE, LEVEL, PLUGINS, OUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
CUDA, HALF = torch.device("cuda"), torch.float16
source = resolve_model(MODEL)
models = [STAGE_MODELS[name](source) for name in text_to_image_stages(source)]
request = GenerationRequest(["a photo of an astronaut riding a horse"], None, SIZE, SIZE, 4, 7.5, 0)
flags = EngineFlags(onnx_dir="onnx-check", engine_dir="engine-check", build_static_batch=True, build_enable_refit=True,
                    optimization_level=LEVEL, disable_tactic_sources="CUDNN", use_cuda_graph=True, plugins=PLUGINS)
settings = engine_settings(flags, source, "tensorrt", 1, SIZE, SIZE, guided=True)
found: dict = {"model": source.name, "gpu": torch.cuda.get_device_name(), "level": LEVEL, "plugins": PLUGINS}


def pipeline():
    return make_pipeline(source, create_stages("tensorrt", models, CUDA, HALF, settings, log=print, progress=print),
                         "Euler", CUDA, HALF)


def image(p) -> np.ndarray:
    return to_uint8(p(request, StageTimer(CUDA)))


def against(label: str, first: np.ndarray, other: np.ndarray) -> None:
    psnr, max_diff = compare_images(other, first)  # psnr None: equal
    found[label] = {"equal": max_diff == 0, "psnr_db": psnr, "max_diff": max_diff}
    print(label, found[label], flush=True)
    OUT.write_text(json.dumps(found, indent=1))


p = pipeline()
first = image(p)
against("second_run", first, image(p))
unet_profile(p.stages["unet"].engine)
against("after_profile", first, image(p))
p.set_loras(loras_for(source, Path("/tmp")))
against("with_lora", first, image(p))
p.set_loras([])
against("back_to_base", first, image(p))
against("fresh_engines", first, image(pipeline()))
found["stage_repeat"] = {}
for name, stage in p.stages.items():
    batch = stage_batch(name, 1, guided=True)
    stage.prepare(batch, SIZE, SIZE)
    feed = stage.model.sample_inputs(batch, SIZE, SIZE, CUDA, HALF, torch.Generator().manual_seed(1))
    first_out = {key: value.clone() for key, value in stage(feed).items()}
    found["stage_repeat"][name] = all(torch.equal(first_out[key], value) for key, value in stage(feed).items())
print("stage_repeat", found["stage_repeat"], flush=True)
OUT.write_text(json.dumps(found, indent=1))
