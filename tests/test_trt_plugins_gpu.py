"""Each TensorRT plugin inside a one-node engine against a float32 PyTorch reference (GPU and TensorRT 8.6+).

Each test writes an ONNX graph of one SDP* node (plugin-node contract: domain, plugin_version and
plugin_namespace attributes; gamma/beta/bias as fp16 initializers; fp16 inputs and output), lets TensorRT's
ONNX parser map it to our creator (checked: the network holds exactly that plugin layer, in our namespace),
builds an fp16 engine the TensorRT 8.6 way, and runs it on fresh random inputs into NaN-poisoned outputs.
Non-default epsilon and scale values are checked to matter, so a plugin that dropped them would fail.
Error is ||out - ref|| / ||ref||.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from plugins import trt_plugins
from plugins.contract import OURS, PLUGIN_DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, convention

trt = pytest.importorskip("tensorrt", reason="TensorRT's Python package is not installed")
onnx = pytest.importorskip("onnx")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.tensorrt,
    pytest.mark.skipif(trt_plugins.status() != "built", reason=trt_plugins.status()),
]

ATTENTION_BOUND = 2e-3  # as tests/test_plugins_gpu.py: fp16 output rounding, and P rounded to fp16
NORM_BOUND = 1e-3
LOGGER = trt.Logger(trt.Logger.WARNING)
OPS = convention(OURS).ops  # plugin key -> our op type (= creator name)


@pytest.fixture(scope="module", autouse=True)
def plugin_library():
    return trt_plugins.load_plugin_library(trt)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def randn(*shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device="cuda") * scale + shift).half()


def one_node_model(op_type: str, inputs: list, constants: set, output_shape: list, **attributes):
    """inputs: (name, fp16 tensor) in the node's input order; those named in `constants` become initializers."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(op_type, [name for name, _ in inputs], ["y"], name=f"{op_type}_0", domain=PLUGIN_DOMAIN,
                            plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE,
                            **attributes)
    graph = helper.make_graph(
        [node], op_type,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT16, list(t.shape))
         for name, t in inputs if name not in constants],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, output_shape)],
        initializer=[numpy_helper.from_array(t.cpu().numpy(), name) for name, t in inputs if name in constants])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PLUGIN_DOMAIN, 1)])


def build_engine(model, op_type: str, channels_last: bool = False):
    """channels_last: the network's inputs and output in kHWC8, with no reformat allowed between them and the
    plugin, so the plugin itself must take kHWC8."""
    builder = trt.Builder(LOGGER)
    creation = trt.NetworkDefinitionCreationFlag
    network = builder.create_network(1 << int(creation.EXPLICIT_BATCH) if hasattr(creation, "EXPLICIT_BATCH") else 0)
    parser = trt.OnnxParser(network, LOGGER)
    assert parser.parse(model.SerializeToString()), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    plugins = [network.get_layer(i) for i in range(network.num_layers)
               if network.get_layer(i).type == trt.LayerType.PLUGIN_V2]
    kinds = [network.get_layer(i).type for i in range(network.num_layers)]
    assert len(plugins) == 1, f"expected one plugin layer, got {kinds}"
    plugins[0].__class__ = trt.IPluginV2Layer
    plugin = plugins[0].plugin
    assert (plugin.plugin_type, plugin.plugin_namespace) == (op_type, PLUGIN_NAMESPACE)
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    if hasattr(trt.TacticSource, "CUDNN"):  # cuDNN may be a stub where this runs; our layer needs none of it
        config.set_tactic_sources(config.get_tactic_sources() & ~(1 << int(trt.TacticSource.CUDNN)))
    if channels_last:
        io = [network.get_input(i) for i in range(network.num_inputs)] + [network.get_output(0)]
        for tensor in io:
            tensor.allowed_formats = 1 << int(trt.TensorFormat.HWC8)
        if hasattr(trt.BuilderFlag, "DIRECT_IO"):  # fail rather than reformat (deprecated in 10.7; see the check below)
            config.set_flag(trt.BuilderFlag.DIRECT_IO)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "engine build failed (TensorRT's log above says why)"
    engine = trt.Runtime(LOGGER).deserialize_cuda_engine(plan)
    if channels_last:  # no reformat layer around the plugin (TensorRT names them "Reformatting CopyNode ...")
        layers = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.ONELINE)
        assert "reformat" not in layers.lower(), layers
    return engine


def run_plugin(op_type: str, inputs: list, constants: set, output_shape: list, channels_last: bool = False,
               **attributes) -> torch.Tensor:
    """channels_last: the engine's I/O in kHWC8 (see build_engine); inputs then must be torch.channels_last, which
    is kHWC8's byte layout where C % 8 == 0, and the output comes back in that memory format."""
    model = one_node_model(op_type, inputs, constants, output_shape, **attributes)
    engine = build_engine(model, op_type, channels_last)
    feeds = dict(inputs)
    context = engine.create_execution_context()
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    out = None
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        assert engine.get_tensor_dtype(name) == trt.float16, f"{name} is {engine.get_tensor_dtype(name)}, not fp16"
        expected = trt.TensorFormat.HWC8 if channels_last else trt.TensorFormat.LINEAR
        assert engine.get_tensor_format(name) == expected, f"{name} is {engine.get_tensor_format(name)}"
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            assert feeds[name].is_contiguous(memory_format=memory_format), f"{name} is not in {memory_format}"
            context.set_tensor_address(name, feeds[name].data_ptr())
        else:
            assert list(context.get_tensor_shape(name)) == output_shape
            out = torch.full(output_shape, float("nan"), dtype=torch.float16, device="cuda")
            out = out.contiguous(memory_format=memory_format)
            context.set_tensor_address(name, out.data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    return out


def attention(q, k, v, scale):  # [B, S, H, D] each, float32
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          scale=scale).transpose(1, 2)


def test_fmha():
    b, s, h, d, scale = 2, 4096, 8, 40, 0.3  # not 1/sqrt(40) = 0.158
    qkv = randn(b, s, h, 3, d)
    out = run_plugin(OPS["fMHA"], [("qkv", qkv)], set(), [b, s, h, d], scale=scale)
    q, k, v = (qkv[:, :, :, i].float() for i in range(3))
    assert rel_error(out, attention(q, k, v, scale)) < ATTENTION_BOUND
    assert rel_error(out, attention(q, k, v, 1 / math.sqrt(d))) > 10 * ATTENTION_BOUND


def test_fmhca():
    b, sq, skv, h, d, scale = 2, 4096, 77, 8, 40, 0.3
    q, kv = randn(b, sq, h, d), randn(b, skv, h, 2, d)
    out = run_plugin(OPS["fMHCA"], [("q", q), ("kv", kv)], set(), [b, sq, h, d], scale=scale)
    k, v = kv[:, :, :, 0].float(), kv[:, :, :, 1].float()
    assert rel_error(out, attention(q.float(), k, v, scale)) < ATTENTION_BOUND
    assert rel_error(out, attention(q.float(), k, v, 1 / math.sqrt(d))) > 10 * ATTENTION_BOUND


def group_norm_reference(x, groups, gamma, beta, epsilon, silu):
    y = F.group_norm(x.float(), groups, gamma.float(), beta.float(), epsilon)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("silu", [0, 1])
def test_group_norm(silu):
    b, c, h, w, groups, eps = 2, 320, 64, 64, 32, 0.05
    x = randn(b, c, h, w, scale=0.2, shift=0.5)  # variance 0.04: an epsilon of 0.05 matters
    gamma, beta = randn(c), randn(c)
    out = run_plugin(OPS["GroupNorm"], [("x", x), ("gamma", gamma), ("beta", beta)], {"gamma", "beta"}, [b, c, h, w],
                     num_groups=groups, epsilon=eps, silu=silu)
    assert rel_error(out, group_norm_reference(x, groups, gamma, beta, eps, silu)) < NORM_BOUND
    assert rel_error(out, group_norm_reference(x, groups, gamma, beta, 1e-5, silu)) > 10 * NORM_BOUND


# x and y in kHWC8, TensorRT's format next to fp16 convolutions: the plugin runs the kernel's NHWC layout.
@pytest.mark.parametrize("silu", [0, 1])
@pytest.mark.parametrize("b, c, h, w", [(2, 320, 64, 64), (1, 640, 16, 16)])
def test_group_norm_in_hwc8(b, c, h, w, silu):
    groups, eps = 32, 0.05
    x = randn(b, c, h, w, scale=0.2, shift=0.5).contiguous(memory_format=torch.channels_last)
    gamma, beta = randn(c), randn(c)
    out = run_plugin(OPS["GroupNorm"], [("x", x), ("gamma", gamma), ("beta", beta)], {"gamma", "beta"}, [b, c, h, w],
                     channels_last=True, num_groups=groups, epsilon=eps, silu=silu)
    assert rel_error(out, group_norm_reference(x, groups, gamma, beta, eps, silu)) < NORM_BOUND
    assert rel_error(out, group_norm_reference(x, groups, gamma, beta, 1e-5, silu)) > 10 * NORM_BOUND


def test_layer_norm():
    b, s, n, eps = 2, 4096, 320, 0.05
    x = randn(b, s, n, scale=0.2, shift=-1.0)
    gamma, beta = randn(n), randn(n)
    out = run_plugin(OPS["LayerNorm"], [("x", x), ("gamma", gamma), ("beta", beta)], {"gamma", "beta"}, [b, s, n],
                     epsilon=eps)

    def reference(epsilon):
        return F.layer_norm(x.float(), (n,), gamma.float(), beta.float(), epsilon)

    assert rel_error(out, reference(eps)) < NORM_BOUND
    assert rel_error(out, reference(1e-5)) > 10 * NORM_BOUND


def test_split_gelu():
    b, s, n = 2, 4096, 1280
    x, bias = randn(b, s, 2 * n), randn(2 * n)
    out = run_plugin(OPS["SplitGeLU"], [("x", x), ("bias", bias)], {"bias"}, [b, s, n])
    xf = x.float() + bias.float()
    assert rel_error(out, xf[..., :n] * F.gelu(xf[..., n:])) < NORM_BOUND


def test_seq2spatial_with_an_nchw_residual():  # SD 2.x: linear proj_out
    b, c, h, w = 2, 320, 64, 64
    x, bias, residual = randn(b, h * w, c), randn(c), randn(b, c, h, w)
    out = run_plugin(OPS["Seq2Spatial"], [("x", x), ("bias", bias), ("residual", residual)], {"bias"}, [b, c, h, w],
                     residual_layout=0)
    ref = (x.float() + bias.float()).permute(0, 2, 1).reshape(b, c, h, w) + residual.float()
    assert rel_error(out, ref) < NORM_BOUND


def test_seq2spatial_with_a_sequence_residual():  # SD 1.x: the residual before the conv proj_out
    b, c, h, w = 2, 320, 32, 128  # H != W: H and W come from `spatial`, in that order
    x, bias, residual = randn(b, h * w, c), randn(c), randn(b, h * w, c)
    spatial = randn(b, 4, h, w)
    out = run_plugin(OPS["Seq2Spatial"], [("x", x), ("bias", bias), ("residual", residual), ("spatial", spatial)],
                     {"bias"}, [b, c, h, w], residual_layout=1)
    ref = (x.float() + bias.float() + residual.float()).permute(0, 2, 1).reshape(b, c, h, w)
    assert rel_error(out, ref) < NORM_BOUND


# ---- the SD3/Flux transformers' plugins ---------------------------------------------------------------------

def test_rms_norm():  # SD3.5's Q/K norm: 24 heads of 64
    b, s, h, d, eps = 2, 4096 + 333, 24, 64, 0.05
    x, weight = randn(b, s, h, d, scale=0.2), randn(d)
    out = run_plugin(OPS["RMSNorm"], [("x", x), ("weight", weight)], {"weight"}, [b, s, h, d], epsilon=eps)

    def reference(epsilon):
        return F.rms_norm(x.float(), (d,), weight.float(), epsilon)

    assert rel_error(out, reference(eps)) < NORM_BOUND
    assert rel_error(out, reference(1e-6)) > 10 * NORM_BOUND


def test_ada_layer_norm():  # Flux's image stream: 3072 wide, scale and shift per batch (graph inputs, not constants)
    b, s, c, eps = 2, 4096, 3072, 0.05
    x, scale, shift = randn(b, s, c, scale=0.2, shift=-1.0), randn(b, c, scale=0.5), randn(b, c)
    out = run_plugin(OPS["AdaLayerNorm"], [("x", x), ("scale", scale), ("shift", shift)], set(), [b, s, c],
                     epsilon=eps)

    def reference(epsilon):
        return F.layer_norm(x.float(), (c,), eps=epsilon) * (1 + scale.float()[:, None]) + shift.float()[:, None]

    assert rel_error(out, reference(eps)) < NORM_BOUND
    assert rel_error(out, reference(1e-6)) > 10 * NORM_BOUND


def test_gelu():  # SD3.5 Medium's feed-forward: 4 x 1536
    b, s, n = 2, 4096 + 333, 6144
    x, bias = randn(b, s, n), randn(n)
    out = run_plugin(OPS["GeLU"], [("x", x), ("bias", bias)], {"bias"}, [b, s, n])
    assert rel_error(out, F.gelu(x.float() + bias.float(), approximate="tanh")) < NORM_BOUND
