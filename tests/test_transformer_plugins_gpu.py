"""Our kernels in SD3.5 Medium's and FLUX.1's transformers on a GPU, at their real widths (24 heads of 64 and of 128,
4096 image tokens: 1024x1024) with fewer blocks and random weights: the transformer with every kernel substituted
(joint attention through fMHA, Q/K RMSNorm, the AdaLN modulated LayerNorm, GELU-tanh) against the float32
computation, no further from it than PyTorch's own fp16 computation is (rounding, not a wrong layout or scale).
Skipped without CUDA or the plugin library."""

import copy

import pytest
import torch

from plugins import torch_ops
from plugins.contract import PLUGIN_KEYS
from plugins.diffusers_modules import substitute

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch_ops.available(), reason=f"plugins cannot run here: {torch_ops.status()}")]

CUDA = torch.device("cuda")
IMAGE_SIDE = 64  # patches (SD3) or packed tokens (Flux) a side: 4096 image tokens, a 1024x1024 image


def sd35(seed: int):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    module = SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=3,
                                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192,
                                   qk_norm="rms_norm", dual_attention_layers=(0,))
    g = torch.Generator().manual_seed(seed)
    inputs = {"hidden_states": torch.randn(2, 16, 2 * IMAGE_SIDE, 2 * IMAGE_SIDE, generator=g),
              "encoder_hidden_states": torch.randn(2, 333, 4096, generator=g),
              "pooled_projections": torch.randn(2, 2048, generator=g), "timestep": torch.tensor([500.0, 20.0])}
    return module, inputs


def flux(seed: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    module = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                    pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    g = torch.Generator().manual_seed(seed)
    rows, columns = torch.meshgrid(torch.arange(IMAGE_SIDE), torch.arange(IMAGE_SIDE), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3).float()
    inputs = {"hidden_states": torch.randn(1, IMAGE_SIDE**2, 64, generator=g),
              "encoder_hidden_states": torch.randn(1, 512, 4096, generator=g),
              "pooled_projections": torch.randn(1, 768, generator=g), "timestep": torch.tensor([0.5]),
              "img_ids": image_ids, "txt_ids": torch.zeros(512, 3), "guidance": torch.tensor([3.5])}
    return module, inputs


def run(module, inputs, dtype):
    with torch.inference_mode():
        given = {name: value.to(CUDA, dtype if value.is_floating_point() and "ids" not in name else value.dtype)
                 for name, value in inputs.items()}
        return module.to(CUDA, dtype)(**given, return_dict=False)[0].float()


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite output"
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("make", [sd35, flux], ids=["sd3.5-medium-widths", "flux-widths"])
def test_every_kernel_in_the_transformer_is_as_close_to_fp32_as_pytorch_fp16(make):
    module, inputs = make(seed=0)
    reference = run(copy.deepcopy(module), inputs, torch.float32)
    theirs = run(copy.deepcopy(module), inputs, torch.float16)
    ours = copy.deepcopy(module).to(CUDA, torch.float16)
    report = substitute(ours, PLUGIN_KEYS)
    assert all(report.replaced[key] > 0 for key in ("fMHA", "RMSNorm", "AdaLayerNorm", "GeLU")), report.line("x")
    error, baseline = rel_error(run(ours, inputs, torch.float16), reference), rel_error(theirs, reference)
    assert error <= max(2 * baseline, 2e-3), (error, baseline)
