"""The torch backend's accelerations without a GPU: our kernels substituted into the diffusers modules
(found where they should be, sharing the weights, computing the same with float32 reference kernels
registered for our ops on the CPU, compiling into one graph), where its settings come from, and the
usage errors of combinations that cannot run here. tests/test_torch_accel_gpu.py runs the real kernels."""

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

from core.errors import UsageError
from demo.backends.torch.settings import (
    COMPILE_MODES,
    FALLBACK,
    TorchSettings,
    check_torch_settings,
    computed_part,
    resolve_torch_settings,
)
from models import CLIP, STAGE_MODELS, UNET, VAE
from models.builtin import BUILTIN_MODELS
from plugins import torch_ops
from plugins.contract import PLUGIN_KEYS, TORCH_OPS, UNET_KEYS
from plugins.diffusers_modules import AttentionProcessor, substitute
from plugins.tuned import TORCH_DEFAULTS
from tests import plugin_references
from tests.plugin_references import cpu_kernels

SD_STAGES = (CLIP, UNET, VAE)  # the text-to-image stages of an SD 1.x/2.x model (tiny's)

CPU = torch.device("cpu")


def census(network: nn.Module) -> tuple[dict[str, int], int]:
    """What each family should find, counted from the module types; and the SiLUs GroupNorm should fold."""
    from diffusers.models.activations import GEGLU
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    modules = [m for _, m in network.named_modules()]
    count = lambda kind: sum(type(m) is kind for m in modules)  # noqa: E731
    attention = [m for m in modules if isinstance(m, Attention)]
    expected = {"fMHA": sum(not a.is_cross_attention for a in attention),
                "fMHCA": sum(a.is_cross_attention for a in attention),
                "GroupNorm": count(nn.GroupNorm), "LayerNorm": count(nn.LayerNorm), "SplitGeLU": count(GEGLU),
                "Seq2Spatial": count(Transformer2DModel)}
    silu = 2 * count(ResnetBlock2D) + sum(type(getattr(m, "conv_norm_out", None)) is nn.GroupNorm for m in modules)
    return expected, silu


def load(tiny, stage):
    model = STAGE_MODELS[stage](tiny)
    return model, model.load_module().eval()


def outputs(model, module, channels_last=False, seed=0):
    feed = model.sample_inputs(2, 64, 48, generator=torch.Generator().manual_seed(seed))
    inputs = [t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t
              for t in feed.values()]
    with torch.inference_mode():
        return module(*inputs)


def assert_close(actual, expected, bound=1e-5):
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    assert (actual - expected).abs().max().item() <= bound * expected.abs().max().item()


# ---- what is substituted ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["clip", "unet", "vae"])
def test_every_module_the_kernels_take_is_substituted_on_tiny(tiny, stage):
    _, module = load(tiny, stage)
    network = computed_part(stage, module)
    expected, silu = census(network)
    report = substitute(network, PLUGIN_KEYS)
    assert dict(report.replaced) == {k: v for k, v in expected.items() if v}
    assert report.silu_folded == silu
    # CLIP's attention is causal: skipped with its reason; nothing else in tiny is out of the kernels' reach.
    clip_layers = BUILTIN_MODELS["tiny"]["text_encoder"]["num_hidden_layers"] if stage == "clip" else 0
    assert len(report.skipped["fMHA"]) == clip_layers
    assert all("causal" in reason for reason in report.skipped["fMHA"])
    assert not any(report.skipped[key] for key in PLUGIN_KEYS if key != "fMHA")
    # Nothing of diffusers' own is left where a substitute went.
    assert census(network)[0] | {"fMHA": 0, "fMHCA": 0, "Seq2Spatial": 0} == {k: 0 for k in UNET_KEYS}
    processors = [m.processor for m in network.modules() if hasattr(m, "set_processor")]
    assert all(isinstance(p, AttentionProcessor) for p in processors)
    if stage == "unet":  # the numbers for the record, as the ONNX passes find them in tiny's UNet graph
        assert dict(report.replaced) == {"fMHA": 6, "fMHCA": 6, "GroupNorm": 31, "LayerNorm": 18, "SplitGeLU": 6,
                                         "Seq2Spatial": 6}
        assert report.line("unet") == ("[plugins] unet: fMHA 6, fMHCA 6, GroupNorm 31 (25 with SiLU), LayerNorm 18, "
                                       "SplitGeLU 6, Seq2Spatial 6, RMSNorm 0, AdaLayerNorm 0, GeLU 0")


def test_sd15_architecture_counts_and_the_vae_attention_skip():
    """sd1.5-arch's UNet and VAE decoder (on the meta device: shapes only): the same counts as the ONNX
    passes find in its graph, and the VAE's single-head attention (head size 512) skipped with its reason."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**BUILTIN_MODELS["sd1.5-arch"]["unet"])
        vae = AutoencoderKL(**BUILTIN_MODELS["sd1.5-arch"]["vae"])
    report = substitute(unet, PLUGIN_KEYS)
    assert dict(report.replaced) == {"fMHA": 16, "fMHCA": 16, "GroupNorm": 61, "LayerNorm": 48, "SplitGeLU": 16,
                                     "Seq2Spatial": 16}
    assert report.silu_folded == 45 and not any(report.skipped.values())
    # 16 self-attentions' Q, K and V projections packed once, in fp32 here: 3 x sum of C^2 over the transformers.
    widths = [320] * 5 + [640] * 5 + [1280] * 6
    assert report.packed_bytes == 3 * sum(c * c for c in widths) * 4
    report = substitute(vae.decoder, PLUGIN_KEYS)
    assert report.replaced["fMHA"] == 0
    assert report.skipped["fMHA"] == ["mid_block.attentions.0: head size 512 is not a multiple of 8 up to 256"]
    assert report.as_dict()["fMHA"] == {"replaced": 0, "skipped": 1, "skipped_reasons": report.skipped["fMHA"]}
    assert report.replaced["GroupNorm"] == 30 and report.silu_folded == 29  # every one but the attention's own
    assert isinstance(vae.decoder.mid_block.attentions[0].group_norm, nn.Module)


def test_weights_are_shared_not_copied(tiny):
    """Every parameter and buffer keeps its name and its storage; the one addition is the packed QKV
    projection, a non-persistent buffer holding to_q/to_k/to_v's rows interleaved per head."""
    from diffusers.models.attention_processor import Attention

    _, module = load(tiny, "unet")
    before = {name: t.data_ptr() for name, t in module.state_dict(keep_vars=True).items()}
    originals = {name: m for name, m in module.named_modules() if type(m) in (nn.GroupNorm, nn.LayerNorm)}
    report = substitute(module, PLUGIN_KEYS)
    after = {name: t.data_ptr() for name, t in module.state_dict(keep_vars=True).items()}
    assert after == before
    for name, original in originals.items():  # the same Parameter objects, not equal copies
        assert module.get_submodule(name).weight is original.weight
        assert module.get_submodule(name).bias is original.bias
    attention = [m for m in module.modules() if isinstance(m, Attention) and not m.is_cross_attention]
    packed_bytes = 0
    for attn in attention:
        heads, size = attn.heads, attn.inner_dim // attn.heads
        rows = attn.sdp_qkv_weight.view(heads, 3, size, -1)
        for i, projection in enumerate((attn.to_q, attn.to_k, attn.to_v)):
            assert torch.equal(rows[:, i], projection.weight.view(heads, size, -1))
        assert "sdp_qkv_weight" not in attn.state_dict()
        packed_bytes += attn.sdp_qkv_weight.numel() * attn.sdp_qkv_weight.element_size()
    assert report.packed_bytes == packed_bytes > 0


def test_unknown_family_is_refused(tiny):
    _, module = load(tiny, "unet")
    with pytest.raises(ValueError, match="unknown plugin families.*GEGLU"):
        substitute(module, ["GEGLU"])


# ---- what the substitutes compute --------------------------------------------------------------------------

CASES = [(stage, family) for stage, families in (("clip", ["LayerNorm"]), ("vae", ["fMHA", "GroupNorm"]),
                                                 ("unet", [*UNET_KEYS, "all"])) for family in families]


@pytest.mark.parametrize("stage, family", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_substituted_modules_compute_what_diffusers_does(tiny, stage, family):
    model, module = load(tiny, stage)
    reference = copy.deepcopy(module)
    families = PLUGIN_KEYS if family == "all" else (family,)
    report = substitute(computed_part(stage, module), families)
    with cpu_kernels():
        actual = outputs(model, module)
        for key in families:  # each substitute ran once per module it replaced, and nothing else ran
            assert plugin_references.calls[TORCH_OPS[key]] == report.replaced[key], key
            assert report.replaced[key] > 0 or key not in UNET_KEYS, key  # the transformers' keys: none here
        assert sum(plugin_references.calls[TORCH_OPS[key]] for key in PLUGIN_KEYS) == sum(report.replaced.values())
    assert_close(actual, outputs(model, reference))


def test_group_norm_reads_channels_last_memory_and_seq2spatial_gives_way(tiny):
    """With channels-last memory GroupNorm runs the kernel's NHWC layout, and Seq2Spatial is skipped:
    back to NCHW is a view there."""
    model, module = load(tiny, "unet")
    reference = copy.deepcopy(module)
    report = substitute(module, PLUGIN_KEYS, channels_last=True)
    module.to(memory_format=torch.channels_last)
    assert report.replaced["Seq2Spatial"] == 0 and len(report.skipped["Seq2Spatial"]) == 6
    assert all("channels-last" in reason for reason in report.skipped["Seq2Spatial"])
    with cpu_kernels():
        actual = outputs(model, module, channels_last=True)
        assert plugin_references.calls["group_norm channels_last"] > 0
    assert_close(actual, outputs(model, reference))


def test_attention_calls_it_was_not_made_for_go_to_diffusers(tiny):
    """A mask (or the other kind of attention) is left to the original processor: no kernel runs."""
    from diffusers.models.attention_processor import Attention

    _, module = load(tiny, "unet")
    attn = next(m for m in module.modules() if isinstance(m, Attention) and not m.is_cross_attention)
    reference = copy.deepcopy(attn)
    substitute(attn, ["fMHA"])
    x = torch.randn(2, 16, attn.query_dim)
    mask = torch.zeros(2, 1, 16)
    with cpu_kernels(), torch.inference_mode():
        masked = attn(x, attention_mask=mask)
        assert plugin_references.calls["fmha"] == 0
        assert_close(attn(x), reference(x))
        assert plugin_references.calls["fmha"] == 1
    assert_close(masked, reference(x, attention_mask=mask))


def test_substituted_unet_compiles_into_one_graph(tiny):
    """torch.compile traces the substitutes and our ops (through their fake implementations) without
    a graph break; aot_eager runs the traced graph with the CPU reference kernels."""
    model, module = load(tiny, "unet")
    reference = copy.deepcopy(module)
    substitute(module, PLUGIN_KEYS)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=False)
    with cpu_kernels():
        actual = outputs(model, compiled)
        assert plugin_references.calls["fmha"] == 6
    assert_close(actual, outputs(model, reference))


def test_torch_stage_with_plugins_runs_the_pipeline(tiny):
    """The whole tiny pipeline through TorchStage with every family substituted (its wiring: which part of
    each stage module, the reference kernels standing in for the GPU), against the plain stages."""
    from demo.backends.torch.stage import TorchStage
    from demo.pipelines import StageTimer, Text2ImagePipeline, image_psnr, to_uint8
    from demo.request import Request

    request = Request("a red car", "", height=48, width=64, denoising_steps=3, guidance_scale=7.5, seed=4)
    images = {}
    for label, settings in (("plain", FALLBACK), ("plugins", TorchSettings(plugins=tuple(sorted(PLUGIN_KEYS))))):
        stages = {name: TorchStage(STAGE_MODELS[name](tiny), CPU, torch.float32, settings)
                  for name in SD_STAGES}
        with cpu_kernels():
            images[label] = to_uint8(Text2ImagePipeline(tiny, stages, "DDIM", CPU, torch.float32)(
                request, StageTimer(CPU)))
            if settings.plugins:
                assert stages["unet"].substitution.replaced["fMHA"] == 6
                assert plugin_references.calls["fmha"] == 3 * 6 + 1  # three UNet calls, and the VAE's attention
    assert np.abs(images["plain"].astype(int) - images["plugins"].astype(int)).max() <= 1
    assert image_psnr(images["plain"], images["plugins"]) > 50


# ---- settings: the defaults table, flags and what cannot run ------------------------------------------------

def _table(tmp_path, entries) -> str:
    """A tuned-defaults file with these torch defaults."""
    table = tmp_path / "tuned_defaults.json"
    table.write_text(json.dumps({TORCH_DEFAULTS: entries}))
    return table


@pytest.fixture
def on_a_gpu(monkeypatch):
    """Settings resolved as on an sm_90 GPU with the plugin library available."""
    monkeypatch.setattr("demo.backends.torch.settings.local_compute_capability", lambda: "9.0")
    monkeypatch.setattr(torch_ops, "_STATUS", "available")
    return torch.device("cuda")


ENTRY = {"plugins": ["GroupNorm", "LayerNorm"], "channels_last": True, "cuda_graph": True,
         "compile": "max-autotune-no-cudagraphs", "gpu": "NVIDIA H100", "date": "2026-01-01", "source": "test"}


def test_defaults_come_from_the_table_and_flags_win(tmp_path, on_a_gpu):
    table = _table(tmp_path, {"9.0": ENTRY})
    settings, source = resolve_torch_settings(device=on_a_gpu, table=table)
    assert settings == TorchSettings(("GroupNorm", "LayerNorm"), True, True, "max-autotune-no-cudagraphs")
    assert "compute capability 9.0" in source and "NVIDIA H100" in source
    settings, _ = resolve_torch_settings("none", False, False, "default", device=on_a_gpu, table=table)
    assert settings == TorchSettings((), False, False, "default")
    # An explicit compile mode with graphs of its own turns the table's CUDA graphs off, and the reverse.
    assert resolve_torch_settings(compile_mode="reduce-overhead", device=on_a_gpu, table=table)[0].cuda_graph is False
    table = _table(tmp_path, {"9.0": dict(ENTRY, cuda_graph=False, compile="reduce-overhead")})
    assert resolve_torch_settings(cuda_graph=True, device=on_a_gpu, table=table)[0].compile == "none"
    # No entry for this GPU: the conservative fallback, plain diffusers modules.
    settings, source = resolve_torch_settings(device=on_a_gpu, table=_table(tmp_path, {"8.0": ENTRY}))
    assert settings == FALLBACK and "no entry for compute capability 9.0" in source


def test_auto_leaves_out_plugins_that_cannot_run_but_explicit_ones_fail(tmp_path, on_a_gpu, monkeypatch):
    table = _table(tmp_path, {"9.0": ENTRY})
    monkeypatch.setattr(torch_ops, "_STATUS", "plugin library not built: build/libsdplugins.so is missing")
    settings, source = resolve_torch_settings(device=on_a_gpu, table=table)
    assert settings.plugins == () and settings.channels_last and "plugins left out (plugin library not built" in source
    # the field as the Python API names it
    with pytest.raises(UsageError, match="plugins GroupNorm: plugin library not built"):
        resolve_torch_settings("GroupNorm", device=on_a_gpu, table=table)


@pytest.mark.parametrize("entry", [dict(ENTRY, compile="fast"), dict(ENTRY, plugins=["GEGLU"]),
                                   {k: v for k, v in ENTRY.items() if k != "cuda_graph"}, ["not", "an", "object"]])
def test_a_bad_table_entry_is_a_usage_error(tmp_path, on_a_gpu, entry):
    with pytest.raises(UsageError, match="entry '9.0' needs"):
        resolve_torch_settings(device=on_a_gpu, table=_table(tmp_path, {"9.0": entry}))


@pytest.mark.parametrize("settings, message", [
    (TorchSettings(compile="default"), "^compile default needs a CUDA GPU"),  # the fields, as the API names them
    (TorchSettings(cuda_graph=True), "^use_cuda_graph needs a CUDA GPU"),
    (TorchSettings(plugins=("fMHA",)), "^plugins fMHA needs a CUDA GPU"),
    (TorchSettings(cuda_graph=True, compile="max-autotune-no-cudagraphs"),
     "and compile max-autotune-no-cudagraphs need"),
])
def test_what_needs_a_gpu_is_refused_on_a_cpu(settings, message):
    with pytest.raises(UsageError, match=message):
        check_torch_settings(settings, CPU)
    check_torch_settings(TorchSettings(channels_last=True), CPU)  # channels-last runs anywhere


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_two_cuda_graph_mechanisms_at_once_are_refused(on_a_gpu, mode):
    assert mode in COMPILE_MODES
    with pytest.raises(UsageError, match=f"compile {mode} captures CUDA graphs itself"):
        check_torch_settings(TorchSettings(cuda_graph=True, compile=mode), on_a_gpu)


@pytest.mark.parametrize("args, message", [
    (["--compile", "default"], "--compile default needs a CUDA GPU"),
    (["--use-cuda-graph"], "--use-cuda-graph needs a CUDA GPU"),
    (["--plugins", "all"], "needs a CUDA GPU"),
    (["--compile", "fastest"], "unknown --compile mode 'fastest'"),
    (["--plugins", "fMHA,GEGLU"], "unknown plugin(s) GEGLU"),
])
def test_demo_refuses_before_loading_anything(args, message, tmp_path, tiny, capsys, no_loading):
    from demo.cli.generate import main

    out = tmp_path / "out"
    status = main(["a prompt", "--backend", "torch", "--output-dir", str(out), "--denoising-steps", "2", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("demo-diffusion: error: ")
    assert message in lines[0]
    assert not out.exists()


def test_demo_channels_last_on_the_cpu(tmp_path, tiny):
    """--channels-last reaches the modules and the report, and draws the same image."""
    from PIL import Image

    from demo.cli.generate import main

    common = ["a red car", "--model", "tiny", "--seed", "3", "--denoising-steps", "2", "--num-warmup-runs", "0",
              "--height", "48", "--width", "64", "--scheduler", "DDIM"]
    assert main([*common, "--output-dir", str(tmp_path / "plain")]) == 0
    assert main([*common, "--output-dir", str(tmp_path / "cl"), "--channels-last"]) == 0
    report = json.loads((tmp_path / "cl" / "tiny-seed3.json").read_text())
    assert report["options"] == ["channels-last"] and report["plugins"] == []
    assert json.loads((tmp_path / "plain" / "tiny-seed3.json").read_text())["options"] == []
    plain, cl = (np.asarray(Image.open(tmp_path / d / "tiny-seed3-0.png")).astype(int) for d in ("plain", "cl"))
    assert np.abs(plain - cl).max() <= 1


def test_torch_stage_gets_ready_once_per_shape(tiny, monkeypatch):
    """torch.compile's mode reaches it, and `prepare` (which the pipeline calls before every run) makes the
    first, compiling call once per input shape, outside any timed run (torch.compile stood in for here)."""
    from demo.backends.torch.stage import TorchStage

    modes, shapes = [], []

    def compile_stand_in(module, mode=None, dynamic=None):
        modes.append((mode, dynamic))

        def run(*inputs):
            shapes.append(tuple(t.shape for t in inputs))
            return module(*inputs)
        return run

    monkeypatch.setattr(torch, "compile", compile_stand_in)
    model = STAGE_MODELS["vae"](tiny)
    stage = TorchStage(model, CPU, torch.float32, TorchSettings(compile="max-autotune-no-cudagraphs"))
    assert modes == [("max-autotune-no-cudagraphs", False)]
    stage.prepare(1, 64, 48)
    stage.prepare(1, 64, 48)
    assert shapes == [((1, 4, 32, 24),)] and stage.prepare_seconds["first_calls"] > 0
    stage.prepare(2, 64, 48)
    assert shapes[-1] == ((2, 4, 32, 24),) and len(shapes) == 2
    output = stage(model.sample_inputs(2, 64, 48))["images"]
    assert output.shape == (2, 3, 64, 48) and len(shapes) == 3
    TorchStage(model, CPU, torch.float32, TorchSettings(compile="default"))
    assert modes[-1] == (None, False)  # "default" is torch.compile's own default mode
