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
from models.stages import STAGE_MODELS
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
    cached = denoiser_floor({"unet": UNetModel(tiny, 0), "unet_shallow": UNetShallowModel(tiny, 0)}, 10, 4, 2, SIZE,
                            SIZE, "NVIDIA H200")
    assert cached["denoiser_gflop_per_step"] == round((4 * full + 6 * shallow) / 10, 1)  # 4 whole, 6 shallow
    assert cached["floor_ms_per_step"] == pytest.approx((4 * full + 6 * shallow) / 10 / PEAK_FP16_TFLOPS["NVIDIA H200"])
    controlnet = ControlNetStageModel(tiny, resolve_controlnet("tiny-controlnet"), 0)
    steered = denoiser_floor({"unet": UNetModel(tiny, controlled=True), "controlnet0": controlnet,
                              "clip": STAGE_MODELS["clip"](tiny)}, 10,
                             10, 2, SIZE, SIZE, "a GPU of unknown peak")
    plain = call_gflop(UNetModel(tiny), 2, SIZE, SIZE)
    assert steered["denoiser_gflop_per_step"] == round(plain + call_gflop(controlnet, 2, SIZE, SIZE), 1)
    assert steered["floor_ms_per_step"] is None and steered["peak_fp16_tflops"] is None
    guessing = denoiser_floor({"unet": UNetModel(tiny, controlled=True), "controlnet0": controlnet}, 10, 10, 2, SIZE,
                              SIZE, "NVIDIA H200", controlnet_batch=1)  # guess mode: the prompts' half alone
    assert guessing["denoiser_gflop_per_step"] == round(plain + call_gflop(controlnet, 1, SIZE, SIZE), 1)


def sd3_hand_gflop(config: dict, batch: int, text_tokens: int, latent_height: int, latent_width: int) -> float:
    """SD3's transformer (no dual attention) counted by hand, 2 FLOPs a multiply-add: the patch embedding, the
    timestep's (one for the batch) and pooled text's embeddings, the text's projection, per block the modulations'
    projections, Q/K/V and the output projections of both streams, attention over text and image tokens together and
    the 4x MLPs (the last block's text stream stops after its keys and values), the output's modulation and
    projection."""
    patch, width = config["patch_size"], config["num_attention_heads"] * config["attention_head_dim"]
    image = latent_height * latent_width // patch ** 2
    tokens = image + text_tokens  # the two streams side by side, attending as one

    def linear(rows, fan_in, fan_out):
        return 2 * rows * fan_in * fan_out

    flops = linear(batch * image, config["in_channels"] * patch ** 2, width)  # the patch embedding's convolution
    flops += linear(1, 256, width) + linear(1, width, width)  # the timestep's sinusoid through its MLP
    flops += linear(batch, config["pooled_projection_dim"], width) + linear(batch, width, width)
    flops += linear(batch * text_tokens, config["joint_attention_dim"], width)
    for block in range(config["num_layers"]):
        last = block == config["num_layers"] - 1
        flops += linear(batch, width, 6 * width) + linear(batch, width, (2 if last else 6) * width)  # modulations
        flops += 3 * linear(batch * tokens, width, width)  # Q, K, V of the image's and the text's tokens
        flops += 2 * 2 * batch * tokens ** 2 * width  # Q K^T and the weights times V
        flops += linear(batch * (image if last else tokens), width, width)  # output projections
        flops += 2 * linear(batch * (image if last else tokens), width, 4 * width)  # the MLPs
    flops += linear(batch, width, 2 * width) + linear(batch * image, width, patch ** 2 * config["out_channels"])
    return flops / 1e9


def test_the_transformers_count_is_the_hand_count():
    from models.transformer import SD3TransformerModel

    sd3 = resolve_model("tiny-sd3")
    transformer = SD3TransformerModel(sd3)
    height, width = 64, 48
    latent = (height // sd3.vae_scale_factor, width // sd3.vae_scale_factor)
    counted = call_gflop(transformer, 2, height, width)
    assert counted == pytest.approx(sd3_hand_gflop(transformer.config, 2, transformer.text_length, *latent), rel=1e-12)
    others = {name: STAGE_MODELS[name](sd3) for name in ("clip", "clip2", "t5", "vae")}  # not the denoiser: uncounted
    floor = denoiser_floor({**others, "transformer": transformer}, 28, 28, 2, height, width, "NVIDIA H200")
    assert floor["denoiser_gflop_per_step"] == round(counted, 1)
    assert floor["floor_ms_per_step"] == pytest.approx(counted / PEAK_FP16_TFLOPS["NVIDIA H200"])


def test_flux_transformer_is_its_denoiser_and_counted():
    """The floor counts whatever stage the model's family denoises with (Flux's, packed 2x2, its own stage name)."""
    from models.transformer import FluxTransformerModel

    flux = resolve_model("tiny-flux")
    transformer = FluxTransformerModel(flux)
    counted = call_gflop(transformer, 1, 64, 64)
    assert counted > 0
    floor = denoiser_floor({"clip": STAGE_MODELS["clip"](flux), "flux_transformer": transformer}, 4, 4, 1, 64, 64,
                           "NVIDIA H200")
    assert floor["denoiser_gflop_per_step"] == round(counted, 1)
