"""Our CUDA kernels (torch.ops.sdplugins.*) substituted into loaded diffusers / transformers modules.

    report = substitute(module, {"fMHA", "GroupNorm"})   # keys as in plugins.contract.PLUGIN_KEYS
    print(report.line("unet"))

The substitutes use the modules' own parameters (the same Parameter objects, so the state dict keeps
its keys and storage); the one exception is self-attention's packed QKV projection, built once from
to_q/to_k/to_v with its rows interleaved per head ([H, 3, D] as the fMHA kernel reads them) and kept
as a non-persistent buffer beside them (joint attention's from add_q/k/v_proj too; repack_qkv refreshes them
where their weights change). What the
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
| fMHA | SD3's joint `Attention`s (and MMDiT-X's attn2), Flux's `FluxAttention` | processor: packed QKV + fmha |
| RMSNorm | diffusers' `RMSNorm`, `nn.RMSNorm` (SD3.5's and Flux's Q/K norms) | rms_norm |
| AdaLayerNorm | AdaLayerNormZero, SD35AdaLayerNormZeroX, ...ZeroSingle, ...Continuous | ada_layer_norm |
| GeLU | diffusers' `GELU` and `nn.GELU` with approximate="tanh" | (its projection's matmul +) gelu_tanh |

Joint attention projects image and text tokens with their own packed QKV weights, puts Q and K through the
module's norms (rms_norm where RMSNorm is substituted too) and Flux's rotary embedding, joins the tokens as
diffusers does (SD3: image first; Flux: text first), runs one fmha over them and splits the result back.

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


class RMSNorm(nn.Module):
    """diffusers' RMSNorm or nn.RMSNorm (with a weight, no bias) on rms_norm."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        return ops.rms_norm(x.contiguous(), self.weight, self.eps)

    def extra_repr(self):
        return f"{self.weight.numel()}, eps={self.eps}"


class AdaLayerNormZero(nn.Module):
    """AdaLayerNormZero (SD3's and Flux's norm1), SD35AdaLayerNormZeroX (MMDiT-X's: two modulations of one norm)
    and AdaLayerNormZeroSingle (Flux's single-stream blocks): linear(silu(emb)) chunked as they chunk it
    (shift, scale, gate, ...), each normalize-and-modulate one ada_layer_norm; returns what they return."""

    def __init__(self, norm, chunks: int):
        super().__init__()
        self.linear, self.eps, self.chunks = norm.linear, norm.norm.eps, chunks

    def forward(self, x, emb=None):
        x, parts = x.contiguous(), [p.contiguous() for p in self.linear(F.silu(emb)).chunk(self.chunks, dim=1)]
        shift, scale, *rest = parts
        normed = ops.ada_layer_norm(x, scale, shift, self.eps)
        if self.chunks == 9:  # ..., shift_msa2, scale_msa2, gate_msa2: the same norm modulated again for attn2
            shift2, scale2, gate2 = rest[4:]
            return normed, *rest[:4], ops.ada_layer_norm(x, scale2, shift2, self.eps), gate2
        return normed, *rest

    def extra_repr(self):
        return f"{self.chunks} chunks, eps={self.eps}"


class AdaLayerNormContinuous(nn.Module):
    """AdaLayerNormContinuous (SD3's and Flux's norm_out, SD3's last context norm): linear(silu(emb)) as (scale,
    shift), then ada_layer_norm."""

    def __init__(self, norm):
        super().__init__()
        self.linear, self.eps = norm.linear, norm.norm.eps

    def forward(self, x, conditioning_embedding):
        emb = self.linear(F.silu(conditioning_embedding).to(x.dtype))
        scale, shift = (part.contiguous() for part in emb.chunk(2, dim=1))
        return ops.ada_layer_norm(x.contiguous(), scale, shift, self.eps)


class GeLU(nn.Module):
    """diffusers' GELU with approximate="tanh": its projection's matmul, then bias + gelu_tanh in one kernel."""

    def __init__(self, gelu):
        super().__init__()
        self.proj = gelu.proj

    def forward(self, hidden_states):
        return ops.gelu_tanh(F.linear(hidden_states, self.proj.weight).contiguous(), self.proj.bias)


class TanhGeLU(nn.Module):
    """nn.GELU(approximate="tanh") (Flux's single-stream MLP) on gelu_tanh."""

    def forward(self, x):
        return ops.gelu_tanh(x.contiguous(), None)


class JointAttentionProcessor:
    """SD3's JointAttnProcessor2_0 and (`flux`) Flux's FluxAttnProcessor with our fMHA over the joint tokens; every
    step around it is theirs: each token set's packed QKV projection, Q and K through the module's norms, the tokens
    joined (Flux: text first; SD3: image first), Flux's rotary embedding, one fmha at 1/sqrt(D) (what SDPA uses for
    both), the result split back and through the output projections (Flux's single-stream attention has none).

    Calls it was not made for (a mask, arguments it does not know) go to the original processor."""

    def __init__(self, original, heads: int, head_size: int, flux: bool):
        self.original, self.heads, self.head_size, self.flux = original, heads, head_size, flux
        self.scale = head_size ** -0.5

    def _tokens(self, x, weight, bias, norm_q, norm_k):
        """x's packed QKV [B, S, H, 3, D]; with norms, (Q, K, V) [B, S, H, D] each, Q and K normalized."""
        qkv = F.linear(x, weight, bias).unflatten(-1, (self.heads, 3, self.head_size))
        if norm_q is None and norm_k is None:
            return qkv
        q, k, v = qkv.unbind(3)
        return (q if norm_q is None else norm_q(q), k if norm_k is None else norm_k(k), v)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 *args, **kwargs):
        if attention_mask is not None or args or kwargs or (image_rotary_emb is not None and not self.flux):
            rotary = (image_rotary_emb,) if self.flux or image_rotary_emb is not None else ()
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, *rotary, *args, **kwargs)
        image_length = hidden_states.shape[1]
        parts = [self._tokens(hidden_states, attn.sdp_qkv_weight, attn.sdp_qkv_bias, attn.norm_q, attn.norm_k)]
        if encoder_hidden_states is not None:
            text = self._tokens(encoder_hidden_states, attn.sdp_added_qkv_weight, attn.sdp_added_qkv_bias,
                                getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None))
            parts.insert(0 if self.flux else 1, text)
        if image_rotary_emb is None and all(torch.is_tensor(part) for part in parts):
            qkv = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        else:  # Q, K and V one by one: joined, rotated, stacked back into [B, S, H, 3, D]
            parts = [part.unbind(3) if torch.is_tensor(part) else part for part in parts]
            q, k, v = (torch.cat(each, dim=1) if len(each) > 1 else each[0] for each in zip(*parts))
            if image_rotary_emb is not None:
                from diffusers.models.embeddings import apply_rotary_emb

                q, k = (apply_rotary_emb(t, image_rotary_emb, sequence_dim=1) for t in (q, k))
            qkv = torch.stack((q, k, v), dim=3)
        out = ops.fmha(qkv.contiguous(), self.scale).flatten(2, 3)
        if encoder_hidden_states is None:
            return out if self.flux else attn.to_out[1](attn.to_out[0](out))
        text_length = encoder_hidden_states.shape[1]
        if self.flux:
            text, image = out.split_with_sizes([text_length, image_length], dim=1)
        else:
            image, text = out.split_with_sizes([image_length, text_length], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        if attn.context_pre_only and not self.flux:  # SD3's last block: its text tokens' output is not used
            return image, text
        return image, attn.to_add_out(text.contiguous())


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


# The packed QKV buffers beside an attention module's projections: (buffer name, its projections' names).
_PACKED_PROJECTIONS = (("sdp_qkv", ("to_q", "to_k", "to_v")),
                       ("sdp_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))


def _packed_qkv(attn, projections=("to_q", "to_k", "to_v")) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The projections' weights (and biases) with their rows interleaved per head ([H, 3, D]), as fMHA reads them."""
    heads, size = attn.heads, attn.inner_dim // attn.heads

    def packed(tensors):
        return torch.stack([t.view(heads, size, *t.shape[1:]) for t in tensors], dim=1).flatten(0, 2)

    linears = [getattr(attn, name) for name in projections]
    with torch.no_grad():
        weight = packed([p.weight for p in linears])
        bias = packed([p.bias for p in linears]) if linears[0].bias is not None else None
    return weight, bias


def _pack_qkv(attn, buffer="sdp_qkv", projections=("to_q", "to_k", "to_v")) -> int:
    """Register the packed QKV weights (and biases) beside the projections; returns their bytes."""
    weight, bias = _packed_qkv(attn, projections)
    attn.register_buffer(f"{buffer}_weight", weight, persistent=False)
    attn.register_buffer(f"{buffer}_bias", bias, persistent=False)
    return weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())


def repack_qkv(root: nn.Module) -> None:
    """The packed QKV copies made again from the projections' weights, after those changed (a LoRA fused in), in
    place: compiled code and captured CUDA graphs hold the buffers' storage."""
    for module in root.modules():
        for buffer, projections in _PACKED_PROJECTIONS:
            if getattr(module, f"{buffer}_weight", None) is not None:
                weight, bias = _packed_qkv(module, projections)
                with torch.no_grad():
                    getattr(module, f"{buffer}_weight").copy_(weight)
                    if bias is not None:
                        getattr(module, f"{buffer}_bias").copy_(bias)


def _joint_attention_problem(attn, flux: bool) -> str | None:
    """Why fMHA cannot stand in for this joint attention's processor (None: it can)."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    size = attn.inner_dim // attn.heads
    if type(attn.processor) is not (FluxAttnProcessor if flux else JointAttnProcessor2_0):
        return f"processor {type(attn.processor).__name__} is not diffusers' default"
    if size % HEAD_SIZE_MULTIPLE or size > MAX_HEAD_SIZE:
        return f"head size {size} is not a multiple of {HEAD_SIZE_MULTIPLE} up to {MAX_HEAD_SIZE}"
    if getattr(attn, "fused_projections", False):
        return "its projections are fused (to_qkv)"
    if getattr(attn.processor, "_attention_backend", None) is not None or \
            getattr(attn.processor, "_parallel_config", None) is not None:
        return "an attention backend or parallel configuration of its own"
    norms = [getattr(attn, name, None) for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    unknown = {type(n).__name__ for n in norms if n is not None and not _normalizes_last_dimension(n)}
    if unknown:  # the processor calls them on [B, S, H, D], diffusers' on [B, H, S, D]: the same over D only
        return f"q/k norms {', '.join(sorted(unknown))} not known to normalize over the head's dimension alone"
    return None


def _normalizes_last_dimension(norm: nn.Module) -> bool:
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm, DiffusersRMSNorm)):
        return len(norm.normalized_shape if hasattr(norm, "normalized_shape") else norm.dim) == 1
    return isinstance(norm, RMSNorm)


def _substitute_joint_attention(root: nn.Module, report: Substitution) -> None:
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_flux import FluxAttention

    for name, module in root.named_modules():
        flux = isinstance(module, FluxAttention)
        if not flux and not (isinstance(module, Attention) and _is_joint(module)):
            continue
        problem = _joint_attention_problem(module, flux)
        if problem:
            report.skip("fMHA", name, problem)
            continue
        for buffer, projections in _PACKED_PROJECTIONS:
            if getattr(module, projections[0], None) is not None:
                report.packed_bytes += _pack_qkv(module, buffer, projections)
        module.set_processor(JointAttentionProcessor(module.processor, module.heads, module.inner_dim // module.heads,
                                                     flux))
        report.replaced["fMHA"] += 1


def _is_joint(attn) -> bool:
    """SD3's attention (its processor JointAttnProcessor2_0): _substitute_joint_attention's."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    return type(attn.processor) is JointAttnProcessor2_0


def _substitute_attention(root: nn.Module, report: Substitution, cross: bool) -> None:
    from diffusers.models.attention_processor import Attention

    family = "fMHCA" if cross else "fMHA"
    for name, module in root.named_modules():
        if not cross and type(module).__name__ == "CLIPAttention":
            report.skip(family, name, "CLIP's causal self-attention (the kernel takes no mask)")
        if not isinstance(module, Attention) or module.is_cross_attention != cross or _is_joint(module):
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


def _substitute_rms_norm(root: nn.Module, report: Substitution) -> None:
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    for name, module in list(root.named_modules()):
        if type(module) not in (DiffusersRMSNorm, nn.RMSNorm):
            continue
        if module.weight is None:
            report.skip("RMSNorm", name, "no weight")
        elif getattr(module, "bias", None) is not None:
            report.skip("RMSNorm", name, "a bias after the weight")
        elif module.eps is None:
            report.skip("RMSNorm", name, "no epsilon (nn.RMSNorm's is then its dtype's)")
        elif module.weight.dim() != 1:
            report.skip("RMSNorm", name, f"normalizes over {module.weight.dim()} dimensions, not the last one")
        else:
            _replace(root, name, RMSNorm(module))
            report.replaced["RMSNorm"] += 1


def _ada_norm_problem(module) -> str | None:
    norm = getattr(module, "norm", None)
    if getattr(module, "emb", None) is not None:
        return "embeds its own timestep and class labels"
    if type(norm) is not nn.LayerNorm:
        return f"its norm is {type(norm).__name__}, not a LayerNorm"
    if norm.weight is not None or norm.bias is not None:
        return "its LayerNorm has an affine weight or bias of its own"
    if type(getattr(module, "silu", None)) is not nn.SiLU:
        return "its activation is not a SiLU"
    return None


def _substitute_ada_layer_norm(root: nn.Module, report: Substitution) -> None:
    from diffusers.models import normalization as norms
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    chunks = {norms.AdaLayerNormZero: 6, norms.SD35AdaLayerNormZeroX: 9, norms.AdaLayerNormZeroSingle: 3}
    for name, module in list(root.named_modules()):
        prefix = f"{name}." if name else ""
        if type(module) in (JointTransformerBlock, FluxTransformerBlock):
            for inline in ("norm2", "norm2_context"):
                if getattr(module, inline, None) is not None:
                    report.skip("AdaLayerNorm", prefix + inline,
                                f"modulated inline by {type(module).__name__}.forward, not by an AdaLN module")
        if type(module) not in (*chunks, norms.AdaLayerNormContinuous):
            continue
        problem = _ada_norm_problem(module)
        if problem:
            report.skip("AdaLayerNorm", name, problem)
            continue
        continuous = type(module) is norms.AdaLayerNormContinuous
        _replace(root, name, AdaLayerNormContinuous(module) if continuous else AdaLayerNormZero(module,
                                                                                                chunks[type(module)]))
        report.replaced["AdaLayerNorm"] += 1


def _substitute_gelu(root: nn.Module, report: Substitution) -> None:
    from diffusers.models.activations import GELU

    for name, module in list(root.named_modules()):
        if type(module) not in (GELU, nn.GELU):
            continue
        if module.approximate != "tanh":
            report.skip("GeLU", name, f"approximate={module.approximate!r}: the kernel is the tanh approximation")
            continue
        _replace(root, name, GeLU(module) if type(module) is GELU else TanhGeLU())
        report.replaced["GeLU"] += 1


def substitute(root: nn.Module, plugins, channels_last: bool = False) -> Substitution:
    """Put the kernels of `plugins` (family keys) into `root` in place; returns what was done.

    `channels_last`: the module will run on channels-last memory (Seq2Spatial then has nothing to do)."""
    unknown = set(plugins) - set(PLUGIN_KEYS)
    if unknown:
        raise ValueError(f"unknown plugin families {sorted(unknown)}; known: {', '.join(PLUGIN_KEYS)}")
    report = Substitution()
    if "fMHA" in plugins:
        _substitute_attention(root, report, cross=False)
        _substitute_joint_attention(root, report)
    if "fMHCA" in plugins:
        _substitute_attention(root, report, cross=True)
    if "GroupNorm" in plugins:
        _substitute_group_norm(root, report)
    if "AdaLayerNorm" in plugins:  # before LayerNorm: the AdaLN modules take their LayerNorms with them
        _substitute_ada_layer_norm(root, report)
    if "LayerNorm" in plugins:
        _substitute_layer_norm(root, report)
    if "SplitGeLU" in plugins:
        _substitute_split_gelu(root, report)
    if "Seq2Spatial" in plugins:
        _substitute_seq2spatial(root, report, channels_last)
    if "RMSNorm" in plugins:
        _substitute_rms_norm(root, report)
    if "GeLU" in plugins:
        _substitute_gelu(root, report)
    return report
