"""Every plugin op against a float32 PyTorch reference on the GPU (skipped where none can run).

Inputs are fresh random values; outputs are poisoned with NaN before each run, so an element the
kernel fails to write fails the test. Error is ||out - ref|| / ||ref||.

Attention runs on each of its paths, forced through SDPLUGINS_ATTENTION: the mma.sync kernels (any
GPU) and the wgmma/TMA kernels (compute capability 9.0 only; skipped elsewhere).
"""

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from plugins import torch_ops as ops
from plugins.contract import TORCH_OP_NAMESPACE
from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ops.available(), reason=f"plugins cannot run here: {ops.status()}")]
SDP_OPS = getattr(torch.ops, TORCH_OP_NAMESPACE)  # torch.ops.sdplugins

# Relative-error bounds. fp16 outputs alone cost ~3e-4; attention also rounds P to fp16.
ATTENTION_BOUND = 2e-3
NORM_BOUND = 1e-3


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def randn(*shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device="cuda") * scale + shift).half()


def poisoned(*shape):
    return torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")


def is_hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["mma", "wgmma"])
def attention_path(request, monkeypatch):
    """Forces one attention path for the test (the library reads SDPLUGINS_ATTENTION at every call)."""
    if request.param == "wgmma" and not is_hopper():
        pytest.skip("the wgmma/TMA attention kernels need compute capability 9.0, not "
                    + ".".join(map(str, torch.cuda.get_device_capability())))
    monkeypatch.setenv("SDPLUGINS_ATTENTION", request.param)
    return request.param


# (batch, seq, heads, head_dim): SD 1.5 (D 40/80/160, 8 heads), SD 2.1 and SDXL (D 64), 512^2 and 1024^2,
# then odd sizes.
SELF_ATTENTION = [
    (2, 4096, 8, 40), (2, 1024, 8, 80), (2, 256, 8, 160), (2, 64, 8, 160),
    (2, 16384, 8, 40), (2, 4096, 8, 80), (2, 1024, 8, 160),
    (2, 4096, 5, 64), (2, 1024, 10, 64), (2, 256, 20, 64),
    (2, 4096, 10, 64), (2, 1024, 20, 64),
    (1, 1, 8, 40), (3, 77, 4, 64), (1, 4097, 2, 40), (2, 130, 3, 8), (2, 300, 2, 72), (1, 200, 2, 256),
    (8, 64, 8, 40), (4, 100, 2, 24), (1, 129, 1, 128), (1, 65, 1, 200),
]
CROSS_ATTENTION = [
    (2, 4096, 77, 8, 40), (2, 1024, 77, 8, 80), (2, 256, 77, 8, 160), (2, 16384, 77, 8, 40),
    (2, 4096, 77, 10, 64), (2, 1024, 77, 20, 64), (2, 4096, 77, 8, 80), (1, 8192, 16, 8, 24), (1, 65536, 3, 1, 64),
    (1, 1, 77, 8, 40), (2, 100, 1, 4, 64), (1, 4097, 77, 2, 80), (8, 64, 77, 8, 40), (2, 70, 300, 2, 256),
    (2, 33, 5, 3, 8), (1, 40, 129, 2, 72),
]
# Every head-size class of the wgmma kernels (40, 64, 80, 160 exact; 8, 24 -> 32; 48 -> 64; 72 -> 96; 128;
# 176 -> 192; 200, 256 -> 256) at ragged lengths: one row / key, 77 (a partial tile), 4097 (a partial
# 33rd query block); for cross-attention also 300 keys (three tiles, the last partial).
HEAD_SIZES = (8, 24, 40, 48, 64, 72, 80, 128, 160, 176, 200, 256)
SELF_ATTENTION_ODD = [(1, s, 2, d) for d in HEAD_SIZES for s in (1, 77, 4097)]
CROSS_ATTENTION_ODD = [(1, 333, skv, 2, d) for d in HEAD_SIZES for skv in (1, 77, 300)] + [
    # more work items than multiprocessors, so that each block runs several: one K/V tile kept across the
    # items of a head, runs of items that cross head and batch boundaries; and K/V streamed across items
    (3, 4097, 77, 7, 40), (2, 2900, 50, 9, 64), (2, 3000, 200, 6, 80),
]


def check_fmha(b, s, h, d):
    qkv = randn(b, s, h, 3, d)
    out = poisoned(b, s, h, d)
    scale = ops.default_scale(d)
    ops.fmha_into(qkv, out, scale)
    q, k, v = (qkv[:, :, :, i].float().transpose(1, 2) for i in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
    assert rel_error(out, ref) < ATTENTION_BOUND


def check_fmhca(b, sq, skv, h, d):
    q, kv = randn(b, sq, h, d), randn(b, skv, h, 2, d)
    out = poisoned(b, sq, h, d)
    ops.fmhca_into(q, kv, out, 0.3)
    k, v = (kv[:, :, :, i].float().transpose(1, 2) for i in range(2))
    ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, scale=0.3).transpose(1, 2)
    assert rel_error(out, ref) < ATTENTION_BOUND


@pytest.mark.parametrize("b, s, h, d", SELF_ATTENTION + SELF_ATTENTION_ODD)
def test_fmha(b, s, h, d, attention_path):
    check_fmha(b, s, h, d)


@pytest.mark.parametrize("b, sq, skv, h, d", CROSS_ATTENTION + CROSS_ATTENTION_ODD)
def test_fmhca(b, sq, skv, h, d, attention_path):
    check_fmhca(b, sq, skv, h, d)


def test_attention_path_selection(monkeypatch):
    """auto is the wgmma path on compute capability 9.0 (same bits as forcing it) and mma elsewhere; an
    unknown value, or wgmma where it cannot run, is an error with a message."""
    qkv = randn(2, 300, 4, 3, 64)
    monkeypatch.setenv("SDPLUGINS_ATTENTION", "auto")
    auto = ops.fmha_into(qkv, poisoned(2, 300, 4, 64), 0.125)
    monkeypatch.setenv("SDPLUGINS_ATTENTION", "wgmma" if is_hopper() else "mma")
    assert torch.equal(auto, ops.fmha_into(qkv, poisoned(2, 300, 4, 64), 0.125))
    monkeypatch.setenv("SDPLUGINS_ATTENTION", "fastest")
    with pytest.raises(RuntimeError, match="SDPLUGINS_ATTENTION must be auto, mma or wgmma, got 'fastest'"):
        ops.fmha_into(qkv, poisoned(2, 300, 4, 64), 0.125)
    if not is_hopper():
        monkeypatch.setenv("SDPLUGINS_ATTENTION", "wgmma")
        with pytest.raises(RuntimeError, match="compute capability 9.0"):
            ops.fmha_into(qkv, poisoned(2, 300, 4, 64), 0.125)


def test_attention_paths_agree(monkeypatch):
    """On Hopper both paths run: on the same inputs they agree to within the fp16 rounding bound."""
    if not is_hopper():
        pytest.skip("only the mma path runs on this GPU")
    qkv, q, kv = randn(2, 1000, 8, 3, 80), randn(2, 4096, 8, 40), randn(2, 77, 8, 2, 40)
    outs = {}
    for path in ("mma", "wgmma"):
        monkeypatch.setenv("SDPLUGINS_ATTENTION", path)
        outs[path] = (ops.fmha_into(qkv, poisoned(2, 1000, 8, 80), 0.1),
                      ops.fmhca_into(q, kv, poisoned(2, 4096, 8, 40), 0.3))
    for mma, wgmma in zip(outs["mma"], outs["wgmma"]):
        assert rel_error(wgmma, mma.float()) < ATTENTION_BOUND


def test_attention_graph_capture(attention_path):
    """Self- and cross-attention captured in one CUDA graph on a side stream, replayed on new inputs into
    poisoned outputs: the replay equals direct calls."""
    qkv, q, kv = randn(2, 1000, 8, 3, 40), randn(2, 4096, 8, 40), randn(2, 77, 8, 2, 40)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        SDP_OPS.fmha(qkv, 0.2)  # warm up on the capture stream
        SDP_OPS.fmhca(q, kv, 0.3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            self_out = SDP_OPS.fmha(qkv, 0.2)
            cross_out = SDP_OPS.fmhca(q, kv, 0.3)
    torch.cuda.synchronize()
    for t in (qkv, q, kv):
        t.copy_(torch.randn(t.shape, device="cuda").half())
    self_out.fill_(float("nan"))
    cross_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(self_out, ops.fmha_into(qkv, poisoned(2, 1000, 8, 40), 0.2))
    assert torch.equal(cross_out, ops.fmhca_into(q, kv, poisoned(2, 4096, 8, 40), 0.3))


def test_attention_op_and_graph_capture():
    """The custom op itself, on a side stream, inside a CUDA graph, and under torch.compile."""
    qkv = randn(2, 256, 8, 3, 40)
    expected = ops.fmha_into(qkv, poisoned(2, 256, 8, 40), 0.2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        SDP_OPS.fmha(qkv, 0.2)  # warm up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            captured = SDP_OPS.fmha(qkv, 0.2)
    qkv.copy_(randn(2, 256, 8, 3, 40))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ops.fmha_into(qkv, poisoned(2, 256, 8, 40), 0.2))
    compiled = torch.compile(lambda t: SDP_OPS.fmha(t, 0.2) * 2, fullgraph=True)
    assert torch.equal(compiled(qkv), ops.fmha_into(qkv, poisoned(2, 256, 8, 40), 0.2) * 2)
    assert not torch.equal(expected, captured)  # the replay saw the new inputs


# (batch, channels, height, width, groups): SD 1.5 UNet and VAE at 512^2, SDXL's 1024^2 UNet, odd ones.
GROUP_NORM = [
    (2, 320, 64, 64, 32), (2, 640, 32, 32, 32), (2, 1280, 16, 16, 32), (2, 1280, 8, 8, 32),
    (2, 960, 32, 32, 32), (2, 1920, 16, 16, 32), (2, 2560, 8, 8, 32),
    (1, 512, 64, 64, 32), (1, 512, 128, 128, 32), (1, 256, 256, 256, 32), (1, 128, 512, 512, 32),
    (2, 320, 128, 128, 32), (2, 640, 64, 64, 32),
    (8, 64, 9, 7, 8), (1, 30, 5, 5, 3), (3, 12, 1, 1, 4), (2, 40, 3, 3, 40), (1, 2048, 4, 4, 1),
]


@pytest.mark.parametrize("b, c, h, w, groups", GROUP_NORM)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_group_norm(b, c, h, w, groups, layout):
    # A non-zero mean and non-unit scale check the variance arithmetic, not just the normalisation.
    x = randn(b, c, h, w, scale=2.0, shift=0.5)
    gamma, beta = randn(c), randn(c)
    silu, eps = (b + c) % 2 == 0, 1e-6 if c % 3 else 1e-5
    ref = F.group_norm(x.float(), groups, gamma.float(), beta.float(), eps)
    ref = F.silu(ref) if silu else ref
    if layout == "nhwc":
        x_in, ref = x.permute(0, 2, 3, 1).contiguous(), ref.permute(0, 2, 3, 1)
    else:
        x_in = x
    out = poisoned(*x_in.shape)
    ops.group_norm_into(x_in, gamma, beta, out, groups, eps, silu, layout == "nhwc")
    assert rel_error(out, ref) < NORM_BOUND


@pytest.mark.parametrize("b, c, h, w, groups", [(2, 320, 64, 64, 32), (2, 640, 64, 64, 32), (1, 512, 128, 128, 32),
                                                 (2, 2560, 8, 8, 32), (1, 30, 5, 5, 3)])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_group_norm_is_deterministic(b, c, h, w, groups, layout):
    """One input, one output, bit for bit, run after run (a LoRA refit back to the base weights is checked that way).
    On 2026-11-26 engines with the NHWC kernel, which then summed its statistics with shared-memory atomics, drew
    images 1/255 apart run to run."""
    x = randn(b, c, h, w, scale=2.0, shift=0.5)
    x_in = x.permute(0, 2, 3, 1).contiguous() if layout == "nhwc" else x
    gamma, beta = randn(c), randn(c)
    first = ops.group_norm_into(x_in, gamma, beta, poisoned(*x_in.shape), groups, 1e-5, True, layout == "nhwc")
    for _ in range(20):
        again = ops.group_norm_into(x_in, gamma, beta, poisoned(*x_in.shape), groups, 1e-5, True, layout == "nhwc")
        assert torch.equal(first, again)


def test_group_norm_honours_epsilon():
    """A large epsilon must change the result exactly as F.group_norm's does (NVIDIA's ignored it)."""
    x = randn(2, 64, 8, 8, scale=0.05)
    gamma, beta = randn(64), randn(64)
    out = ops.group_norm_into(x, gamma, beta, poisoned(2, 64, 8, 8), 8, 0.5, False, False)
    ref = F.group_norm(x.float(), 8, gamma.float(), beta.float(), 0.5)
    assert rel_error(out, ref) < NORM_BOUND
    assert rel_error(out, F.group_norm(x.float(), 8, gamma.float(), beta.float(), 1e-5)) > 0.1


@pytest.mark.parametrize("rows, n", [(8192, 320), (2048, 640), (512, 1280), (154, 768), (154, 1024),
                                     (32768, 320), (8192, 640), (2048, 1280), (7, 2048), (3, 100), (5, 3000),
                                     (2, 4104), (1, 8), (9, 1), (13, 320), (3, 48)])
def test_layer_norm(rows, n):
    x = randn(rows, n, scale=3.0, shift=-1.0)
    gamma, beta = randn(n), randn(n)
    out = ops.layer_norm_into(x, gamma, beta, poisoned(rows, n), 1e-5)
    ref = F.layer_norm(x.float(), (n,), gamma.float(), beta.float(), 1e-5)
    if n == 1:  # a single element normalizes to exactly beta
        ref = beta.float().expand(rows, 1)
    assert rel_error(out, ref) < NORM_BOUND


@pytest.mark.parametrize("rows, n", [(8192, 1280), (2048, 2560), (512, 5120), (32768, 1280), (3, 100), (77, 13),
                                     (1, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_gelu(rows, n, with_bias):
    x = randn(2, rows, 2 * n)
    bias = randn(2 * n) if with_bias else None
    out = ops.split_gelu_into(x, bias, poisoned(2, rows, n))
    xf = x.float() + (bias.float() if with_bias else 0)
    ref = xf[..., :n] * F.gelu(xf[..., n:])
    assert rel_error(out, ref) < NORM_BOUND


@pytest.mark.parametrize("b, c, h, w", [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8),
                                        (2, 960, 32, 32), (2, 1920, 16, 16), (1, 7, 1, 4097), (3, 65, 5, 13),
                                        (1, 1, 1, 1)])
@pytest.mark.parametrize("residual_layout", ["nchw", "sequence"])
def test_seq2spatial(b, c, h, w, residual_layout):
    x, bias = randn(b, h * w, c), randn(c)
    if residual_layout == "nchw":  # SD 2.x: linear proj_out, then the residual in NCHW
        residual = randn(b, c, h, w)
        out = ops.seq2spatial_into(x, bias, residual, poisoned(b, c, h, w))
        ref = (x.float() + bias.float()).permute(0, 2, 1).reshape(b, c, h, w) + residual.float()
    else:  # SD 1.x: the residual in sequence layout, added before the transpose to the conv proj_out
        residual = randn(b, h * w, c)
        out = ops.seq2spatial_into(x, bias, residual, poisoned(b, c, h, w), ops.LAYOUT_NHWC)
        ref = (x.float() + bias.float() + residual.float()).permute(0, 2, 1).reshape(b, c, h, w)
    assert rel_error(out, ref) < NORM_BOUND


def test_seq2spatial_op_with_sequence_residual():
    x, bias, residual = randn(2, 12 * 20, 64), randn(64), randn(2, 12 * 20, 64)
    out = SDP_OPS.seq2spatial(x, bias, residual, ops.LAYOUT_NHWC, 12)
    ref = (x.float() + bias.float() + residual.float()).permute(0, 2, 1).reshape(2, 64, 12, 20)
    assert out.shape == (2, 64, 12, 20)
    assert rel_error(out, ref) < NORM_BOUND


# ---- the SD3/Flux transformers' kernels -----------------------------------------------------------------
# SD3.5 Medium: 24 heads of 64, 1536 wide, 4096 image + 333 text tokens; Flux: 24 heads of 128, 3072 wide,
# 4096 + 512 tokens; batch 2. Then odd sizes: widths not a multiple of the 8-element vector (the block kernels),
# widths past the register rows (4104, 8192), several rows per warp crossing a batch's end (AdaLayerNorm).
SD35_TOKENS, FLUX_TOKENS = 4096 + 333, 4096 + 512


def rms_norm_reference(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)


@pytest.mark.parametrize("shape", [(2, SD35_TOKENS, 24, 64), (2, FLUX_TOKENS, 24, 128), (2, SD35_TOKENS, 1536),
                                   (2, 512, 3072), (3, 7, 40), (5, 8), (9, 16), (4, 32), (3, 5, 72), (7, 100),
                                   (3, 13), (9, 1), (2, 4104), (3, 8192), (2, 3000), (1, 256), (1, 1, 4096)])
def test_rms_norm(shape):
    x, weight = randn(*shape, scale=2.0, shift=0.5), randn(shape[-1])
    out = ops.rms_norm_into(x, weight, poisoned(*shape), 1e-6)
    assert rel_error(out, rms_norm_reference(x, weight, 1e-6)) < NORM_BOUND


def test_rms_norm_honours_epsilon():
    x, weight = randn(64, 128, scale=0.2), randn(128)
    out = ops.rms_norm_into(x, weight, poisoned(64, 128), 0.05)  # mean square 0.04: an epsilon of 0.05 matters
    assert rel_error(out, rms_norm_reference(x, weight, 0.05)) < NORM_BOUND
    assert rel_error(out, rms_norm_reference(x, weight, 1e-6)) > 0.1


def ada_layer_norm_reference(x, scale, shift, eps):
    normalized = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return normalized * (1 + scale.float()[:, None]) + shift.float()[:, None]


@pytest.mark.parametrize("b, s, c", [(2, 4096, 1536), (2, 333, 1536), (2, 4096, 3072), (2, 512, 3072),
                                     (2, SD35_TOKENS, 1536), (3, 5, 64), (3, 7, 8), (2, 3, 24), (4, 9, 128),
                                     (1, 7, 100), (3, 5, 13), (2, 3, 4104), (2, 9, 8192), (1, 1, 8), (2, 3, 2)])
def test_ada_layer_norm(b, s, c):
    x, scale, shift = randn(b, s, c, scale=3.0, shift=-1.0), randn(b, c, scale=0.5), randn(b, c)
    out = ops.ada_layer_norm_into(x, scale, shift, poisoned(b, s, c), 1e-6)
    assert rel_error(out, ada_layer_norm_reference(x, scale, shift, 1e-6)) < NORM_BOUND


def test_ada_layer_norm_modulates_each_batch_by_its_own_row():
    """Swapping the batches' scale and shift must change the output: each token reads its batch's row."""
    b, s, c = 3, 5, 64
    x, scale, shift = randn(b, s, c), randn(b, c), randn(b, c)
    out = ops.ada_layer_norm_into(x, scale, shift, poisoned(b, s, c), 1e-6)
    swapped = ada_layer_norm_reference(x, scale.flip(0), shift.flip(0), 1e-6)
    assert rel_error(out, ada_layer_norm_reference(x, scale, shift, 1e-6)) < NORM_BOUND
    assert rel_error(out, swapped) > 0.1


@pytest.mark.parametrize("shape", [(2, SD35_TOKENS, 6144), (2, FLUX_TOKENS, 12288), (2, 333, 6144), (3, 100),
                                   (77, 13), (1, 8), (5, 1), (2, 7, 4104)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gelu_tanh(shape, with_bias):
    x = randn(*shape, scale=2.0)
    bias = randn(shape[-1]) if with_bias else None
    out = ops.gelu_tanh_into(x, bias, poisoned(*shape))
    ref = F.gelu(x.float() + (bias.float() if with_bias else 0), approximate="tanh")
    assert rel_error(out, ref) < NORM_BOUND


def test_transformer_ops_under_graph_capture_and_compile():
    """The torch ops (not the _into functions): captured in a CUDA graph and compiled, equal to the references."""
    x, weight = randn(2, 77, 4, 64), randn(64)
    h, scale, shift, bias = randn(2, 77, 256), randn(2, 256), randn(2, 256), randn(256)

    def block(x, h):
        return (SDP_OPS.rms_norm(x, weight, 1e-6), SDP_OPS.ada_layer_norm(h, scale, shift, 1e-6),
                SDP_OPS.gelu_tanh(h, bias))

    references = (rms_norm_reference(x, weight, 1e-6), ada_layer_norm_reference(h, scale, shift, 1e-6),
                  F.gelu(h.float() + bias.float(), approximate="tanh"))
    compiled = torch.compile(block, fullgraph=True)
    for out, ref in zip(compiled(x, h), references):
        assert rel_error(out, ref) < NORM_BOUND
    graph = torch.cuda.CUDAGraph()
    block(x, h)  # warm up outside the capture
    with torch.cuda.graph(graph):
        captured = block(x, h)
    for out in captured:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip(captured, references):
        assert rel_error(out, ref) < NORM_BOUND


@pytest.mark.parametrize("call, message", [
    (lambda: ops.fmha_into(randn(1, 8, 1, 3, 12), poisoned(1, 8, 1, 12), 1.0), "multiple of 8"),
    (lambda: ops.fmha_into(randn(1, 8, 1, 3, 264), poisoned(1, 8, 1, 264), 1.0), "[8, 256]"),
    (lambda: ops.group_norm_into(randn(1, 30, 2, 2), randn(30), randn(30), poisoned(1, 30, 2, 2), 4, 1e-5,
                                 False, False), "must divide"),
])
def test_kernels_reject_what_they_cannot_do(call, message):
    with pytest.raises((RuntimeError, ValueError), match=message.replace("[", r"\[").replace("]", r"\]")):
        call()


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_memcheck_every_kernel():
    result = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", sys.executable,
         str(ROOT / "scripts" / "plugin_memcheck.py")],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout
