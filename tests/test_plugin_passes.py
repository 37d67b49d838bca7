"""The plugin passes replace what the kernels can take, skip (and say why) what they cannot, and the
rewritten graphs compute what the exported ones do.

Rewritten graphs run in ONNX Runtime on the CPU, with the plugin nodes executed by float32 NumPy
reference implementations of the contract (onnxruntime-extensions Python custom ops); fp16 graphs run
as float32 copies. Expected counts come from the PyTorch modules, not from the graphs.
"""

import io
import json
from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

from core.errors import UsageError
from models import STAGE_MODELS
from models.controlnet import ControlNetStageModel, resolve_controlnet
from models.optimizer import GraphOptimizer, optimize_onnx_file
from models.plugin_passes import PLUGIN_PASSES, read_pass_report
from models.plugin_set import parse_plugin_set
from plugins.contract import OURS, PLUGIN_KEYS, TENSORRT, TRANSFORMER_KEYS, UNET_KEYS, convention
from plugins.tuned import PLUGINS_AUTO
from tests import background
from tests.plugin_references import (
    ada_layer_norm,
    fmha,
    fmhca,
    gelu_tanh,
    group_norm,
    layer_norm,
    rms_norm,
    seq2spatial,
    split_gelu,
)
from tests.sd15_unet import load as load_sd15_unet
from tests.sd15_unet import unet_model

ALL = tuple(sorted(PLUGIN_KEYS))
# The plugin-node contract of either convention (tests/test_contract.py checks it against the C++ creators).
CONTRACT, TENSORRT_CONTRACT = convention(OURS), convention(TENSORRT)
PLUGIN_OPS, TENSORRT_OPS = CONTRACT.ops, TENSORRT_CONTRACT.ops
# Python custom ops have a fixed input count: the 3-input form of Seq2Spatial runs under its own name.
SEQ2SPATIAL_3 = PLUGIN_OPS["Seq2Spatial"] + "3"
SKIP_REASON = "is not a multiple of 8 up to 256"


# ---- float32 references of the plugin-node contract (tests/plugin_references.py), run by ONNX Runtime ----

def _register(op_type, reference, inputs, domain=CONTRACT.domain, **attrs):
    """Registers `reference` (float64 NumPy) as ORT's float32 kernel of domain::op_type."""
    contract = {"plugin_version": PyCustomOpDef.dt_string, "plugin_namespace": PyCustomOpDef.dt_string}

    def run(*arrays, **values):
        values = {k: v for k, v in values.items() if k not in contract}
        return np.ascontiguousarray(reference(*(a.astype(np.float64) for a in arrays), **values), dtype=np.float32)

    onnx_op(op_type=f"{domain}::{op_type}", inputs=[PyCustomOpDef.dt_float] * inputs,
            outputs=[PyCustomOpDef.dt_float], attrs={**attrs, **contract})(run)


_FLOAT, _INT = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64
_register(PLUGIN_OPS["fMHA"], fmha, 1, scale=_FLOAT)
_register(PLUGIN_OPS["fMHCA"], fmhca, 2, scale=_FLOAT)
_register(PLUGIN_OPS["GroupNorm"], group_norm, 3, num_groups=_INT, epsilon=_FLOAT, silu=_INT)
_register(PLUGIN_OPS["LayerNorm"], layer_norm, 3, epsilon=_FLOAT)
_register(PLUGIN_OPS["SplitGeLU"], split_gelu, 2)
_register(PLUGIN_OPS["Seq2Spatial"], seq2spatial, 4, residual_layout=_INT)
_register(PLUGIN_OPS["RMSNorm"], rms_norm, 2, epsilon=_FLOAT)
_register(PLUGIN_OPS["AdaLayerNorm"], ada_layer_norm, 3, epsilon=_FLOAT)
_register(PLUGIN_OPS["GeLU"], gelu_tanh, 2)
# The 3-input form (NCHW residual, which also gives H and W).
_register(SEQ2SPATIAL_3, lambda x, bias, residual, residual_layout: seq2spatial(x, bias, residual, residual,
                                                                                   residual_layout),
          3, residual_layout=_INT)


# TensorRT's own plugins (libnvinfer_plugin 8.5/8.6), in their conventions: a fixed attention scale
# of 1/sqrt(D), 32 groups, the bias added before SplitGeLU, the output shape from SeqLen2Spatial's 4th input.
TRT = TENSORRT_CONTRACT.domain
_register(TENSORRT_OPS["fMHA"], lambda qkv: fmha(qkv, qkv.shape[-1] ** -0.5), 1, TRT)
_register(TENSORRT_OPS["fMHCA"], lambda q, kv: fmhca(q, kv, q.shape[-1] ** -0.5), 2, TRT)
_register(TENSORRT_OPS["GroupNorm"], lambda x, g, b, epsilon, bSwish: group_norm(x, g, b, 32, epsilon, bSwish), 3, TRT,
          epsilon=_FLOAT, bSwish=_INT)
_register(TENSORRT_OPS["LayerNorm"], lambda x, g, b, epsilon, axis: layer_norm(x, g, b, epsilon), 3, TRT,
          epsilon=_FLOAT, axis=_INT)
_register(TENSORRT_OPS["SplitGeLU"], lambda x: split_gelu(x, 0), 1, TRT)
_register(TENSORRT_OPS["Seq2Spatial"], lambda x, b, r, s: seq2spatial(x, b, r, s, 1), 4, TRT)


def _runnable(model: onnx.ModelProto) -> bool:
    """Whether ORT runs the model as it is: no fp16 (ORT's CPU lacks most fp16 kernels) and no 3-input
    Seq2Spatial (Python custom ops have a fixed input count; that form runs under its own name)."""
    graph = model.graph
    fp16 = any(t.data_type == TensorProto.FLOAT16 for t in graph.initializer) or \
        any(v.type.tensor_type.elem_type == TensorProto.FLOAT16 for v in [*graph.input, *graph.value_info])
    return not fp16 and not any(n.op_type == PLUGIN_OPS["Seq2Spatial"] and len(n.input) == 3 for n in graph.node)


def _runnable_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every fp16 tensor, type and cast made float32, and 3-input Seq2Spatial renamed."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph

    def widen(tensor):
        if tensor.data_type == TensorProto.FLOAT16:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))

    for tensor in graph.initializer:
        widen(tensor)
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                widen(attr.t)
            elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.FLOAT
        if node.op_type == PLUGIN_OPS["Seq2Spatial"] and len(node.input) == 3:
            node.op_type = SEQ2SPATIAL_3
    return model


def run_onnx(model: onnx.ModelProto | str, inputs: dict[str, np.ndarray], every_output: bool = False):
    """The first output (or, with `every_output`, all of them), in float32, of a model or a model file (run from
    the file where it can be)."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    source = model
    if not isinstance(model, onnx.ModelProto):
        source = str(model)
        model = onnx.load(source, load_external_data=False)
    if isinstance(source, onnx.ModelProto) or not _runnable(model):
        source = _runnable_copy(onnx.load(source) if isinstance(source, str) else model).SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    feeds = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in inputs.items()}
    outputs = session.run(None, feeds)
    return outputs if every_output else outputs[0]


def test_references_follow_the_contract():
    """The references themselves, against PyTorch's own ops on random data."""
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((2, 5, 3, 3, 8))
    expected = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(qkv[..., i, :]).transpose(1, 2)
                                                                  for i in range(3)), scale=0.3)
    np.testing.assert_allclose(fmha(qkv, 0.3), expected.transpose(1, 2).numpy(), atol=1e-12)
    x, gamma, beta = rng.standard_normal((2, 6, 3, 4)), rng.standard_normal(6), rng.standard_normal(6)
    expected = torch.nn.functional.silu(torch.nn.functional.group_norm(torch.tensor(x), 3, torch.tensor(gamma),
                                                                       torch.tensor(beta), 1e-3))
    np.testing.assert_allclose(group_norm(x, gamma, beta, 3, 1e-3, 1), expected.numpy(), atol=1e-12)
    h = rng.standard_normal((2, 3, 8))
    value, gate = torch.tensor(h).chunk(2, -1)
    np.testing.assert_allclose(split_gelu(h, 0), (value * torch.nn.functional.gelu(gate)).numpy(), atol=1e-12)


# ---- what the passes must find, from the PyTorch modules ------------------------------------------

def _network(stage: str, module: torch.nn.Module) -> torch.nn.Module:
    """The part of a stage's module that its ONNX graph computes."""
    return {"clip": lambda m: m.text_encoder, "clip2": lambda m: m.text_encoder, "unet": lambda m: m.unet,
            "vae": lambda m: m.vae.decoder, "vae_encoder": lambda m: m.vae.encoder}[stage](module)


def expected_passes(network: torch.nn.Module, unused: tuple[str, ...] = ()) -> dict:
    """Per plugin, how many matches the kernels take and how many they cannot (attention head sizes
    must be multiples of 8 up to 256), plus how many GroupNorms are followed by SiLU; modules whose names start
    with one of `unused` compute nothing the graph returns, so the export has none of them."""
    from diffusers.models.activations import GEGLU
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    modules = [(name, m) for name, m in network.named_modules() if not (unused and name.startswith(unused))]

    def count(kind):
        return sum(isinstance(m, kind) for _, m in modules)

    attention = [m for _, m in modules if isinstance(m, Attention)]

    def fits(a):
        return (a.inner_dim // a.heads) % 8 == 0 and a.inner_dim // a.heads <= 256

    def attention_counts(cross):
        chosen = [a for a in attention if a.is_cross_attention == cross]
        return {"replaced": sum(map(fits, chosen)), "skipped": sum(not fits(a) for a in chosen)}

    counts = {key: {"replaced": 0, "skipped": 0} for key in PLUGIN_KEYS}
    counts["fMHA"], counts["fMHCA"] = attention_counts(False), attention_counts(True)
    for key, kind in (("GroupNorm", torch.nn.GroupNorm), ("LayerNorm", torch.nn.LayerNorm), ("SplitGeLU", GEGLU),
                      ("Seq2Spatial", Transformer2DModel)):
        counts[key]["replaced"] = count(kind)
    silu = 2 * count(ResnetBlock2D) + sum(name.endswith("conv_norm_out") for name, _ in modules)
    return {"counts": counts, "silu": silu}


def plugin_nodes(path) -> dict[str, list[onnx.NodeProto]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return {key: [n for n in graph.node if n.op_type == op] for key, op in PLUGIN_OPS.items()}


def attribute(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def check_passes(optimized, expected) -> dict[str, list[onnx.NodeProto]]:
    """The pass report and the plugin nodes in the graph, against `expected`; returns the nodes."""
    report = read_pass_report(optimized)
    assert {k: {"replaced": v["replaced"], "skipped": v["skipped"]} for k, v in report.items()} == expected["counts"]
    nodes = plugin_nodes(optimized)
    for key in PLUGIN_KEYS:
        assert len(nodes[key]) == report[key]["replaced"]
        for node in nodes[key]:
            assert node.domain == CONTRACT.domain
            assert (attribute(node, "plugin_version"), attribute(node, "plugin_namespace")) == \
                (CONTRACT.version.encode(), CONTRACT.namespace.encode())
    assert sum(attribute(n, "silu") for n in nodes["GroupNorm"]) == expected["silu"]
    return nodes


def assert_same_outputs(exported, rewritten, inputs, tolerance=1e-4):
    references, actuals = run_onnx(exported, inputs, every_output=True), run_onnx(rewritten, inputs, every_output=True)
    assert len(actuals) == len(references)
    for actual, reference in zip(actuals, references):
        assert actual.shape == reference.shape
        assert np.abs(actual - reference).max() <= tolerance * np.abs(reference).max()


def check_stage(model, stage_dir, expected, inputs, tolerance=1e-4):
    """The passes against `expected`, and the rewritten graph's output against the export's."""
    optimized = model.optimized_onnx_path(stage_dir)
    check_passes(optimized, expected)
    assert_same_outputs(stage_dir / f"{model.artifact_name}.onnx", optimized, inputs, tolerance)


def sample(model, batch, height, width, dtype=torch.float32, seed=5):
    inputs = model.sample_inputs(batch, height, width, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    return {k: v.numpy() for k, v in inputs.items()}


def prepare(model, onnx_dir, dtype=torch.float32, plugins=ALL):
    return model.prepare_onnx(onnx_dir, "cpu", dtype, log=lambda *_: None, plugins=plugins)


# ---- tiny: all stages, fp32 and fp16 ---------------------------------------------------------------

TINY_STAGES = ("clip", "unet", "vae", "vae_encoder")


@pytest.fixture(scope="module")
def tiny_expected(tiny):
    return {stage: expected_passes(_network(stage, STAGE_MODELS[stage](tiny).load_module())) for stage in TINY_STAGES}


@pytest.fixture(scope="module")
def tiny_fp32(tiny, tmp_path_factory):
    onnx_dir = tmp_path_factory.mktemp("tiny32")
    for stage in TINY_STAGES:
        prepare(STAGE_MODELS[stage](tiny), onnx_dir)
    return onnx_dir


@pytest.mark.parametrize("stage", TINY_STAGES)
def test_tiny_rewrites_every_pattern_and_computes_the_same(stage, tiny, tiny_fp32, tiny_expected):
    model = STAGE_MODELS[stage](tiny)
    # Another batch and size than the export's: the rewritten graph stays dynamic.
    check_stage(model, tiny_fp32, tiny_expected[stage], sample(model, 3, 48, 80))


def test_tiny_unet_has_every_plugin(tiny_fp32, tiny_expected):
    counts = tiny_expected["unet"]["counts"]
    assert all(counts[key]["replaced"] > 0 for key in UNET_KEYS)
    nodes = plugin_nodes(tiny_fp32 / "unet.opt.onnx")
    # tiny's transformers project with 1x1 convolutions (SD 1.x): the residual is a sequence.
    assert {attribute(n, "residual_layout") for n in nodes["Seq2Spatial"]} == {1}
    graph = onnx.load(str(tiny_fp32 / "unet.opt.onnx")).graph
    assert not {"Softmax", "InstanceNormalization", "LayerNormalization", "Erf"} & {n.op_type for n in graph.node}


def test_shapes_unet_has_every_plugin_and_computes_the_same(tmp_path):
    """The trained built-in carries every pattern the passes rewrite, so every plugin runs on the model whose images
    sd-quality reads."""
    from models.source import resolve_model

    model = STAGE_MODELS["unet"](resolve_model("shapes"))
    expected = expected_passes(_network("unet", model.load_module()))
    assert all(expected["counts"][key]["replaced"] > 0 for key in UNET_KEYS)
    prepare(model, tmp_path)
    check_stage(model, tmp_path, expected, sample(model, 2, 128, 96))


# ---- tiny-xl: SDXL's stages (two text encoders, added conditions, linear projections, 2-layer blocks) -------

XL_STAGES = ("clip", "clip2", "unet", "vae")


@pytest.fixture(scope="module")
def tiny_xl_fp32(tmp_path_factory):
    from models.source import resolve_model

    source = resolve_model("tiny-xl")
    onnx_dir = tmp_path_factory.mktemp("tinyxl32")
    for stage in XL_STAGES:
        prepare(STAGE_MODELS[stage](source), onnx_dir)
    return source, onnx_dir


@pytest.mark.parametrize("stage", XL_STAGES)
def test_tiny_xl_rewrites_every_pattern_and_computes_the_same(stage, tiny_xl_fp32):
    """Counts from the module types, and every output of the rewritten graph (clip2's pooled embeddings too)
    against the export's, on the CPU reference ops."""
    source, onnx_dir = tiny_xl_fp32
    model = STAGE_MODELS[stage](source)
    # The first encoder gives its penultimate layer's states: its last layer and final norm are not exported.
    last = model.config["num_hidden_layers"] - 1 if stage == "clip" else None
    unused = (f"encoder.layers.{last}.", "final_layer_norm") if stage == "clip" else ()
    expected = expected_passes(_network(stage, model.load_module()), unused)
    check_stage(model, onnx_dir, expected, sample(model, 3, 48, 80))
    if stage == "unet":  # every family, the two-layer blocks' attention, norms and GEGLU included
        counts = expected["counts"]
        assert all(counts[key]["replaced"] > 0 and counts[key]["skipped"] == 0 for key in UNET_KEYS)
        assert counts["fMHA"]["replaced"] == counts["fMHCA"]["replaced"] == 2 * counts["Seq2Spatial"]["replaced"]
        nodes = plugin_nodes(onnx_dir / "unet.opt.onnx")
        # Linear projections (SDXL): proj_out is a matmul on the sequence, the residual is NCHW.
        assert {attribute(n, "residual_layout") for n in nodes["Seq2Spatial"]} == {0}


@pytest.fixture(scope="module")
def tiny_unet_base(tiny_fp32):
    """tiny's UNet after the base passes only."""
    return GraphOptimizer(onnx.load(str(tiny_fp32 / "unet.onnx")), "unet").run()


def test_the_optimizer_runs_exactly_the_passes_it_is_given(tiny_fp32):
    """run([]) runs no pass (not the base passes); run() and run(None) run the base passes."""
    exported = onnx.load(str(tiny_fp32 / "unet.onnx"))
    nothing = GraphOptimizer(exported, "unet")
    unchanged = nothing.run([])
    assert nothing.history == [("exported", len(exported.graph.node))]
    assert len(unchanged.graph.node) == len(exported.graph.node)
    for passes in ((), (None,)):
        optimizer = GraphOptimizer(exported, "unet")
        optimizer.run(*passes)
        assert [name for name, _ in optimizer.history] == ["exported", "cleanup", "fold-constants", "cleanup"]
    # A plugin set with nothing selected adds no pass either.
    optimizer = GraphOptimizer(exported, "unet")
    assert optimizer.plugin_passes(()) == []
    optimizer.run(optimizer.plugin_passes(()))
    assert optimizer.history == [("exported", len(exported.graph.node))]


@pytest.mark.parametrize("key", UNET_KEYS)
def test_each_pass_works_alone(key, tiny, tiny_fp32, tiny_unet_base, tiny_expected):
    """The ablation enables plugins one at a time: no pass may rely on another having run."""
    model = STAGE_MODELS["unet"](tiny)
    optimizer = GraphOptimizer(tiny_unet_base, "unet")
    rewritten = optimizer.run(optimizer.plugin_passes((key,)))
    assert optimizer.plugin_report[key]["replaced"] == tiny_expected["unet"]["counts"][key]["replaced"]
    assert all(optimizer.plugin_report[other]["replaced"] == 0 for other in PLUGIN_KEYS if other != key)
    assert [name for name, _ in optimizer.history] == ["exported", key, "cleanup"]
    inputs = sample(model, 2, 32, 32)
    exported = run_onnx(tiny_fp32 / "unet.onnx", inputs)
    assert np.abs(run_onnx(rewritten, inputs) - exported).max() <= 1e-4 * np.abs(exported).max()


@pytest.mark.parametrize("stage", ("clip", "unet", "vae"))
def test_tiny_fp16_exports(stage, tiny, tiny_expected, tmp_path_factory):
    model = STAGE_MODELS[stage](tiny)
    onnx_dir = tmp_path_factory.mktemp(f"tiny16-{stage}")
    optimized = prepare(model, onnx_dir, torch.float16)
    graph = gs.import_onnx(onnx.load(str(optimized)))
    plugin_inputs = [t for n in graph.nodes if n.domain == CONTRACT.domain for t in n.inputs]
    fused = [t for n in graph.nodes if n.op == "MatMul" and ("/qkv/" in n.name or "/kv/" in n.name) for t in n.inputs]
    constants = [t for t in plugin_inputs + fused if isinstance(t, gs.Constant)]
    assert constants and all(t.values.dtype == np.float16 for t in constants)
    assert all(t.dtype == np.float16 for n in graph.nodes if n.domain == CONTRACT.domain for t in n.outputs)
    check_stage(model, onnx_dir, tiny_expected[stage], sample(model, 2, 48, 80, torch.float16), tolerance=1e-3)


# ---- a model the passes never saw: other head counts, linear projections, two layers per block ----

# Heads per block 4, 4, 1 over 32, 48 and 320 channels: head sizes 8 (taken), 12 and 320 (not: the
# kernels need a multiple of 8 up to 256).
CUSTOM_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [32, 48, 320],
    "layers_per_block": 1,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 32,
    "attention_head_dim": [4, 4, 1],
    "norm_num_groups": 8,
    "norm_eps": 1e-3,
    "use_linear_projection": True,
    "transformer_layers_per_block": 2,
}


def test_a_controlnet_gets_every_pattern_it_has_rewritten_and_computes_the_same(tiny, tmp_path):
    """A ControlNet stage's graph goes through the same passes as the UNet's: tiny-controlnet (tiny's down path, mid
    block and conditioning embedding) has every pattern, each replaced, and the residuals stay what they were."""
    model = ControlNetStageModel(tiny, resolve_controlnet("tiny-controlnet"), 0)
    expected = expected_passes(model.load_module().controlnet)
    assert all(expected["counts"][key]["replaced"] > 0 for key in UNET_KEYS)
    prepare(model, tmp_path)
    check_stage(model, tmp_path, expected, sample(model, 2, 48, 80))


def test_other_head_counts_and_linear_projections(tiny, tmp_path):
    model = unet_model(tiny, tmp_path / "custom", CUSTOM_UNET, seed=1)
    network = model.load_module().unet
    expected = expected_passes(network)
    assert expected["counts"]["fMHA"] == {"replaced": 6, "skipped": 8}  # the config does what it says
    prepare(model, tmp_path)
    check_stage(model, tmp_path, expected, sample(model, 2, 32, 16))
    report = read_pass_report(model.optimized_onnx_path(tmp_path))
    for key in ("fMHA", "fMHCA"):
        reasons = report[key]["skipped_reasons"]
        assert sum(f"head size 12 {SKIP_REASON}" in r for r in reasons) == 6
        assert sum(f"head size 320 {SKIP_REASON}" in r for r in reasons) == 2
    nodes = plugin_nodes(model.optimized_onnx_path(tmp_path))
    # Linear proj_out (SD 2.x): the residual is the block's NCHW input.
    assert {attribute(n, "residual_layout") for n in nodes["Seq2Spatial"]} == {0}
    assert {len(n.input) for n in nodes["Seq2Spatial"]} == {3}
    assert {round(attribute(n, "epsilon"), 9) for n in nodes["GroupNorm"]} == \
        {round(m.eps, 9) for m in network.modules() if isinstance(m, torch.nn.GroupNorm)} == {1e-3, 1e-6}
    # Attention scale 1/sqrt(head size), read from the graph's scaling of q and k.
    assert {round(attribute(n, "scale"), 6) for n in nodes["fMHA"]} == {round(8 ** -0.5, 6)}


# ---- forms the built-in exports do not produce ------------------------------------------------------

class _OtherForms(torch.nn.Module):
    """LayerNorm written out, attention with biased projections that scales the scores once (by a Div),
    GEGLU through torch.split (an ONNX Split; F.gelu is Erf below opset 20, Gelu from it), and
    GroupNorm + SiLU over [B, C, S]."""

    def __init__(self, width=32, heads=2):
        super().__init__()
        self.heads = heads
        self.gamma, self.beta = torch.nn.Parameter(torch.randn(width)), torch.nn.Parameter(torch.randn(width))
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))
        self.proj = torch.nn.Linear(width, 4 * width)
        self.norm = torch.nn.GroupNorm(4, 2 * width, eps=1e-4)

    def forward(self, x):
        centered = x - x.mean(-1, keepdim=True)
        y = centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gamma + self.beta
        b, s, c = y.shape
        size = c // self.heads
        q = self.q(y).view(b, s, self.heads, size).transpose(1, 2)
        k = self.k(y).view(b, s, self.heads, size).permute(0, 2, 3, 1)
        v = self.v(y).view(b, s, self.heads, size).transpose(1, 2)
        probs = torch.softmax(torch.matmul(q, k) / size ** 0.5, dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, c)
        value, gate = torch.split(self.proj(y), [2 * c, 2 * c], dim=-1)
        y = value * torch.nn.functional.gelu(gate)
        return torch.nn.functional.silu(self.norm(y.transpose(1, 2)))


@pytest.mark.parametrize("opset", (17, 20))
def test_other_exported_forms(opset, tmp_path):
    torch.manual_seed(2)
    module = _OtherForms().eval()
    raw = tmp_path / "forms.onnx"
    with torch.no_grad():
        torch.onnx.export(module, (torch.randn(2, 6, 32),), str(raw), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "B", 1: "S"}, "y": {0: "B", 2: "S"}}, opset_version=opset,
                          dynamo=False)
    assert ("Gelu" in {n.op_type for n in onnx.load(str(raw)).graph.node}) == (opset >= 20)
    optimized = tmp_path / "forms.opt.onnx"
    optimize_onnx_file(raw, optimized, "forms", lambda *_: None, ALL)
    report = read_pass_report(optimized)
    assert {k: v["replaced"] for k, v in report.items()} == {"fMHA": 1, "fMHCA": 0, "GroupNorm": 1, "LayerNorm": 1,
                                                             "SplitGeLU": 1, "Seq2Spatial": 0, "RMSNorm": 0,
                                                             "AdaLayerNorm": 0, "GeLU": 0}
    assert [attribute(n, "silu") for n in plugin_nodes(optimized)["GroupNorm"]] == [1]
    x = np.random.default_rng(3).standard_normal((3, 10, 32)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    assert np.abs(run_onnx(optimized, {"x": x}) - expected).max() <= 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("opset, affine_size, normalized_is_output", ((18, 4, False), (21, 16, False), (21, 16, True)))
def test_native_group_normalization(opset, affine_size, normalized_is_output, tmp_path):
    """GroupNormalization: scale and bias per group before opset 21, per channel from it. The SiLU is
    fused only where nothing else reads the normalized tensor."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("GroupNormalization", ["x", "scale", "bias"], ["normalized"], num_groups=4, epsilon=1e-2),
             helper.make_node("Sigmoid", ["normalized"], ["sigmoid"]),
             helper.make_node("Mul", ["normalized", "sigmoid"], ["y"])]
    outputs = ["y", "normalized"] if normalized_is_output else ["y"]
    graph = helper.make_graph(nodes, "native",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16, "H", "W"])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", 16, "H", "W"])
                               for name in outputs],
                              [numpy_helper.from_array(rng.standard_normal(affine_size).astype(np.float32), name)
                               for name in ("scale", "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    raw = tmp_path / "native.onnx"
    onnx.save(model, str(raw))
    optimized = tmp_path / "native.opt.onnx"
    optimize_onnx_file(raw, optimized, "native", lambda *_: None, ("GroupNorm",))
    (node,) = plugin_nodes(optimized)["GroupNorm"]
    assert (attribute(node, "num_groups"), attribute(node, "silu")) == (4, int(not normalized_is_output))
    assert attribute(node, "epsilon") == pytest.approx(1e-2)
    assert ("Sigmoid" in {n.op_type for n in onnx.load(str(optimized)).graph.node}) == normalized_is_output
    x = {"x": rng.standard_normal((2, 16, 3, 5)).astype(np.float32)}
    expected = run_onnx(model, x)
    assert np.abs(run_onnx(optimized, x) - expected).max() <= 1e-5 * np.abs(expected).max()


# ---- the plugin set, the artifact and the CLI --------------------------------------------------------

def test_plugin_set_parsing(tmp_path, monkeypatch):
    assert parse_plugin_set("none") == ()
    assert parse_plugin_set("all") == ALL == ("AdaLayerNorm", "GeLU", "GroupNorm", "LayerNorm", "RMSNorm",
                                              "Seq2Spatial", "SplitGeLU", "fMHA", "fMHCA")
    assert parse_plugin_set("fMHCA,LayerNorm,fMHCA") == ("LayerNorm", "fMHCA")
    for bad in ("fmha", "LayerNorm,Softmax", "", ","):
        with pytest.raises(UsageError, match="fMHA, fMHCA, GroupNorm, LayerNorm, SplitGeLU, Seq2Spatial"):
            parse_plugin_set(bad)

    table = tmp_path / "tuned_defaults.json"
    table.write_text(json.dumps({PLUGINS_AUTO: {"9.0": {"plugins": ["fMHA", "GroupNorm"], "gpu": "NVIDIA H200",
                                                        "date": "2026-01-01", "source": "results/ablation.json"}}}))
    assert parse_plugin_set("auto", "9.0", table) == ("GroupNorm", "fMHA")
    assert parse_plugin_set("auto", "8.6", table) == ()  # no entry: none
    assert parse_plugin_set("auto", "9.0", tmp_path / "missing.json") == ()
    monkeypatch.setattr("models.plugin_set.local_compute_capability", lambda: "9.0")
    assert parse_plugin_set("auto", table=table) == ("GroupNorm", "fMHA")
    monkeypatch.setattr("models.plugin_set.local_compute_capability", lambda: None)
    assert parse_plugin_set("auto", table=table) == ()  # no GPU: none
    table.write_text(json.dumps({PLUGINS_AUTO: {"9.0": {"plugins": ["fMHA_V2"]}}}))
    with pytest.raises(UsageError, match="tuned_defaults.json: \"plugins_auto\" entry '9.0' needs \"plugins\""):
        parse_plugin_set("auto", "9.0", table)


def test_the_pass_report_belongs_to_the_cached_artifact(tiny, tmp_path):
    from core.artifacts import read_manifest

    model = STAGE_MODELS["vae"](tiny)
    logs = []
    optimized = model.prepare_onnx(tmp_path, "cpu", torch.float32, log=logs.append, plugins=("GroupNorm",))
    report_file = optimized.with_name("vae.opt.onnx.passes.json")
    assert set(read_manifest(optimized)["files"]) == {"vae.opt.onnx", report_file.name}
    assert read_manifest(optimized)["key"]["plugins"] == ["GroupNorm"]
    report = read_pass_report(optimized)
    assert report["GroupNorm"]["replaced"] > 0 and report["fMHA"]["replaced"] == 0  # fMHA was not asked for

    logs.clear()
    model.prepare_onnx(tmp_path, "cpu", torch.float32, log=logs.append, plugins=ALL)
    assert any("vae.opt.onnx: building (stale (plugins changed))" in line for line in logs)
    assert read_pass_report(optimized)["fMHA"]["replaced"] == 1

    # The report is content-checked with the artifact: a damaged one rebuilds it.
    text = report_file.read_text()
    report_file.write_text(text.replace('"replaced": 1', '"replaced": 7', 1))
    logs.clear()
    model.prepare_onnx(tmp_path, "cpu", torch.float32, log=logs.append, plugins=ALL)
    assert any("vae.opt.onnx: building" in line for line in logs)
    assert report_file.read_text() == text


def test_export_script_reports_the_passes(tiny, tiny_fp32, tiny_expected, tmp_path, capsys):
    from demo.cli.export_onnx import main

    report_json = tmp_path / "passes.json"
    assert main(["--model", "tiny", "--onnx-dir", str(tiny_fp32), "--stages", ",".join(TINY_STAGES),
                 "--plugins", "all", "--report-json", str(report_json)]) == 0
    written = json.loads(report_json.read_text())
    assert written == {stage: tiny_expected[stage]["counts"] for stage in TINY_STAGES}
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plugins]")]
    assert lines == [f"[plugins] {stage}: " + ", ".join(f"{key} {counts['replaced']}" for key, counts in
                                                           written[stage].items()) for stage in TINY_STAGES]

    bad = tmp_path / "bad.json"
    assert main(["--model", "tiny", "--onnx-dir", str(tmp_path / "onnx"), "--plugins", "fMHA,GEGLU",
                 "--report-json", str(bad)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "unknown plugin(s) GEGLU" in error
    assert not bad.exists() and not (tmp_path / "onnx").exists()


# ---- Stable Diffusion 1.5's UNet -------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd15_unet():
    """sd1.5-arch's UNet exported in fp16 and optimized with every plugin (tests/sd15_unet.py), made beside the
    tests before this module's (tests/background.py)."""
    directory = background.result("sd15_unet")
    return load_sd15_unet(directory / "sd1.5-arch-unet"), directory / "onnx"


def _onnx_scope(module_name: str) -> str:
    """The node-name prefix the exporter gives a UNet submodule: down_blocks.0.attentions.1 ->
    /unet/down_blocks.0/attentions.1/."""
    parts: list[str] = []
    for part in module_name.split("."):
        if part.isdigit():
            parts[-1] += f".{part}"
        else:
            parts.append(part)
    return "/unet/" + "/".join(parts) + "/"


# The first down block, from conv_in's output and the time embedding to its last transformer's output.
SD15_CUT = (["/unet/conv_in/Conv_output_0", "/unet/time_embedding/linear_2/Gemm_output_0", "encoder_hidden_states"],
            ["/unet/down_blocks.0/attentions.1/Add_output_0"])


def _cut_out(path, inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    """The part of an fp16 model between the named tensors."""
    graph = gs.import_onnx(onnx.load(str(path)))
    tensors = graph.tensors()
    for name in inputs:
        tensors[name].inputs.clear()
        tensors[name].dtype = np.float16
    graph.inputs, graph.outputs = [tensors[n] for n in inputs], [tensors[n] for n in outputs]
    for tensor in graph.outputs:
        tensor.dtype = np.float16
    return gs.export_onnx(graph.cleanup())


def test_sd15_unet(sd15_unet):
    from diffusers import UNet2DConditionModel
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    from models.builtin import BUILTIN_MODELS

    model, onnx_dir = sd15_unet
    with torch.device("meta"):
        network = UNet2DConditionModel(**BUILTIN_MODELS["sd1.5-arch"]["unet"])
    expected = expected_passes(network)
    assert {key: counts["replaced"] for key, counts in expected["counts"].items()} == {
        "fMHA": 16, "fMHCA": 16, "GroupNorm": 61, "LayerNorm": 48, "SplitGeLU": 16, "Seq2Spatial": 16, "RMSNorm": 0,
        "AdaLayerNorm": 0, "GeLU": 0}
    optimized = model.optimized_onnx_path(onnx_dir)
    nodes = check_passes(optimized, expected)
    # Each of the 16 transformers got its plugins, and nothing else did.
    scopes = [_onnx_scope(name) for name, module in network.named_modules() if isinstance(module, Transformer2DModel)]
    for key, per_transformer in (("fMHA", 1), ("fMHCA", 1), ("LayerNorm", 3), ("SplitGeLU", 1), ("Seq2Spatial", 1)):
        owners = Counter(next(scope for scope in scopes if node.name.startswith(scope)) for node in nodes[key])
        assert owners == {scope: per_transformer for scope in scopes}, key

    # A full CPU run of both 1.7 GB graphs costs more than CI can spend: compare the first down block.
    exported, rewritten = (_cut_out(path, *SD15_CUT) for path in (onnx_dir / "unet.onnx", optimized))
    assert {n.op_type for n in rewritten.graph.node} >= {PLUGIN_OPS[key] for key in UNET_KEYS}
    rng = np.random.default_rng(6)
    inputs = {"/unet/conv_in/Conv_output_0": rng.standard_normal((1, 320, 16, 8)),
              "/unet/time_embedding/linear_2/Gemm_output_0": rng.standard_normal((1, 1280)),
              "encoder_hidden_states": rng.standard_normal((1, 77, 768))}
    assert_same_outputs(exported, rewritten, {k: v.astype(np.float16) for k, v in inputs.items()}, 1e-3)


# ---- TensorRT's own plugins, emitted by the same passes ----------------------------------------------

# A UNet with shapes TensorRT's kernels take: 32 groups over 320 and 640 channels, head size 40, GEGLU
# half width 1280 (SD 1.5's first block).
TENSORRT_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [320],
    "layers_per_block": 1,
    "down_block_types": ["CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D"],
    "cross_attention_dim": 32,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
}


def tensorrt_nodes(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    return {key: [n for n in model.graph.node if n.op_type == op and n.domain == TRT]
            for key, op in TENSORRT_OPS.items()}


def test_tensorrt_convention(tiny, tmp_path):
    model = unet_model(tiny, tmp_path / "tensorrt-shapes", TENSORRT_UNET, seed=4)
    expected = expected_passes(model.load_module().unet)
    # TensorRT's GroupNorm runs fp16 only.
    optimized = model.prepare_onnx(tmp_path, "cpu", torch.float16, log=lambda *_: None, plugins=ALL,
                                   plugin_convention=TENSORRT)
    report = read_pass_report(optimized)
    assert {k: {"replaced": v["replaced"], "skipped": v["skipped"]} for k, v in report.items()} == expected["counts"]
    assert all(report[key]["replaced"] > 0 for key in UNET_KEYS)
    rewritten = onnx.load(str(optimized))
    nodes = tensorrt_nodes(rewritten)
    assert {key: len(nodes[key]) for key in UNET_KEYS} == {k: report[k]["replaced"] for k in UNET_KEYS}
    assert not any(n.domain == CONTRACT.domain for n in rewritten.graph.node)
    for node in (n for group in nodes.values() for n in group):
        assert (attribute(node, "plugin_version"), attribute(node, "plugin_namespace")) == \
            (TENSORRT_CONTRACT.version.encode(), TENSORRT_CONTRACT.namespace.encode())
    assert sum(attribute(n, "bSwish") for n in nodes["GroupNorm"]) == expected["silu"]
    assert {a.name for n in nodes["fMHA"] + nodes["fMHCA"] for a in n.attribute} == {"plugin_version",
                                                                                     "plugin_namespace"}
    assert {attribute(n, "axis") for n in nodes["LayerNorm"]} == {-1}
    initializers = {t.name: t for t in rewritten.graph.initializer}
    assert {initializers[n.input[1]].data_type for n in nodes["GroupNorm"]} == {TensorProto.FLOAT}
    assert_same_outputs(tmp_path / "unet.onnx", rewritten, sample(model, 2, 32, 16, torch.float16), 1e-3)


def test_tensorrt_convention_skips_what_its_kernels_cannot_take(tiny, tiny_unet_base, tiny_expected):
    optimizer = GraphOptimizer(tiny_unet_base, "unet")
    rewritten = optimizer.run(optimizer.plugin_passes(ALL, TENSORRT))
    report, counts = optimizer.plugin_report, tiny_expected["unet"]["counts"]

    def reasons(key):
        return {r.split(": ", 1)[1] for r in report[key]["skipped_reasons"]}

    # tiny's head size 8, fp32 GroupNorms in 8 groups and GEGLU half width 256 are not TensorRT's shapes.
    assert reasons("fMHA") == {"TensorRT's fMHA_V2 has no kernel for head size 8"}
    assert reasons("GroupNorm") == {"TensorRT's GroupNorm takes fp16 only"}
    assert reasons("SplitGeLU") == {"TensorRT's SplitGeLU takes [B, S, 2N] with N in (1280, 2560, 5120), not N = 256"}
    for key in ("fMHA", "GroupNorm", "SplitGeLU"):
        assert (report[key]["replaced"], report[key]["skipped"]) == (0, counts[key]["replaced"])
    for key in ("fMHCA", "LayerNorm", "Seq2Spatial"):
        assert (report[key]["replaced"], report[key]["skipped"]) == (counts[key]["replaced"], 0)
    assert_same_outputs(tiny_unet_base, rewritten, sample(STAGE_MODELS["unet"](tiny), 2, 32, 32))


# ---- SD3's and Flux's transformers: joint attention, Q/K RMSNorm, modulated LayerNorm, GELU-tanh ---------------

def expected_transformer_passes(network: torch.nn.Module) -> dict:
    """Per plugin, what the passes must take in a transformer's graph, from its modules: each joint attention (head
    size 8), each RMSNorm and GELU-tanh, each modulation of a LayerNorm (MMDiT-X's norm1 two, the norm2s the blocks
    modulate inline one each); no LayerNorm is left for the LayerNorm pass."""
    from diffusers.models import normalization as norms
    from diffusers.models.activations import GELU
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxTransformerBlock

    modules = list(network.modules())
    modulations = {norms.AdaLayerNormZero: 1, norms.SD35AdaLayerNormZeroX: 2, norms.AdaLayerNormZeroSingle: 1,
                   norms.AdaLayerNormContinuous: 1}
    inline = sum(getattr(m, name, None) is not None for m in modules
                 if type(m) in (JointTransformerBlock, FluxTransformerBlock) for name in ("norm2", "norm2_context"))
    counts = {key: {"replaced": 0, "skipped": 0} for key in PLUGIN_KEYS}
    for key, count in (("fMHA", sum(isinstance(m, (Attention, FluxAttention)) for m in modules)),
                       ("RMSNorm", sum(type(m) in (norms.RMSNorm, torch.nn.RMSNorm) for m in modules)),
                       ("AdaLayerNorm", sum(modulations.get(type(m), 0) for m in modules) + inline),
                       ("GeLU", sum(type(m) in (GELU, torch.nn.GELU) and m.approximate == "tanh" for m in modules))):
        counts[key]["replaced"] = count
    return {"counts": counts, "silu": 0}


@pytest.fixture(scope="module")
def sd3_transformers(tiny_sd35, tmp_path_factory):
    """tiny-sd3's and the SD3.5-featured tiny-sd3's transformer stages, exported and rewritten with every plugin."""
    from models.source import resolve_model

    prepared = {}
    for name, source in (("tiny-sd3", resolve_model("tiny-sd3")), ("tiny-sd3.5", tiny_sd35)):
        model, onnx_dir = STAGE_MODELS["transformer"](source), tmp_path_factory.mktemp(name)
        prepare(model, onnx_dir)
        prepared[name] = model, onnx_dir
    return prepared


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-sd3.5"])
def test_sd3_transformers_rewrite_every_pattern_and_compute_the_same(name, sd3_transformers):
    model, onnx_dir = sd3_transformers[name]
    expected = expected_transformer_passes(model.load_module())
    counts = expected["counts"]
    assert all(counts[key]["replaced"] > 0 for key in ("fMHA", "AdaLayerNorm", "GeLU"))
    assert (counts["RMSNorm"]["replaced"] > 0) == (name == "tiny-sd3.5")
    check_stage(model, onnx_dir, expected, sample(model, 3, 48, 80))
    graph = onnx.load(str(model.optimized_onnx_path(onnx_dir))).graph
    assert not {"Softmax", "LayerNormalization", "Tanh", "Sqrt"} & {n.op_type for n in graph.node}
    if name == "tiny-sd3":  # for the record: SDPA's 1/sqrt(8) applied as sqrt of it to Q and to K
        nodes = plugin_nodes(model.optimized_onnx_path(onnx_dir))
        assert {round(attribute(n, "scale"), 5) for n in nodes["fMHA"]} == {round(8 ** -0.5, 5)}
        assert [(key, counts[key]["replaced"]) for key in ("fMHA", "AdaLayerNorm", "GeLU")] == \
            [("fMHA", 2), ("AdaLayerNorm", 8), ("GeLU", 3)]


def test_flux_transformer_rewrites_every_pattern_and_computes_the_same(monkeypatch):
    """Flux's transformer (double- and single-stream blocks, RoPE), exported with its nn.RMSNorms written out as
    diffusers' RMSNorm computes them (opset 17 has no aten::rms_norm), at a small size and a short text."""
    from models.source import resolve_model
    from models.transformer import FluxTransformerModel

    def rms_norm_forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps)).to(self.weight.dtype) * self.weight

    model = FluxTransformerModel(resolve_model("tiny-flux"))
    module = model.load_module().eval()
    inputs = model.sample_inputs(2, 32, 48, generator=torch.Generator().manual_seed(2))
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, :7].contiguous()
    monkeypatch.setattr(torch.nn.RMSNorm, "forward", rms_norm_forward)
    exported = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module, tuple(inputs.values()), exported, input_names=list(inputs), opset_version=17,
                          output_names=list(model.output_names), dynamo=False)
    exported = onnx.load_from_string(exported.getvalue())
    optimizer = GraphOptimizer(exported, "transformer")
    rewritten = optimizer.run(optimizer.base_passes() + optimizer.plugin_passes(ALL))
    expected = expected_transformer_passes(module)["counts"]
    assert all(expected[key]["replaced"] > 0 for key in ("fMHA", *TRANSFORMER_KEYS))
    report = optimizer.plugin_report
    assert {k: {"replaced": v["replaced"], "skipped": v["skipped"]} for k, v in report.items()} == expected
    assert {n.op_type for n in rewritten.graph.node if n.domain == CONTRACT.domain} == \
        {PLUGIN_OPS[key] for key in ("fMHA", *TRANSFORMER_KEYS)}
    assert_same_outputs(exported, rewritten, {k: v.numpy() for k, v in inputs.items()})


def test_flux_transformer_as_the_stage_exports_it_in_fp16_has_every_rms_norm_taken(tmp_path):
    """The Flux stage's own export (models.transformer: torch.nn.RMSNorm written out as torch computes it, the weight's
    product in float32 and one cast back): in fp16 the pass takes every Q/K norm, none skipped."""
    from models.source import resolve_model
    from models.transformer import FluxTransformerModel

    model = FluxTransformerModel(resolve_model("tiny-flux"))
    model.export_onnx(tmp_path / "transformer.onnx", "cpu", torch.float16)
    optimizer = GraphOptimizer(onnx.load(str(tmp_path / "transformer.onnx")), "transformer")
    optimizer.run(optimizer.base_passes() + optimizer.plugin_passes(ALL))
    norms = sum(isinstance(m, torch.nn.RMSNorm) for m in model.load_module().modules())
    report = optimizer.plugin_report["RMSNorm"]
    assert norms > 0 and (report["replaced"], report["skipped"]) == (norms, 0)


def test_tensorrt_convention_has_no_transformer_plugins(sd3_transformers):
    """TensorRT's bundled plugins have none of the three: every match is skipped with that reason (the optimizer
    does not even run those passes for the convention), and its fMHA_V2 has no kernel for head size 8."""
    model, onnx_dir = sd3_transformers["tiny-sd3.5"]
    expected = expected_transformer_passes(model.load_module())["counts"]
    graph = gs.import_onnx(GraphOptimizer(onnx.load(str(onnx_dir / "transformer.onnx")), "transformer").run())
    for key in ("fMHA", *TRANSFORMER_KEYS):
        result = PLUGIN_PASSES[key].apply(graph, TENSORRT)
        reason = "TensorRT's fMHA_V2 has no kernel for head size 8" if key == "fMHA" else \
            f"TensorRT 8.6 has no {key} plugin"
        assert (result.replaced, len(result.skipped_reasons)) == (0, expected[key]["replaced"]), key
        assert {r.split(": ", 1)[1] for r in result.skipped_reasons} == {reason}
    assert [name for name, _ in GraphOptimizer(gs.export_onnx(graph), "t").plugin_passes(ALL, TENSORRT)] == \
        [*(key for key in PLUGIN_PASSES if key in UNET_KEYS), "cleanup"]


def test_t5_layer_norms_are_rms_norms_to_the_pass(tmp_path):
    """T5's T5LayerNorm (SD3's and Flux's text encoder) is an RMSNorm with its weight multiplied first: the pass takes
    every one of them, and the rewritten encoder computes the same."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    from models.source import resolve_model

    model = STAGE_MODELS["t5"](resolve_model("tiny-sd3"))
    prepare(model, tmp_path)
    norms = sum(isinstance(m, T5LayerNorm) for m in model.load_module().modules())
    counts = {key: {"replaced": 0, "skipped": 0} for key in PLUGIN_KEYS}
    counts["RMSNorm"]["replaced"] = norms
    check_stage(model, tmp_path, {"counts": counts, "silu": 0}, sample(model, 3, 48, 80))
