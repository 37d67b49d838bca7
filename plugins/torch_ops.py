"""PyTorch custom ops (namespace plugins.contract.TORCH_OP_NAMESPACE, `torch.ops.sdplugins`, op names
plugins.contract.TORCH_OPS) over the CUDA kernels' C ABI.

Each op runs on the current CUDA stream and has a fake (meta) implementation, so it works under
torch.compile and CUDA-graph capture. The ops are registered even where the library is missing, so
importing never fails; calling one then raises with the reason (see `status()`).

The `*_into` functions write into a caller-provided output; the tests use them to poison outputs.
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

import torch

# LAYOUT_* and the head-size limits are the contract's, named here too for the ops' callers.
from plugins.contract import (  # noqa: F401
    HEAD_SIZE_MULTIPLE,
    LAYOUT_NCHW,
    LAYOUT_NHWC,
    LIBRARY_ENV,
    LIBRARY_FILE,
    MAX_HEAD_SIZE,
    TORCH_OP_NAMESPACE,
    TORCH_OPS,
)

ROOT = Path(__file__).resolve().parent.parent

_c_void, _c_int, _c_float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_c_i64, _c_size = ctypes.c_int64, ctypes.c_size_t
_SIGNATURES = {
    "sdp_version": ([], _c_int),
    "sdp_last_error": ([], ctypes.c_char_p),
    "sdp_fmha": ([_c_void, _c_void, _c_int, _c_int, _c_int, _c_int, _c_float, _c_void], _c_int),
    "sdp_fmhca": ([_c_void, _c_void, _c_void, _c_int, _c_int, _c_int, _c_int, _c_int, _c_float, _c_void], _c_int),
    "sdp_group_norm_workspace_size": ([_c_int, _c_int, _c_int, _c_int, _c_int], _c_size),
    "sdp_group_norm": ([_c_void, _c_void, _c_void, _c_void, _c_void, _c_size, _c_int, _c_int, _c_int, _c_int,
                        _c_float, _c_int, _c_int, _c_void], _c_int),
    "sdp_layer_norm": ([_c_void, _c_void, _c_void, _c_void, _c_i64, _c_int, _c_float, _c_void], _c_int),
    "sdp_split_gelu": ([_c_void, _c_void, _c_void, _c_i64, _c_int, _c_void], _c_int),
    "sdp_seq2spatial": ([_c_void, _c_void, _c_void, _c_void, _c_int, _c_int, _c_int, _c_int, _c_void], _c_int),
    "sdp_rms_norm": ([_c_void, _c_void, _c_void, _c_i64, _c_int, _c_float, _c_void], _c_int),
    "sdp_ada_layer_norm": ([_c_void, _c_void, _c_void, _c_void, _c_int, _c_i64, _c_int, _c_float, _c_void], _c_int),
    "sdp_gelu_tanh": ([_c_void, _c_void, _c_void, _c_i64, _c_int, _c_void], _c_int),
}


def library_path() -> Path:
    return Path(os.environ.get(LIBRARY_ENV, ROOT / "build" / LIBRARY_FILE))


def _load() -> tuple[ctypes.CDLL | None, str]:
    path = library_path()
    if not path.is_file():
        return None, (f"plugin library not built: {path} is missing "
                      "(build it with: cmake -S . -B build && cmake --build build -j)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"plugin library {path} failed to load: {exc}"
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    if not torch.cuda.is_available():
        return lib, "no CUDA device: the plugin library is built but cannot run here"
    return lib, "available"


_LIB, _STATUS = _load()


def status() -> str:
    """'available', or why the plugins cannot run here."""
    return _STATUS


def available() -> bool:
    return _STATUS == "available"


def _op_name(key: str) -> str:
    """The qualified name of a plugin key's op ("sdplugins::fmha")."""
    return f"{TORCH_OP_NAMESPACE}::{TORCH_OPS[key]}"


def _call(name: str, *args) -> None:
    if not available():
        raise RuntimeError(f"sdplugins unavailable: {_STATUS}")
    if getattr(_LIB, name)(*args) != 0:
        raise RuntimeError(f"sdplugins.{name}: {_LIB.sdp_last_error().decode()}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_half(name: str, *tensors: torch.Tensor) -> None:
    if not available():  # the root cause first: nothing below could run anyway
        raise RuntimeError(f"sdplugins unavailable: {_STATUS}")
    for t in tensors:
        _require(t.dtype == torch.float16, f"{name}: tensors must be float16, got {t.dtype}")
        _require(t.is_cuda, f"{name}: tensors must be on a CUDA device")
        _require(t.is_contiguous(), f"{name}: tensors must be contiguous")


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _stream(t: torch.Tensor):
    return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)


# ---- fMHA / fMHCA -------------------------------------------------------------------------------

def fmha_into(qkv: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
    _check_half("fmha", qkv, out)
    _require(qkv.dim() == 5 and qkv.shape[3] == 3, f"fmha: qkv must be [B, S, H, 3, D], got {list(qkv.shape)}")
    b, s, h, _, d = qkv.shape
    _require(tuple(out.shape) == (b, s, h, d), "fmha: out must be [B, S, H, D]")
    _call("sdp_fmha", _ptr(qkv), _ptr(out), b, s, h, d, scale, _stream(qkv))
    return out


def fmhca_into(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
    _check_half("fmhca", q, kv, out)
    _require(q.dim() == 4 and kv.dim() == 5 and kv.shape[3] == 2,
             f"fmhca: q must be [B, Sq, H, D] and kv [B, Skv, H, 2, D], got {list(q.shape)} and {list(kv.shape)}")
    b, sq, h, d = q.shape
    _require(kv.shape[0] == b and kv.shape[2] == h and kv.shape[4] == d, "fmhca: q and kv disagree on B, H or D")
    _require(out.shape == q.shape, "fmhca: out must be shaped like q")
    _call("sdp_fmhca", _ptr(q), _ptr(kv), _ptr(out), b, sq, kv.shape[1], h, d, scale, _stream(q))
    return out


@torch.library.custom_op(_op_name("fMHA"), mutates_args=())
def fmha(qkv: torch.Tensor, scale: float) -> torch.Tensor:
    """Self-attention: qkv [B, S, H, 3, D] -> [B, S, H, D]."""
    return fmha_into(qkv, qkv.new_empty(qkv.shape[:3] + qkv.shape[4:]), scale)


@fmha.register_fake
def _(qkv, scale):
    return qkv.new_empty(qkv.shape[:3] + qkv.shape[4:])


@torch.library.custom_op(_op_name("fMHCA"), mutates_args=())
def fmhca(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """Cross-attention: q [B, Sq, H, D], kv [B, Skv, H, 2, D] -> [B, Sq, H, D]."""
    return fmhca_into(q, kv, torch.empty_like(q), scale)


@fmhca.register_fake
def _(q, kv, scale):
    return torch.empty_like(q)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---- GroupNorm ----------------------------------------------------------------------------------

def _group_norm_dims(x: torch.Tensor, channels_last: bool) -> tuple[int, int, int]:
    _require(x.dim() >= 3, f"group_norm: x must be [B, C, *spatial] or [B, *spatial, C], got {list(x.shape)}")
    b = x.shape[0]
    c = x.shape[-1] if channels_last else x.shape[1]
    return b, c, x.numel() // (b * c) if b * c else 0


def group_norm_into(x, gamma, beta, out, groups: int, eps: float, silu: bool, channels_last: bool):
    _check_half("group_norm", x, gamma, beta, out)
    b, c, hw = _group_norm_dims(x, channels_last)
    _require(gamma.numel() == c and beta.numel() == c, f"group_norm: gamma and beta must have {c} elements")
    _require(groups >= 1 and c % groups == 0, f"group_norm: groups ({groups}) must divide channels ({c})")
    _require(out.shape == x.shape, "group_norm: out must be shaped like x")
    layout = LAYOUT_NHWC if channels_last else LAYOUT_NCHW
    size = _LIB.sdp_group_norm_workspace_size(b, c, hw, groups, layout)
    workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=x.device)
    _call("sdp_group_norm", _ptr(x), _ptr(gamma), _ptr(beta), _ptr(out), _ptr(workspace), size,
          b, c, hw, groups, eps, layout, int(silu), _stream(x))
    return out


@torch.library.custom_op(_op_name("GroupNorm"), mutates_args=())
def group_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, groups: int, eps: float, silu: bool,
               channels_last: bool) -> torch.Tensor:
    """GroupNorm (+SiLU) over [B, C, ...] or, with channels_last, [B, ..., C]."""
    return group_norm_into(x, gamma, beta, torch.empty_like(x), groups, eps, silu, channels_last)


@group_norm.register_fake
def _(x, gamma, beta, groups, eps, silu, channels_last):
    return torch.empty_like(x)


# ---- LayerNorm, SplitGeLU, Seq2Spatial ----------------------------------------------------------

def layer_norm_into(x, gamma, beta, out, eps: float):
    _check_half("layer_norm", x, gamma, beta, out)
    n = x.shape[-1]
    _require(gamma.numel() == n and beta.numel() == n, f"layer_norm: gamma and beta must have {n} elements")
    _require(out.shape == x.shape, "layer_norm: out must be shaped like x")
    _call("sdp_layer_norm", _ptr(x), _ptr(gamma), _ptr(beta), _ptr(out), x.numel() // n, n, eps, _stream(x))
    return out


@torch.library.custom_op(_op_name("LayerNorm"), mutates_args=())
def layer_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension."""
    return layer_norm_into(x, gamma, beta, torch.empty_like(x), eps)


@layer_norm.register_fake
def _(x, gamma, beta, eps):
    return torch.empty_like(x)


def _split_shape(x: torch.Tensor) -> list[int]:
    _require(x.shape[-1] % 2 == 0, f"split_gelu: last dimension must be even, got {x.shape[-1]}")
    return [*x.shape[:-1], x.shape[-1] // 2]


def split_gelu_into(x, bias, out):
    _check_half("split_gelu", x, out, *([bias] if bias is not None else []))
    n = _split_shape(x)[-1]
    _require(bias is None or bias.numel() == 2 * n, f"split_gelu: bias must have {2 * n} elements")
    _require(list(out.shape) == _split_shape(x), "split_gelu: out must be [..., N]")
    _call("sdp_split_gelu", _ptr(x), _ptr(bias), _ptr(out), x.numel() // (2 * n), n, _stream(x))
    return out


@torch.library.custom_op(_op_name("SplitGeLU"), mutates_args=())
def split_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[..., 2N] (+ bias) -> [..., N] = x[..., :N] * gelu_erf(x[..., N:])."""
    return split_gelu_into(x, bias, x.new_empty(_split_shape(x)))


@split_gelu.register_fake
def _(x, bias):
    return x.new_empty(_split_shape(x))


def seq2spatial_into(x, bias, residual, out, residual_layout: int = LAYOUT_NCHW):
    """out [B, C, H, W] = transpose(x [B, HW, C] + bias [C]) + residual: [B, C, H, W] with LAYOUT_NCHW,
    or [B, HW, C] like x with LAYOUT_NHWC (the sequence layout, added before the transpose)."""
    _check_half("seq2spatial", x, bias, residual, out)
    _require(residual_layout in (LAYOUT_NCHW, LAYOUT_NHWC),
             f"seq2spatial: residual_layout must be {LAYOUT_NCHW} (NCHW) or {LAYOUT_NHWC} (NHWC), got "
             f"{residual_layout}")
    _require(x.dim() == 3 and out.dim() == 4, "seq2spatial: x must be [B, HW, C] and out [B, C, H, W]")
    b, hw, c = x.shape
    _require(tuple(out.shape[:2]) == (b, c) and out.shape[2] * out.shape[3] == hw,
             f"seq2spatial: out {list(out.shape)} does not match x {list(x.shape)}")
    expected = out.shape if residual_layout == LAYOUT_NCHW else x.shape
    _require(residual.shape == expected, f"seq2spatial: residual must be {list(expected)}, got {list(residual.shape)}")
    _require(bias.numel() == c, f"seq2spatial: bias must have {c} elements")
    _call("sdp_seq2spatial", _ptr(x), _ptr(bias), _ptr(residual), _ptr(out), b, hw, c, residual_layout, _stream(x))
    return out


def _seq2spatial_shape(x: torch.Tensor, residual: torch.Tensor, residual_layout: int, height: int) -> list[int]:
    if residual_layout != LAYOUT_NHWC:  # NCHW, or invalid: seq2spatial_into says so
        return list(residual.shape)
    b, hw, c = x.shape
    _require(height >= 1 and hw % height == 0, f"seq2spatial: height ({height}) must divide HW ({hw})")
    return [b, c, height, hw // height]


@torch.library.custom_op(_op_name("Seq2Spatial"), mutates_args=())
def seq2spatial(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, residual_layout: int = LAYOUT_NCHW,
                height: int = 0) -> torch.Tensor:
    """x [B, HW, C] + bias [C], to [B, C, H, W], + residual [B, C, H, W]; with residual_layout LAYOUT_NHWC the
    residual is [B, HW, C], added before the transpose, and `height` gives H (W = HW / H)."""
    out = x.new_empty(_seq2spatial_shape(x, residual, residual_layout, height))
    return seq2spatial_into(x, bias, residual, out, residual_layout)


@seq2spatial.register_fake
def _(x, bias, residual, residual_layout=LAYOUT_NCHW, height=0):
    return x.new_empty(_seq2spatial_shape(x, residual, residual_layout, height))


# ---- the transformers' RMSNorm, AdaLayerNorm and GeLU -----------------------------------------------------

def _last_dim(name: str, x: torch.Tensor) -> int:
    _require(x.dim() >= 1 and x.shape[-1] >= 1 and x.numel() >= 1,
             f"{name}: x must be [..., N] with N >= 1, got {list(x.shape)}")
    return x.shape[-1]


def rms_norm_into(x, weight, out, eps: float):
    _check_half("rms_norm", x, weight, out)
    n = _last_dim("rms_norm", x)
    _require(weight.numel() == n, f"rms_norm: weight must have {n} elements, got {list(weight.shape)}")
    _require(out.shape == x.shape, "rms_norm: out must be shaped like x")
    _call("sdp_rms_norm", _ptr(x), _ptr(weight), _ptr(out), x.numel() // n, n, eps, _stream(x))
    return out


@torch.library.custom_op(_op_name("RMSNorm"), mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight."""
    return rms_norm_into(x, weight, torch.empty_like(x), eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def ada_layer_norm_into(x, scale, shift, out, eps: float):
    _check_half("ada_layer_norm", x, scale, shift, out)
    _require(x.dim() == 3 and x.numel() >= 1, f"ada_layer_norm: x must be [B, S, C], got {list(x.shape)}")
    b, s, c = x.shape
    for name, t in (("scale", scale), ("shift", shift)):
        _require(tuple(t.shape) == (b, c), f"ada_layer_norm: {name} must be [B, C] = {[b, c]}, got {list(t.shape)}")
    _require(out.shape == x.shape, "ada_layer_norm: out must be shaped like x")
    _call("sdp_ada_layer_norm", _ptr(x), _ptr(scale), _ptr(shift), _ptr(out), b, s, c, eps, _stream(x))
    return out


@torch.library.custom_op(_op_name("AdaLayerNorm"), mutates_args=())
def ada_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm(x [B, S, C], no affine) * (1 + scale[:, None]) + shift[:, None]; scale, shift [B, C]."""
    return ada_layer_norm_into(x, scale, shift, torch.empty_like(x), eps)


@ada_layer_norm.register_fake
def _(x, scale, shift, eps):
    return torch.empty_like(x)


def gelu_tanh_into(x, bias, out):
    _check_half("gelu_tanh", x, out, *([bias] if bias is not None else []))
    n = _last_dim("gelu_tanh", x)
    if bias is not None:
        _require(bias.numel() == n, f"gelu_tanh: bias must have {n} elements, got {list(bias.shape)}")
    _require(out.shape == x.shape, "gelu_tanh: out must be shaped like x")
    _call("sdp_gelu_tanh", _ptr(x), _ptr(bias), _ptr(out), x.numel() // n, n, _stream(x))
    return out


@torch.library.custom_op(_op_name("GeLU"), mutates_args=())
def gelu_tanh(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias, approximate="tanh") over [..., N]; bias [N] or None."""
    return gelu_tanh_into(x, bias, torch.empty_like(x))


@gelu_tanh.register_fake
def _(x, bias):
    return torch.empty_like(x)
