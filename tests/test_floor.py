"""The benchmark's floor (bench/floor.py): FLOPs counted on the stages' modules on the meta device are those of a
real run, and a step's count follows the step cache's schedule and the ControlNets."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench.floor import PEAK_FP16_TFLOPS, call_gflop, denoiser_floor
from models.controlnet import ControlNetStageModel, resolve_controlnet
from models.source import resolve_model
from models.unet import UNetModel, UNetShallowModel

SIZE = 64


@pytest.fixture(scope="module")
def tiny():
    return resolve_model("tiny")


def real_gflop(model, batch):
    """The same count on the loaded module with real inputs; attention by its matrix products (the CPU's fused
    attention kernel has no FLOP formula; the GPU's have, as the meta device's path has)."""
    module, inputs = model.load_module().eval(), model.sample_inputs(batch, SIZE, SIZE)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        module(*(inputs[name] for name in model.input_names))
    return counter.get_total_flops() / 1e9


def test_the_meta_count_is_a_real_runs(tiny):
    controlnet = ControlNetStageModel(tiny, resolve_controlnet("tiny-controlnet"), 0)
    for model in (UNetModel(tiny), UNetModel(tiny, 0), UNetShallowModel(tiny, 1), controlnet):
        counted = call_gflop(model, 2, SIZE, SIZE)
        assert counted > 0 and counted == pytest.approx(real_gflop(model, 2), rel=1e-9)
    unet = UNetModel(tiny)
    assert call_gflop(unet, 4, SIZE, SIZE) == pytest.approx(2 * call_gflop(unet, 2, SIZE, SIZE))


def test_a_steps_count_follows_the_cache_and_the_controlnets(tiny):
    full, shallow = call_gflop(UNetModel(tiny, 0), 2, SIZE, SIZE), call_gflop(UNetShallowModel(tiny, 0), 2, SIZE, SIZE)
    cached = denoiser_floor({"unet": UNetModel(tiny, 0), "unet_shallow": UNetShallowModel(tiny, 0)}, 10, 3, 2, SIZE,
                            SIZE, "NVIDIA H200")
    assert cached["denoiser_gflop_per_step"] == round((4 * full + 6 * shallow) / 10, 1)  # calls 0, 3, 6, 9 whole
    assert cached["floor_ms_per_step"] == pytest.approx((4 * full + 6 * shallow) / 10 / PEAK_FP16_TFLOPS["NVIDIA H200"])
    controlnet = ControlNetStageModel(tiny, resolve_controlnet("tiny-controlnet"), 0)
    steered = denoiser_floor({"unet": UNetModel(tiny, controlled=True), "controlnet0": controlnet, "clip": None}, 10,
                             1, 2, SIZE, SIZE, "a GPU of unknown peak")
    plain = call_gflop(UNetModel(tiny), 2, SIZE, SIZE)
    assert steered["denoiser_gflop_per_step"] == round(plain + call_gflop(controlnet, 2, SIZE, SIZE), 1)
    assert steered["floor_ms_per_step"] is None and steered["peak_fp16_tflops"] is None
    guessing = denoiser_floor({"unet": UNetModel(tiny, controlled=True), "controlnet0": controlnet}, 10, 1, 2, SIZE,
                              SIZE, "NVIDIA H200", controlnet_batch=1)  # guess mode: the prompts' half alone
    assert guessing["denoiser_gflop_per_step"] == round(plain + call_gflop(controlnet, 1, SIZE, SIZE), 1)
