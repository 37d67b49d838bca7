"""The floor under a benchmark row: the denoiser's FLOPs per step (the UNet's calls and each ControlNet's, full or
shallow under the step cache; or SD3's transformer's: attention over the text and image tokens, the MLPs, the
modulations' projections) over the GPU's dense fp16 tensor-core peak. FLOPs are counted by torch's FlopCounterMode
(matrix products, convolutions and attention) on the stages' own modules on the meta device: no weight is read and
nothing runs, so the count is the same on any machine."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from models import UNET_SHALLOW, is_controlnet_stage, is_shallow_controlnet_stage
from models.base import StageModel

# Dense (no sparsity) fp16 tensor-core peak in TFLOP/s, from NVIDIA's datasheets, by the name torch gives the GPU.
PEAK_FP16_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.4,  # H100 SXM5
    "NVIDIA H200": 989.4,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
}


def call_gflop(model: StageModel, batch: int, height: int, width: int) -> float:
    """GFLOP of one call of `model`'s module on a batch of `batch` at height x width."""
    module = model.meta_module()
    inputs = model.sample_inputs(batch, height, width, device="meta")  # FLOPs do not depend on the dtype
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(*(inputs[name] for name in model.input_names))
    return counter.get_total_flops() / 1e9


def denoiser_floor(models: dict[str, StageModel], calls: int, whole: int, batch: int, height: int, width: int,
                   gpu: str, controlnet_batch: int | None = None) -> dict:
    """A row's floor fields: the denoiser's GFLOP per step, averaged over a run's `calls` denoiser calls of which
    `whole` ran whole (the rest the step cache's shallow pass), and the ms per step it takes at `gpu`'s peak (None
    where the peak is unknown). `models`: the pipeline's stage models by stage name; `batch`: the denoiser's batch
    (twice the images under guidance), `controlnet_batch` the ControlNets' where it differs (guess mode: the
    prompts' half alone)."""
    total = 0.0
    for name, model in models.items():
        if is_controlnet_stage(name) or is_shallow_controlnet_stage(name):
            count = whole if is_controlnet_stage(name) else calls - whole
            total += count * call_gflop(model, controlnet_batch or batch, height, width)
        elif name == model.source.family.denoiser_stage:  # a UNet, or SD3's or Flux's transformer
            total += whole * call_gflop(model, batch, height, width)
        elif name == UNET_SHALLOW:
            total += (calls - whole) * call_gflop(model, batch, height, width)
    peak = PEAK_FP16_TFLOPS.get(gpu)
    per_step = total / calls
    return {"denoiser_gflop_per_step": round(per_step, 1), "peak_fp16_tflops": peak,
            "floor_ms_per_step": None if peak is None else per_step / peak}
