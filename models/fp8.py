"""FP8 (e4m3) GEMMs for a UNet's nn.Linear layers through torch._scaled_mm, from calibrated activations (the same
calibration as the INT8 engines': models.quantize's ActivationRecorder and Calibration).

    report = quantize_fp8(unet, calibration)   # the layers that pay become Fp8Linear, in place
    ...fuse LoRA files into the weights...
    requantize_fp8(unet)                       # their FP8 weights again from the (changed) fp16 ones

What is quantized: every nn.Linear (attention projections, feed-forwards, GEGLU's projection, SDXL's and SD 2.x's
linear proj_in/proj_out) except, for the INT8 path's reasons (models.quantize): layers seeing fewer than MIN_ROWS
activation rows per image (the time and added embeddings, each resnet's time projection: one row, a vector product
that FP8 cannot speed up), the cross-attention keys and values (they read the text encoder's outputs, whose outliers
would set the scale of one tensor for all), layers with fewer than MIN_CHANNELS channels in or out, and layers whose
channels are not multiples of GEMM_MULTIPLE (what _scaled_mm takes on the GPU). Convolutions, 1x1 ones included,
attention's own matmuls and the normalizations stay in fp16.

How: scales per tensor for both operands, symmetric e4m3 (scale = largest |value| / E4M3_MAX): the activation's
static, from calibration; the weight's from the weight itself. Per tensor because that is the form _scaled_mm takes
with fp16 output (what the pipeline runs in) on every build, while its row-wise form scales both operands per row (a
per-row activation scale, dynamic) and has written bf16 alone on some builds; e4m3 being floating point (3 mantissa
bits at any magnitude), one scale a tensor costs far less than it does for int8, so no SmoothQuant either. An input
beyond the calibrated range saturates at E4M3_MAX (e4m3fn has no infinity: the clamp says what happens there rather
than leaving it to the cast).

Fp8Linear is an nn.Linear (its class swapped in place): the same `weight` and `bias` Parameters, in fp16, stay the
module's master copy (the state dict keeps its keys; LoRA fusion changes them; requantize refreshes the FP8 copy in
place, so a captured CUDA graph reads the new one), beside non-persistent buffers of the FP8 weight and the scales
(float32: convert it after the module's last cast to its dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from models.quantize import MIN_CHANNELS, MIN_ROWS, Calibration

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
GEMM_MULTIPLE = 16  # _scaled_mm on CUDA takes matrices whose inner and outer sizes are multiples of 16
_TINY = 1e-12  # the smallest amax a scale is made from (an all-zero tensor must not divide by zero)
CROSS_ATTENTION_KV = ("to_k", "to_v")  # a cross-attention's projections of the text encoder's states


def e4m3_scale(amax: float | torch.Tensor) -> torch.Tensor:
    """The per-tensor scale (float32) that maps a largest |value| of `amax` to E4M3_MAX."""
    return torch.as_tensor(amax, dtype=torch.float32).clamp(min=_TINY) / E4M3_MAX


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` / `scale` in e4m3, saturating at +-E4M3_MAX."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


class Fp8Linear(nn.Linear):
    """An nn.Linear computing x @ W^T + b in FP8 (module docstring); made by Fp8Linear.convert, never constructed."""

    weight_e4m3: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor

    @classmethod
    def convert(cls, linear: nn.Linear, input_amax: float) -> Fp8Linear:
        """`linear` itself, made FP8: its input's scale from the calibrated `input_amax`, its weight quantized."""
        linear.__class__ = cls
        device = linear.weight.device
        linear.register_buffer("input_scale", e4m3_scale(input_amax).to(device), persistent=False)
        linear.register_buffer("weight_scale", torch.empty((), dtype=torch.float32, device=device), persistent=False)
        linear.register_buffer("weight_e4m3", torch.empty(linear.weight.shape, dtype=E4M3, device=device),
                               persistent=False)
        linear.requantize()
        return linear

    @torch.no_grad()
    def requantize(self) -> None:
        """The FP8 weight and its scale from `weight` now, in place (the same buffers)."""
        weight = self.weight.detach().float()
        self.weight_scale.copy_(e4m3_scale(weight.abs().amax()))
        self.weight_e4m3.copy_(to_e4m3(weight, self.weight_scale))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.reshape(-1, self.in_features)
        product = torch._scaled_mm(to_e4m3(rows, self.input_scale).contiguous(), self.weight_e4m3.t(),
                                   scale_a=self.input_scale, scale_b=self.weight_scale, bias=self.bias,
                                   out_dtype=input.dtype)
        return product.reshape(*input.shape[:-1], self.out_features)


@dataclass
class Fp8Report:
    """What quantize_fp8 did: the modules made FP8, and the Linear and Conv2d modules kept by reason."""

    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def line(self, stage: str) -> str:
        kept = "; ".join(f"{len(names)} {reason}" for reason, names in self.skipped.items())
        return f"[fp8] {stage}: {len(self.quantized)} Linear in FP8 e4m3, kept in fp16: {kept or 'none'}"

    def as_dict(self) -> dict:
        return {"quantized": len(self.quantized), "skipped": {reason: len(names) for reason, names in
                                                              self.skipped.items()}}


def cross_attention_inputs(component: nn.Module) -> set[str]:
    """The names of the Linear modules that read the text encoder's states: diffusers' cross-attentions' K and V."""
    return {f"{name}.{projection}" for name, module in component.named_modules()
            if getattr(module, "is_cross_attention", False) for projection in CROSS_ATTENTION_KV}


def skip_reason(name: str, linear: nn.Linear, calibration: Calibration, text_readers: set[str]) -> str | None:
    """Why the Linear `name` stays in fp16 (None: it is quantized)."""
    if name in text_readers:
        return "cross-attention K/V (read the text encoder's outputs)"
    stats = calibration.layers.get(name)
    if stats is None:
        return "not calibrated"
    if min(linear.in_features, linear.out_features) < MIN_CHANNELS:
        return f"fewer than {MIN_CHANNELS} channels"
    if linear.in_features % GEMM_MULTIPLE or linear.out_features % GEMM_MULTIPLE:
        return f"channels not multiples of {GEMM_MULTIPLE}"
    if stats.rows < MIN_ROWS:
        return f"fewer than {MIN_ROWS} rows per image (a vector product)"
    return None


CONVOLUTIONS = "convolutions (FP8 covers the Linear GEMMs)"


def quantize_fp8(component: nn.Module, calibration: Calibration) -> Fp8Report:
    """Every Linear of `component` that pays made an Fp8Linear in place, from `calibration` (names as `component`
    names its modules); what was done and kept."""
    report = Fp8Report()
    text_readers = cross_attention_inputs(component)
    for name, module in component.named_modules():
        if isinstance(module, nn.Conv2d):
            report.skipped.setdefault(CONVOLUTIONS, []).append(name)
        if not isinstance(module, nn.Linear) or isinstance(module, Fp8Linear):
            continue
        reason = skip_reason(name, module, calibration, text_readers)
        if reason:
            report.skipped.setdefault(reason, []).append(name)
            continue
        Fp8Linear.convert(module, calibration.layers[name].amax)
        report.quantized.append(name)
    return report


def requantize_fp8(component: nn.Module) -> int:
    """Every Fp8Linear's FP8 weight again from its fp16 weight (after LoRA fusion); how many."""
    layers = [module for module in component.modules() if isinstance(module, Fp8Linear)]
    for layer in layers:
        layer.requantize()
    return len(layers)
