"""Planted faults, for tests only: known-bad changes to the torch backend's UNet or VAE decoder, so that a quality
yardstick can be shown to flag them. Never a flag or a spec field: only the environment variable PLANTED_FAULT_ENV
(a comma list of FAULTS' names) turns them on, and a run with one says so in its report ("planted fault: <name>"
among the backend's options, and in where its settings came from).

- `int8-naive`: every nn.Linear and nn.Conv2d of the UNet fake-quantized, as INT8 without SmoothQuant or calibration:
  weights symmetric per-tensor int8 from their largest |w|, the layer's input symmetric per-tensor int8 with the
  scale from its own largest |x| at each call (quantize-dequantize in float32), the layer run in the module's dtype;
- `attention-no-max`: every attention of the UNet (self and cross) as exp(s) / sum(exp(s)) in float16, without
  subtracting the row maximum (s = q k^T * scale): scores above ln(65504) ~ 11.09 overflow to inf, and inf / inf
  is NaN;
- `vae-scale`: the VAE decoder fed the latents (after the pipeline's 1 / scaling_factor) times 1.05.

backend.settings reads the variable (planted_settings: a bad name is a UsageError naming the accepted ones) into
the settings it returns; TorchStage applies them (plant) to the module it loads, before channels-last and
torch.compile."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import UsageError
from demo.backends.torch.options import TorchSettings
from models import UNET, VAE

PLANTED_FAULT_ENV = "DEMO_DIFFUSION_PLANTED_FAULT"
INT8_NAIVE, ATTENTION_NO_MAX, VAE_SCALE = "int8-naive", "attention-no-max", "vae-scale"
FAULTS = {INT8_NAIVE: UNET, ATTENTION_NO_MAX: UNET, VAE_SCALE: VAE}  # each fault and the stage it changes
VAE_LATENT_SCALE = 1.05
INT8_MAX = 127


def planted_faults(environ=os.environ) -> tuple[str, ...]:
    """The faults the environment asks for, in FAULTS' order (() where the variable is unset or empty)."""
    asked = [name.strip() for name in environ.get(PLANTED_FAULT_ENV, "").split(",") if name.strip()]
    unknown = [name for name in asked if name not in FAULTS]
    if unknown:
        raise UsageError(f"{PLANTED_FAULT_ENV}: unknown planted fault(s) {', '.join(unknown)}; the accepted ones are "
                         f"{', '.join(FAULTS)} (a comma list)")
    return tuple(name for name in FAULTS if name in asked)


@dataclass(frozen=True)
class PlantedSettings(TorchSettings):
    """Torch settings with planted faults (only ever made from the environment: planted_settings)."""

    planted_faults: tuple[str, ...] = ()

    def describe(self) -> str:
        return ", ".join([super().describe(), *fault_options(self)])

    def as_dict(self) -> dict:
        return {**super().as_dict(), "planted_faults": list(self.planted_faults)}


def fault_options(settings) -> tuple[str, ...]:
    """The planted faults of `settings`, as reports list them among the options."""
    return tuple(f"planted fault: {name}" for name in getattr(settings, "planted_faults", ()))


def planted_settings(settings: TorchSettings, source: str, plugins: str) -> tuple[TorchSettings, str]:
    """`settings` (and where they came from) with the faults the environment asks for; unchanged without any.

    Our kernels would bypass the layers the faults change: plugins chosen by default are left out (with a note),
    plugins asked for are a UsageError."""
    faults = planted_faults()
    if not faults:
        return settings, source
    if settings.plugins and plugins != "auto":
        raise UsageError(f"planted faults ({PLANTED_FAULT_ENV}={','.join(faults)}) do not combine with plugins "
                         f"{','.join(settings.plugins)}; use plugins none")
    if settings.plugins:
        source += "; its plugins left out (planted faults)"
    fields = {**asdict(settings), "plugins": ()}
    return (PlantedSettings(**fields, planted_faults=faults),
            f"{source}; planted fault(s) {','.join(faults)} from {PLANTED_FAULT_ENV} (a test-only switch)")


def plant(model, module: nn.Module, settings) -> None:
    """Apply the planted faults of `settings` that change `model`'s stage to its freshly loaded `module`, in place."""
    faults = [name for name in getattr(settings, "planted_faults", ()) if FAULTS[name] == model.name]
    if INT8_NAIVE in faults:
        fake_quantize_int8(model.component_module(module))
    if ATTENTION_NO_MAX in faults:
        model.component_module(module).set_attn_processor(NoMaxAttnProcessor())
    if VAE_SCALE in faults:
        module.register_forward_pre_hook(scale_latents)


# ---- int8-naive ----------------------------------------------------------------------------------------------------

def fake_int8(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` quantized to symmetric per-tensor int8 (scale: its largest |value| / 127) and back, in float32;
    returned in its own dtype."""
    values = tensor.float()
    scale = values.abs().amax().clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    return (values / scale).round().clamp(-INT8_MAX, INT8_MAX).mul(scale).to(tensor.dtype)


class FakeInt8Linear(nn.Linear):
    def forward(self, input):
        return F.linear(fake_int8(input), fake_int8(self.weight), self.bias)


class FakeInt8Conv2d(nn.Conv2d):
    def forward(self, input):
        return self._conv_forward(fake_int8(input), fake_int8(self.weight), self.bias)


FAKE_INT8 = {nn.Linear: FakeInt8Linear, nn.Conv2d: FakeInt8Conv2d}


def fake_quantize_int8(root: nn.Module) -> int:
    """Every nn.Linear and nn.Conv2d in `root` made fake-int8 in place (the same parameters, the same names: only their
    class changes); how many."""
    layers = [module for module in root.modules() if type(module) in FAKE_INT8]
    for module in layers:
        module.__class__ = FAKE_INT8[type(module)]
    return len(layers)


# ---- attention-no-max ----------------------------------------------------------------------------------------------

def attention_without_max(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                          mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with the softmax as exp(s) / sum(exp(s)) in float16, no row maximum taken off;
    the result in value's dtype. (..., Lq, D), (..., Lk, D), (..., Lk, Dv) -> (..., Lq, Dv)."""
    scores = torch.matmul(query.half(), key.half().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.half()
    exp = torch.exp(scores)
    probabilities = exp / exp.sum(dim=-1, keepdim=True)
    return torch.matmul(probabilities.to(value.dtype), value)


class NoMaxAttnProcessor:
    """diffusers' AttnProcessor2_0 with attention_without_max in place of scaled_dot_product_attention."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (hidden_states if encoder_hidden_states is None
                                          else encoder_hidden_states).shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        hidden_states = attention_without_max(query, key, value, attn.scale, attention_mask)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # projection, dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


# ---- vae-scale -----------------------------------------------------------------------------------------------------

def scale_latents(module: nn.Module, inputs: tuple) -> tuple:
    """A forward pre-hook: the VAE decoder stage's latents times VAE_LATENT_SCALE."""
    return (inputs[0] * VAE_LATENT_SCALE, *inputs[1:])
