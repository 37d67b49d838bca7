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

How (symmetric e4m3, scale = largest |value| / E4M3_MAX), three ways to scale (`scales`, FP8_SCALES):
- static (per tensor): the activation's scale from the calibration, fixed; an input beyond the calibrated range
  saturates at E4M3_MAX (e4m3fn has no infinity: the clamp says what happens there rather than leaving it to the
  cast). The weight's from the whole weight.
- dynamic (per tensor): the activation's from each input's own largest |value| (one reduction a call, on the GPU, no
  host sync); nothing saturates. The weight's as static.
- row: each activation row's (token's) scale from that row, each weight row's (output channel's) from that row:
  an outlier token or channel coarsens only its own row; _scaled_mm's row-wise form.
e4m3 being floating point (3 mantissa bits at any magnitude), one scale a tensor costs far less than it does for
int8, so no SmoothQuant either; the layers chosen are the same in every way (the calibration says which see too few
rows to pay).

Fp8Linear is an nn.Linear (its class swapped in place): the same `weight` and `bias` Parameters, in fp16, stay the
module's master copy (the state dict keeps its keys; LoRA fusion changes them; requantize refreshes the FP8 copy in
place, so a captured CUDA graph reads the new one), beside non-persistent buffers of the FP8 weight and the scales
(float32: convert it after the module's last cast to its dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from models.families import DEFAULT_FP8_SCALES, FP8_SCALES
from models.quantize import MIN_CHANNELS, MIN_ROWS, Calibration

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
GEMM_MULTIPLE = 16  # _scaled_mm on CUDA takes matrices whose inner and outer sizes are multiples of 16
_TINY = 1e-12  # the smallest amax a scale is made from (an all-zero tensor must not divide by zero)
CROSS_ATTENTION_KV = ("to_k", "to_v")  # a cross-attention's projections of the text encoder's states


STATIC, DYNAMIC, ROW = FP8_SCALES


def e4m3_scale(amax: float | torch.Tensor) -> torch.Tensor:
    """The scale (float32) that maps a largest |value| of `amax` (a number or a tensor of them) to E4M3_MAX."""
    return torch.as_tensor(amax).float().clamp(min=_TINY) / E4M3_MAX


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` / `scale` in e4m3, saturating at +-E4M3_MAX."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


class Fp8Linear(nn.Linear):
    """An nn.Linear computing x @ W^T + b in FP8 (module docstring); made by Fp8Linear.convert, never constructed."""

    weight_e4m3: torch.Tensor
    weight_scale: torch.Tensor  # () per tensor, (1, out_features) row-wise: the shape _scaled_mm's scale_b takes
    input_scale: torch.Tensor  # static: the calibrated one; otherwise unused (computed from each input)
    scales: str

    @classmethod
    def convert(cls, linear: nn.Linear, input_amax: float, scales: str = DEFAULT_FP8_SCALES) -> Fp8Linear:
        """`linear` itself, made FP8 with `scales` (FP8_SCALES): its input's static scale from the calibrated
        `input_amax`, its weight quantized."""
        if scales not in FP8_SCALES:
            raise ValueError(f"scales must be one of {', '.join(FP8_SCALES)}, got '{scales}'")
        linear.__class__ = cls
        linear.scales = scales
        device = linear.weight.device
        linear.register_buffer("input_scale", e4m3_scale(input_amax).to(device), persistent=False)
        scale_shape = (1, linear.out_features) if scales == ROW else ()
        linear.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=device),
                               persistent=False)
        linear.register_buffer("weight_e4m3", torch.empty(linear.weight.shape, dtype=E4M3, device=device),
                               persistent=False)
        linear.requantize()
        return linear

    @torch.no_grad()
    def requantize(self) -> None:
        """The FP8 weight and its scale from `weight` now, in place (the same buffers)."""
        weight = self.weight.detach().float()
        if self.scales == ROW:  # one scale an output channel: a row of the weight
            self.weight_scale.copy_(e4m3_scale(weight.abs().amax(dim=1)).unsqueeze(0))
            self.weight_e4m3.copy_(to_e4m3(weight, self.weight_scale.t()))
        else:
            self.weight_scale.copy_(e4m3_scale(weight.abs().amax()))
            self.weight_e4m3.copy_(to_e4m3(weight, self.weight_scale))

    def activation_scale(self, rows: torch.Tensor) -> torch.Tensor:
        """The scale of the input `rows` (tokens by in_features): the calibrated one, its amax's, or each row's."""
        if self.scales == STATIC:
            return self.input_scale
        if self.scales == DYNAMIC:
            return e4m3_scale(rows.abs().amax())
        return e4m3_scale(rows.abs().amax(dim=1, keepdim=True))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.reshape(-1, self.in_features)
        scale = self.activation_scale(rows)
        product = torch._scaled_mm(to_e4m3(rows, scale).contiguous(), self.weight_e4m3.t(), scale_a=scale,
                                   scale_b=self.weight_scale, bias=self.bias, out_dtype=input.dtype)
        return product.reshape(*input.shape[:-1], self.out_features)


@dataclass
class Fp8Report:
    """What quantize_fp8 did: the modules made FP8, and the Linear and Conv2d modules kept by reason."""

    scales: str = DEFAULT_FP8_SCALES
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def line(self, stage: str) -> str:
        kept = "; ".join(f"{len(names)} {reason}" for reason, names in self.skipped.items())
        return (f"[fp8] {stage}: {len(self.quantized)} Linear in FP8 e4m3 ({self.scales} scales), kept in fp16: "
                f"{kept or 'none'}")

    def as_dict(self) -> dict:
        return {"scales": self.scales, "quantized": len(self.quantized),
                "skipped": {reason: len(names) for reason, names in self.skipped.items()}}


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


def quantize_fp8(component: nn.Module, calibration: Calibration, scales: str = DEFAULT_FP8_SCALES) -> Fp8Report:
    """Every Linear of `component` that pays made an Fp8Linear in place with `scales`, from `calibration` (names as
    `component` names its modules); what was done and kept."""
    report = Fp8Report(scales)
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
        Fp8Linear.convert(module, calibration.layers[name].amax, scales)
        report.quantized.append(name)
    return report


def requantize_fp8(component: nn.Module) -> int:
    """Every Fp8Linear's FP8 weight again from its fp16 weight (after LoRA fusion); how many."""
    layers = [module for module in component.modules() if isinstance(module, Fp8Linear)]
    for layer in layers:
        layer.requantize()
    return len(layers)
