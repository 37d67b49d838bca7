"""Our CUDA kernels (torch.ops.sdplugins.*) substituted into loaded diffusers / transformers modules.

    report = substitute(module, {"fMHA", "GroupNorm"})   # keys as in plugins.contract.PLUGIN_KEYS
    print(report.line("unet"))

The substitutes use the modules' own parameters (the same Parameter objects, so the state dict keeps
its keys and storage); the one exception is self-attention's packed QKV projection, built once from
to_q/to_k/to_v with its rows interleaved per head ([H, 3, D] as the fMHA kernel reads them) and kept
as a non-persistent buffer beside them (repack_qkv refreshes it where their weights change). What the
kernels cannot take stays as it is and is reported as skipped with its reason, like the ONNX plugin
passes do:

| key | module | becomes |
| --- | --- | --- |
| fMHA | diffusers `Attention` without encoder states (self-attention) | processor: packed QKV matmul + fmha |
| fMHCA | diffusers `Attention` with encoder states (cross-attention) | processor: Q matmul, stacked K/V + fmhca |
| GroupNorm | `nn.GroupNorm`; in `ResnetBlock2D` and before `conv_act` the SiLU after it too | group_norm (silu) |
| LayerNorm | `nn.LayerNorm` over the last dimension (UNet transformers and CLIP) | layer_norm |
| SplitGeLU | diffusers `GEGLU` | its projection + split_gelu |
| Seq2Spatial | `Transformer2DModel` output: proj_out, bias, to NCHW, + residual | proj_out's matmul + seq2spatial |

The kernels run fp16 CUDA tensors; the tests run these modules on the CPU with float32 reference
kernels registered for the same ops.
"""

from __future__ import annotations

import math
import types
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from plugins import torch_ops  # noqa: F401  (registers the ops)
from plugins.contract import HEAD_SIZE_MULTIPLE, LAYOUT_NCHW, MAX_HEAD_SIZE, PLUGIN_KEYS, TORCH_OP_NAMESPACE

ops = getattr(torch.ops, TORCH_OP_NAMESPACE)


@dataclass
class Substitution:
    """What substitute() replaced and skipped (with reasons), per family."""

    replaced: Counter = field(default_factory=Counter)
    skipped: dict[str, list[str]] = field(default_factory=lambda: {key: [] for key in PLUGIN_KEYS})
    silu_folded: int = 0  # GroupNorms that took the SiLU after them
    packed_bytes: int = 0  # the packed QKV weights self-attention reads (the one copy made)

    def skip(self, family: str, name: str, reason: str) -> None:
        self.skipped[family].append(f"{name or '(root)'}: {reason}")

    def as_dict(self) -> dict[str, dict]:
        """{"<key>": {"replaced": N, "skipped": M, "skipped_reasons": [...]}}, the ONNX pass report's shape."""
        return {key: {"replaced": self.replaced[key], "skipped": len(self.skipped[key]),
                      "skipped_reasons": list(self.skipped[key])} for key in PLUGIN_KEYS}

    def line(self, stage: str) -> str:
        parts = []
        for key in PLUGIN_KEYS:
            text = f"{key} {self.replaced[key]}"
            if key == "GroupNorm" and self.silu_folded:
                text += f" ({self.silu_folded} with SiLU)"
            if self.skipped[key]:
                text += f" (skipped {len(self.skipped[key])})"
            parts.append(text)
        return f"[plugins] {stage}: " + ", ".join(parts)


# ---- the substitutes ---------------------------------------------------------------------------------

class GroupNorm(nn.Module):
    """nn.GroupNorm (+ the SiLU after it) on group_norm; NCHW or channels-last memory, read as it is."""

    def __init__(self, norm: nn.GroupNorm, silu: bool):
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias
        self.num_groups, self.eps, self.silu = norm.num_groups, norm.eps, silu

    def forward(self, x):
        if not x.is_contiguous() and x.movedim(1, -1).is_contiguous():  # channels-last memory
            y = ops.group_norm(x.movedim(1, -1), self.weight, self.bias, self.num_groups, self.eps, self.silu, True)
            return y.movedim(-1, 1)
        return ops.group_norm(x.contiguous(), self.weight, self.bias, self.num_groups, self.eps, self.silu, False)

    def extra_repr(self):
        return f"{self.num_groups}, {self.weight.numel()}, eps={self.eps}, silu={self.silu}"


class SiLULinear(nn.Module):
    """SiLU then a Linear's own weight and bias: where ResnetBlock2D applied its (folded) SiLU to temb."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return F.linear(F.silu(x), self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x):
        return ops.layer_norm(x.contiguous(), self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.weight.numel()}, eps={self.eps}"


class SplitGeLU(nn.Module):
    """diffusers' GEGLU: its projection, then value * gelu(gate) in one kernel."""

    def __init__(self, geglu):
        super().__init__()
        self.proj = geglu.proj

    def forward(self, hidden_states, *args, **kwargs):
        return ops.split_gelu(self.proj(hidden_states).contiguous(), None)


class AttentionProcessor:
    """diffusers' AttnProcessor2_0 with our kernel in place of SDPA; every step around it is the same.

    Calls it was not made for (a mask, temb, the other kind of attention) go to the original processor."""

    def __init__(self, original, cross: bool, heads: int, head_size: int):
        self.original, self.cross, self.heads, self.head_size = original, cross, heads, head_size
        self.scale = head_size ** -0.5  # what SDPA uses by default, as AttnProcessor2_0 calls it

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        if attention_mask is not None or temb is not None or args or kwargs \
                or (encoder_hidden_states is not None) != self.cross:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        residual = hidden_states
        spatial = hidden_states.ndim == 4
        if spatial:
            batch, channels, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        batch, length, _ = hidden_states.shape
        heads, size = self.heads, self.head_size
        if self.cross:
            q = attn.to_q(hidden_states).view(batch, length, heads, size)
            keys = encoder_hidden_states.shape[1]
            kv = torch.stack((attn.to_k(encoder_hidden_states).view(batch, keys, heads, size),
                              attn.to_v(encoder_hidden_states).view(batch, keys, heads, size)), dim=3)
            out = ops.fmhca(q, kv, self.scale)
        else:
            qkv = F.linear(hidden_states, attn.sdp_qkv_weight, attn.sdp_qkv_bias)
            out = ops.fmha(qkv.view(batch, length, heads, 3, size), self.scale)
        hidden_states = attn.to_out[1](attn.to_out[0](out.reshape(batch, length, heads * size)))
        if spatial:
            hidden_states = hidden_states.transpose(-1, -2).reshape(residual.shape)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        if attn.rescale_output_factor != 1:
            hidden_states = hidden_states / attn.rescale_output_factor
        return hidden_states


def _seq2spatial_output(self, hidden_states, residual, batch_size, height, width, inner_dim):
    """Transformer2DModel's output for continuous inputs: proj_out (1x1 conv or linear, the same matrix)
    on the sequence, then its bias, the transpose to NCHW and the residual in one kernel."""
    weight = self.proj_out.weight
    sequence = F.linear(hidden_states, weight.view(weight.shape[0], -1))
    return ops.seq2spatial(sequence, self.proj_out.bias, residual.contiguous(), LAYOUT_NCHW, height)


# ---- finding what to substitute -----------------------------------------------------------------------

def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(root.get_submodule(parent), attribute, new)


def _attention_problem(attn, cross: bool) -> str | None:
    """Why our attention kernels cannot stand in for this Attention's processor (None: they can)."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    size = attn.inner_dim // attn.heads
    if type(attn.processor) not in (AttnProcessor, AttnProcessor2_0):
        return f"processor {type(attn.processor).__name__} is not diffusers' default"
    if size % HEAD_SIZE_MULTIPLE or size > MAX_HEAD_SIZE:
        return f"head size {size} is not a multiple of {HEAD_SIZE_MULTIPLE} up to {MAX_HEAD_SIZE}"
    extras = [what for what, present in (
        ("a spatial norm", attn.spatial_norm is not None), ("q/k norms", attn.norm_q is not None),
        ("a cross-attention norm", attn.norm_cross is not None), ("added K/V projections", attn.add_k_proj is not None),
        ("causal masking", attn.is_causal), ("key/value heads of its own", attn.inner_kv_dim != attn.inner_dim),
        ("only cross-attention", attn.only_cross_attention)) if present]
    if extras:
        return "has " + ", ".join(extras)
    if not math.isclose(attn.scale, size ** -0.5, rel_tol=1e-6):
        return f"attention scale {attn.scale} is not 1/sqrt({size})"
    if not cross and attn.to_k.in_features != attn.to_q.in_features:
        return "self-attention whose keys come from another width"
    return None


def _packed_qkv(attn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """to_q/to_k/to_v's weights (and biases) with their rows interleaved per head ([H, 3, D]), as fMHA reads them."""
    heads, size = attn.heads, attn.inner_dim // attn.heads

    def packed(tensors):
        return torch.stack([t.view(heads, size, *t.shape[1:]) for t in tensors], dim=1).flatten(0, 2)

    projections = (attn.to_q, attn.to_k, attn.to_v)
    with torch.no_grad():
        weight = packed([p.weight for p in projections])
        bias = packed([p.bias for p in projections]) if attn.to_q.bias is not None else None
    return weight, bias


def _pack_qkv(attn) -> int:
    """Register the packed QKV weights (and biases) beside the projections; returns their bytes."""
    weight, bias = _packed_qkv(attn)
    attn.register_buffer("sdp_qkv_weight", weight, persistent=False)
    attn.register_buffer("sdp_qkv_bias", bias, persistent=False)
    return weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())


def repack_qkv(root: nn.Module) -> None:
    """The packed QKV copies made again from the projections' weights, after those changed (a LoRA fused in), in
    place: compiled code and captured CUDA graphs hold the buffers' storage."""
    for module in root.modules():
        if getattr(module, "sdp_qkv_weight", None) is not None:
            weight, bias = _packed_qkv(module)
            with torch.no_grad():
                module.sdp_qkv_weight.copy_(weight)
                if bias is not None:
                    module.sdp_qkv_bias.copy_(bias)


def _substitute_attention(root: nn.Module, report: Substitution, cross: bool) -> None:
    from diffusers.models.attention_processor import Attention

    family = "fMHCA" if cross else "fMHA"
    for name, module in root.named_modules():
        if not cross and type(module).__name__ == "CLIPAttention":
            report.skip(family, name, "CLIP's causal self-attention (the kernel takes no mask)")
        if not isinstance(module, Attention) or module.is_cross_attention != cross:
            continue
        problem = _attention_problem(module, cross)
        if problem:
            report.skip(family, name, problem)
            continue
        size = module.inner_dim // module.heads
        if not cross:
            report.packed_bytes += _pack_qkv(module)
        module.set_processor(AttentionProcessor(module.processor, cross, module.heads, size))
        report.replaced[family] += 1


def _substitute_group_norm(root: nn.Module, report: Substitution) -> None:
    from diffusers.models.resnet import ResnetBlock2D

    silu_after: set[str] = set()  # GroupNorms whose following SiLU is folded into them
    for name, module in list(root.named_modules()):
        prefix = f"{name}." if name else ""
        if type(module) is ResnetBlock2D and type(module.nonlinearity) is nn.SiLU \
                and module.time_embedding_norm != "scale_shift" and all(
                    type(norm) is nn.GroupNorm and norm.affine for norm in (module.norm1, module.norm2)):
            # norm1 -> SiLU and norm2 -> SiLU become fused norms; the SiLU it also applied to temb
            # moves in front of the time embedding projection.
            module.nonlinearity = nn.Identity()
            if module.time_emb_proj is not None and not module.skip_time_act:
                module.time_emb_proj = SiLULinear(module.time_emb_proj)
            silu_after |= {prefix + "norm1", prefix + "norm2"}
        elif type(getattr(module, "conv_norm_out", None)) is nn.GroupNorm and module.conv_norm_out.affine \
                and type(getattr(module, "conv_act", None)) is nn.SiLU:
            module.conv_act = nn.Identity()
            silu_after.add(prefix + "conv_norm_out")
    for name, module in list(root.named_modules()):
        if type(module) is not nn.GroupNorm:
            continue
        if not module.affine:
            report.skip("GroupNorm", name, "no affine weight and bias")
            continue
        _replace(root, name, GroupNorm(module, silu=name in silu_after))
        report.replaced["GroupNorm"] += 1
        report.silu_folded += name in silu_after


def _substitute_layer_norm(root: nn.Module, report: Substitution) -> None:
    for name, module in list(root.named_modules()):
        if type(module) is not nn.LayerNorm:
            continue
        if module.weight is None or module.bias is None:
            report.skip("LayerNorm", name, "no affine weight and bias")
        elif len(module.normalized_shape) != 1:
            report.skip("LayerNorm", name,
                        f"normalizes over {len(module.normalized_shape)} dimensions, not the last one")
        else:
            _replace(root, name, LayerNorm(module))
            report.replaced["LayerNorm"] += 1


def _substitute_split_gelu(root: nn.Module, report: Substitution) -> None:
    from diffusers.models.activations import GEGLU

    for name, module in list(root.named_modules()):
        if type(module) is GEGLU:
            _replace(root, name, SplitGeLU(module))
            report.replaced["SplitGeLU"] += 1


def _substitute_seq2spatial(root: nn.Module, report: Substitution, channels_last: bool) -> None:
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    for name, module in root.named_modules():
        if type(module) is not Transformer2DModel:
            continue
        proj = getattr(module, "proj_out", None)
        if channels_last:
            problem = "channels-last memory: back to NCHW is a view there, nothing for the kernel to fuse"
        elif not module.is_input_continuous:
            problem = "input is not a continuous feature map"
        elif isinstance(proj, nn.Conv2d) and (proj.kernel_size != (1, 1) or proj.stride != (1, 1) or proj.groups != 1
                                              or proj.padding != (0, 0)):
            problem = "proj_out is not a 1x1 convolution"
        elif not isinstance(proj, (nn.Conv2d, nn.Linear)) or proj.bias is None:
            problem = "proj_out is not a linear map with a bias"
        else:
            problem = None
        if problem:
            report.skip("Seq2Spatial", name, problem)
            continue
        module._get_output_for_continuous_inputs = types.MethodType(_seq2spatial_output, module)
        report.replaced["Seq2Spatial"] += 1


def substitute(root: nn.Module, plugins, channels_last: bool = False) -> Substitution:
    """Put the kernels of `plugins` (family keys) into `root` in place; returns what was done.

    `channels_last`: the module will run on channels-last memory (Seq2Spatial then has nothing to do)."""
    unknown = set(plugins) - set(PLUGIN_KEYS)
    if unknown:
        raise ValueError(f"unknown plugin families {sorted(unknown)}; known: {', '.join(PLUGIN_KEYS)}")
    report = Substitution()
    if "fMHA" in plugins:
        _substitute_attention(root, report, cross=False)
    if "fMHCA" in plugins:
        _substitute_attention(root, report, cross=True)
    if "GroupNorm" in plugins:
        _substitute_group_norm(root, report)
    if "LayerNorm" in plugins:
        _substitute_layer_norm(root, report)
    if "SplitGeLU" in plugins:
        _substitute_split_gelu(root, report)
    if "Seq2Spatial" in plugins:
        _substitute_seq2spatial(root, report, channels_last)
    return report
