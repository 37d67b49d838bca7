"""Our kernels in SD3's and Flux's transformers on the torch backend, without a GPU (float64 reference kernels
registered for the ops on the CPU: tests/plugin_references.py): every joint attention, Q/K RMSNorm, AdaLN modulated
LayerNorm and GELU-tanh substituted and counted from the module types (what cannot be, skipped with its reason), the
substituted transformers computing what diffusers' do on fresh random inputs, and whole tiny-sd3 and tiny-flux images
with every plugin on equal to diffusers' pipelines within 2/255."""

import copy

import pytest
import torch
from torch import nn

from demo.backends.torch.settings import TorchSettings
from demo.request import Request
from models.source import resolve_model
from models.stages import STAGE_MODELS
from plugins.contract import PLUGIN_KEYS, TORCH_OPS, TRANSFORMER_KEYS
from plugins.diffusers_modules import JointAttentionProcessor, repack_qkv, substitute
from tests import plugin_references
from tests.parity import check_parity, torch_stages
from tests.plugin_references import cpu_kernels

KEYS = ("fMHA", *TRANSFORMER_KEYS)  # what of ours the transformers have
ALL = tuple(sorted(PLUGIN_KEYS))
MODELS = ("tiny-sd3", "tiny-sd3.5", "tiny-flux")
HEIGHT, WIDTH = 32, 48  # latents 16 x 24 (SD3: 8 x 12 patches; Flux: 8 x 12 packed tokens)


@pytest.fixture(scope="module")
def sources(tiny_sd35):
    return {"tiny-sd3": resolve_model("tiny-sd3"), "tiny-sd3.5": tiny_sd35, "tiny-flux": resolve_model("tiny-flux")}


@pytest.fixture(scope="module")
def loaded(sources):
    """Per model: its transformer stage model and module, loaded once (tests substitute into copies)."""
    stages = {}
    for name, source in sources.items():
        model = STAGE_MODELS[source.family.denoiser_stage](source)
        stages[name] = model, model.load_module().eval()
    return stages


def census(module: nn.Module) -> tuple[dict[str, int], int, int]:
    """What each key should take, counted from the module types; the norm2s their blocks modulate inline (no AdaLN
    module to take); the MMDiT-X norms (two ada_layer_norm calls each). Attention counts with diffusers' processor."""
    from diffusers.models import normalization as norms
    from diffusers.models.activations import GELU
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor, FluxTransformerBlock

    modules = list(module.modules())
    ada = (norms.AdaLayerNormZero, norms.SD35AdaLayerNormZeroX, norms.AdaLayerNormZeroSingle,
           norms.AdaLayerNormContinuous)
    expected = {
        "fMHA": sum(type(m.processor) is (FluxAttnProcessor if isinstance(m, FluxAttention) else JointAttnProcessor2_0)
                    for m in modules if isinstance(m, (Attention, FluxAttention))),
        "RMSNorm": sum(type(m) in (norms.RMSNorm, nn.RMSNorm) for m in modules),
        "AdaLayerNorm": sum(type(m) in ada for m in modules),
        "GeLU": sum(type(m) in (GELU, nn.GELU) and m.approximate == "tanh" for m in modules)}
    inline = sum(getattr(m, name, None) is not None for m in modules
                 if type(m) in (JointTransformerBlock, FluxTransformerBlock) for name in ("norm2", "norm2_context"))
    return expected, inline, sum(type(m) is norms.SD35AdaLayerNormZeroX for m in modules)


def inputs(model, seed):
    return model.sample_inputs(2, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(seed))


def run(model, module, seed):
    with torch.inference_mode():
        return module(*inputs(model, seed).values())


def assert_close(actual, expected, bound=1e-5):
    assert actual.shape == expected.shape and torch.isfinite(actual).all()
    assert (actual - expected).abs().max().item() <= bound * expected.abs().max().item()


@pytest.mark.parametrize("name", MODELS)
def test_every_kernel_the_transformers_take_is_substituted(name, loaded):
    _, module = loaded[name]
    module = copy.deepcopy(module)
    expected, inline, _ = census(module)
    report = substitute(module, PLUGIN_KEYS)
    assert dict(report.replaced) == {key: count for key, count in expected.items() if count}
    assert all(expected[key] > 0 for key in KEYS if (key, name) != ("RMSNorm", "tiny-sd3"))  # SD3 (1): no Q/K norms
    # Nothing of diffusers' own is left where a substitute went; the attention runs our processor.
    assert census(module)[0] == {key: 0 for key in KEYS}
    processors = [m.processor for m in module.modules() if hasattr(m, "processor")]
    assert len(processors) == expected["fMHA"] and all(isinstance(p, JointAttentionProcessor) for p in processors)
    # The norm2s the blocks modulate inline are what is left, skipped with their reasons; nothing else is.
    assert inline > 0 and len(report.skipped["AdaLayerNorm"]) == len(report.skipped["LayerNorm"]) == inline
    assert all("modulated inline" in reason for reason in report.skipped["AdaLayerNorm"])
    assert all("no affine" in reason for reason in report.skipped["LayerNorm"])
    assert not any(report.skipped[key] for key in PLUGIN_KEYS if key not in ("AdaLayerNorm", "LayerNorm"))
    if name == "tiny-sd3":  # for the record: two blocks, the second context-only (norm1_context continuous)
        assert report.line("transformer").endswith("RMSNorm 0, AdaLayerNorm 5 (skipped 3), GeLU 3")
        assert report.replaced["fMHA"] == 2


CASES = [(name, key) for name in MODELS for key in (*KEYS, "all") if (name, key) != ("tiny-sd3", "RMSNorm")]


@pytest.mark.parametrize("name, key", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_substituted_transformers_compute_what_diffusers_does(name, key, loaded):
    model, reference = loaded[name]
    module = copy.deepcopy(reference)
    keys = PLUGIN_KEYS if key == "all" else (key,)
    report = substitute(module, keys)
    with cpu_kernels():
        actual = run(model, module, seed=3)
        twice = census(reference)[2]  # MMDiT-X's norm: two modulations of one norm, two calls
        for each in keys:  # each substitute ran once per module it replaced (MMDiT-X's norm twice), nothing else ran
            calls = report.replaced[each] + (twice if each == "AdaLayerNorm" else 0)
            assert plugin_references.calls[TORCH_OPS[each]] == calls, each
        assert report.replaced[key if key != "all" else "fMHA"] > 0
        assert sum(plugin_references.calls[TORCH_OPS[k]] for k in PLUGIN_KEYS) == \
            sum(report.replaced.values()) + (twice if "AdaLayerNorm" in keys else 0)
    assert_close(actual, run(model, reference, seed=3))


def test_joint_attention_gives_way_and_follows_new_weights(loaded):
    """A mask goes to diffusers' processor (no kernel runs); weights changed in place (a LoRA fused in) reach the
    packed projections of image and text tokens once repack_qkv made them again."""
    from diffusers.models.attention_processor import Attention

    model, reference = loaded["tiny-sd3.5"]
    module = copy.deepcopy(reference)
    substitute(module, ("fMHA", "RMSNorm"))
    attn = next(m for m in module.modules() if isinstance(m, Attention) and m.add_q_proj is not None)
    x, context = torch.randn(2, 12, attn.query_dim), torch.randn(2, 5, attn.query_dim)
    reference_attn = copy.deepcopy(attn)
    reference_attn.processor = attn.processor.original
    with cpu_kernels(), torch.inference_mode():
        masked = attn(x, context, attention_mask=torch.zeros(2, 1, 17))
        assert plugin_references.calls["fmha"] == 0
        for a, b in zip(masked, reference_attn(x, context, attention_mask=torch.zeros(2, 1, 17))):
            assert_close(a, b)
    reference = copy.deepcopy(reference)
    with torch.no_grad():
        for network in (module, reference):
            for block in network.transformer.transformer_blocks:
                block.attn.add_k_proj.weight.mul_(1.5)
                block.attn.to_v.bias.add_(0.25)
    with cpu_kernels():
        stale = run(model, module, seed=4)
        repack_qkv(module)
        fresh = run(model, module, seed=4)
    expected = run(model, reference, seed=4)
    assert (stale - expected).abs().max() > 1e-3 * expected.abs().max()
    assert_close(fresh, expected)


def test_substituted_flux_transformer_compiles_into_one_graph(loaded):
    """torch.compile traces the joint attention (its RoPE, its norms) and our ops through their fake implementations
    without a graph break; aot_eager runs the traced graph with the CPU reference kernels."""
    model, reference = loaded["tiny-flux"]
    module = copy.deepcopy(reference)
    substitute(module, PLUGIN_KEYS)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=False)
    with cpu_kernels():
        actual = run(model, compiled, seed=5)
        assert plugin_references.calls["fmha"] == 2
    assert_close(actual, run(model, reference, seed=5))


@pytest.mark.parametrize("name, size, steps", [("tiny-sd3", 64, 3), ("tiny-flux", 128, 2)])
def test_a_whole_image_with_every_plugin_is_diffusers_image(name, size, steps, sources):
    source = sources[name]
    stages = torch_stages(source, settings=TorchSettings(plugins=ALL))
    substitution = stages[source.family.denoiser_stage].substitution
    assert all(substitution.replaced[key] > 0 for key in KEYS if (key, name) != ("RMSNorm", "tiny-sd3"))
    made = Request("a photo of a cat on a table", denoising_steps=steps, seed=11, height=size, width=size,
                   guidance_scale=4.0).resolved(source)
    with cpu_kernels():
        check_parity(source, stages, made.scheduler, made)
        assert plugin_references.calls["fmha"] >= steps * substitution.replaced["fMHA"]
        assert plugin_references.calls["gelu_tanh"] >= steps * substitution.replaced["GeLU"]


@pytest.mark.parametrize("name", ["sd3.5-medium", "flux.1-dev"])
def test_the_published_architectures_are_taken_whole(name):
    """SD3.5 Medium's transformer (24 heads of 64, MMDiT-X in its first 13 blocks) and FLUX.1's (24 heads of 128, 19
    double- and 38 single-stream blocks, diffusers' defaults), on the meta device: every attention, norm and GELU
    taken, only the inline-modulated norm2s skipped."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from models.builtin import BUILTIN_MODELS

    with torch.device("meta"):
        module = SD3Transformer2DModel(**BUILTIN_MODELS["sd3.5-medium-arch"]["transformer"]) \
            if name == "sd3.5-medium" else FluxTransformer2DModel()
    expected, inline, _ = census(module)
    report = substitute(module, PLUGIN_KEYS)
    assert dict(report.replaced) == expected
    assert expected == ({"fMHA": 37, "RMSNorm": 122, "AdaLayerNorm": 49, "GeLU": 47} if name == "sd3.5-medium" else
                        {"fMHA": 57, "RMSNorm": 152, "AdaLayerNorm": 77, "GeLU": 76})
    assert {key: len(reasons) for key, reasons in report.skipped.items() if reasons} == \
        {"LayerNorm": inline, "AdaLayerNorm": inline}
    assert report.packed_bytes > 0
