"""float64 NumPy references of the plugin contract, shared by the tests that need no GPU.

tests/test_plugin_passes.py runs them as ONNX Runtime custom ops for the plugin nodes; `cpu_kernels()`
registers them as the CPU kernels of our PyTorch ops (torch.ops.sdplugins.*), so the modules that call
those ops run on a CPU. The kernels check what the CUDA ops check (contiguity, shapes, one dtype) and
compute in float64, returning the inputs' dtype.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
from scipy.special import erf

from plugins.contract import TORCH_OP_NAMESPACE, TORCH_OPS


def _attention(q, k, v, scale):
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), v)


def fmha(qkv, scale):
    return _attention(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], scale)


def fmhca(q, kv, scale):
    return _attention(q, kv[..., 0, :], kv[..., 1, :], scale)


def group_norm(x, gamma, beta, num_groups, epsilon, silu):
    grouped = x.reshape(x.shape[0], num_groups, -1)
    normalized = (grouped - grouped.mean(-1, keepdims=True)) / np.sqrt(grouped.var(-1, keepdims=True) + epsilon)
    y = normalized.reshape(x.shape) * gamma.reshape(-1, 1, 1) + beta.reshape(-1, 1, 1)
    return y / (1 + np.exp(-y)) if silu else y


def layer_norm(x, gamma, beta, epsilon):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + epsilon) * gamma + beta


def split_gelu(x, bias):
    value, gate = np.split(x + bias, 2, axis=-1)
    return value * 0.5 * gate * (1 + erf(gate / np.sqrt(2)))


def seq2spatial(x, bias, residual, spatial, residual_layout):
    y = x + bias + (residual if residual_layout == 1 else 0)
    height, width = spatial.shape[2:]
    y = y.reshape(y.shape[0], height, width, y.shape[2]).transpose(0, 3, 1, 2)
    return y + residual if residual_layout == 0 else y


def rms_norm(x, weight, epsilon):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + epsilon) * weight


def ada_layer_norm(x, scale, shift, epsilon):
    """x [B, S, C]; scale, shift [B, C]."""
    return layer_norm(x, 1.0, 0.0, epsilon) * (1 + scale[:, None]) + shift[:, None]


def gelu_tanh(x, bias):
    y = x + bias
    return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))


# ---- the same references as CPU kernels of torch.ops.sdplugins ----------------------------------------

_enabled = False
_registered = False
# Calls per op (and, for group_norm, per layout and SiLU) since cpu_kernels() was entered.
calls: Counter = Counter()


def _check(name, *tensors):
    if not _enabled:  # what the op itself does with CPU tensors: raise (the library is missing, or not CUDA)
        from plugins import torch_ops

        torch_ops._check_half(name, *tensors)
        raise RuntimeError(f"sdplugins.{name}: no CPU kernel outside tests.plugin_references.cpu_kernels()")
    calls[name] += 1
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"{name}: tensors must be contiguous")
        if t.dtype != tensors[0].dtype:
            raise ValueError(f"{name}: tensors must share one dtype, got {t.dtype} and {tensors[0].dtype}")


def _np(t):
    return t.detach().double().numpy()


def _out(array, like):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(like.dtype)


def _register() -> None:
    import torch

    from plugins import torch_ops

    def fmha_cpu(qkv, scale):
        _check("fmha", qkv)
        assert qkv.dim() == 5 and qkv.shape[3] == 3, f"fmha: qkv must be [B, S, H, 3, D], got {list(qkv.shape)}"
        return _out(fmha(_np(qkv), scale), qkv)

    def fmhca_cpu(q, kv, scale):
        _check("fmhca", q, kv)
        assert q.dim() == 4 and kv.dim() == 5 and kv.shape[3] == 2 and kv.shape[4] == q.shape[3]
        return _out(fmhca(_np(q), _np(kv), scale), q)

    def group_norm_cpu(x, gamma, beta, groups, eps, silu, channels_last):
        _check("group_norm", x, gamma, beta)
        calls["group_norm channels_last" if channels_last else "group_norm nchw"] += 1
        calls["group_norm silu"] += bool(silu)
        nchw = x.movedim(-1, 1) if channels_last else x
        y = group_norm(_np(nchw).reshape(nchw.shape[0], nchw.shape[1], -1, 1), _np(gamma), _np(beta), groups, eps, silu)
        y = torch.from_numpy(y).reshape(nchw.shape)
        return _out((y.movedim(1, -1) if channels_last else y).numpy(), x)

    def layer_norm_cpu(x, gamma, beta, eps):
        _check("layer_norm", x, gamma, beta)
        return _out(layer_norm(_np(x), _np(gamma), _np(beta), eps), x)

    def split_gelu_cpu(x, bias):
        _check("split_gelu", x, *([bias] if bias is not None else []))
        return _out(split_gelu(_np(x), 0 if bias is None else _np(bias)), x)

    def seq2spatial_cpu(x, bias, residual, residual_layout=torch_ops.LAYOUT_NCHW, height=0):
        _check("seq2spatial", x, bias, residual)
        shape = torch_ops._seq2spatial_shape(x, residual, residual_layout, height)
        assert residual_layout == torch_ops.LAYOUT_NHWC or list(residual.shape) == shape
        return _out(seq2spatial(_np(x), _np(bias), _np(residual), np.empty(shape), residual_layout), x)

    def rms_norm_cpu(x, weight, eps):
        _check("rms_norm", x, weight)
        assert weight.numel() == x.shape[-1], f"rms_norm: weight must have {x.shape[-1]} elements"
        return _out(rms_norm(_np(x), _np(weight), eps), x)

    def ada_layer_norm_cpu(x, scale, shift, eps):
        _check("ada_layer_norm", x, scale, shift)
        assert x.dim() == 3 and scale.shape == shift.shape == (x.shape[0], x.shape[2]), \
            f"ada_layer_norm: x must be [B, S, C] and scale, shift [B, C], got {list(x.shape)}, {list(scale.shape)}"
        return _out(ada_layer_norm(_np(x), _np(scale), _np(shift), eps), x)

    def gelu_tanh_cpu(x, bias):
        _check("gelu_tanh", x, *([bias] if bias is not None else []))
        assert bias is None or bias.numel() == x.shape[-1], f"gelu_tanh: bias must have {x.shape[-1]} elements"
        return _out(gelu_tanh(_np(x), 0 if bias is None else _np(bias)), x)

    for key, kernel in (("fMHA", fmha_cpu), ("fMHCA", fmhca_cpu), ("GroupNorm", group_norm_cpu),
                        ("LayerNorm", layer_norm_cpu), ("SplitGeLU", split_gelu_cpu), ("Seq2Spatial", seq2spatial_cpu),
                        ("RMSNorm", rms_norm_cpu), ("AdaLayerNorm", ada_layer_norm_cpu), ("GeLU", gelu_tanh_cpu)):
        torch.library.register_kernel(f"{TORCH_OP_NAMESPACE}::{TORCH_OPS[key]}", "cpu", kernel)


@contextlib.contextmanager
def cpu_kernels():
    """Within the block, torch.ops.sdplugins.* run these references on CPU tensors (of any float dtype);
    `calls` counts what ran."""
    global _enabled, _registered
    if not _registered:
        _register()
        _registered = True
    _enabled = True
    calls.clear()
    try:
        yield
    finally:
        _enabled = False
