"""The transformers (MMDiT) of SD3 and Flux: noisy latents, timestep, the text's states and its pooled projections (and
Flux [dev]'s guidance scale; with ControlNets, the samples they add to its blocks: models.flow_controlnet) -> the flow
they predict (the velocity the flow-matching scheduler steps along)."""

from __future__ import annotations

import torch

from models import FLUX_TRANSFORMER, TRANSFORMER
from models.base import ONNX_OPSET, StageModel
from models.unet import LATENT

# The inputs of a transformer steered by ControlNets, beside its own: the samples added to its blocks, in order
# (CONTROL_BLOCK: SD3's joint blocks, Flux's double-stream ones; CONTROL_SINGLE_BLOCK: Flux's single-stream ones).
CONTROL_BLOCK, CONTROL_SINGLE_BLOCK = "controlnet_block", "controlnet_single_block"


def control_names(kind: str, count: int) -> tuple[str, ...]:
    """The names of `count` control samples of `kind` (CONTROL_BLOCK or CONTROL_SINGLE_BLOCK): kind_0, kind_1, ..."""
    return tuple(f"{kind}_{index}" for index in range(count))


def of_kind(names: tuple[str, ...], kind: str) -> tuple[int, ...]:
    """The positions in `names` of the control samples of `kind`."""
    return tuple(index for index, name in enumerate(names) if name.rsplit("_", 1)[0] == kind)


class _FlowPrediction(torch.nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, *control_blocks):
        # One timestep for the whole batch: its embedding broadcasts over the batch's pooled projections, the same
        # sum diffusers' pipelines get from the timestep expanded to the batch.
        return self.transformer(hidden_states=hidden_states, timestep=timestep,
                                encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                                block_controlnet_hidden_states=list(control_blocks) or None, return_dict=False)[0]


class _FlowTransformerModel(StageModel):
    """What SD3's and Flux's transformer stages share: their inputs and output, and a timestep of sigmas x 1000."""

    label = "Transformer"
    component = "transformer"
    input_names = ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")
    output_names = (LATENT,)
    dynamic_axes = {"hidden_states": {0: "B", 2: "latent_height", 3: "latent_width"},
                    "encoder_hidden_states": {0: "B"}, "pooled_projections": {0: "B"},
                    LATENT: {0: "B", 2: "latent_height", 3: "latent_width"}}

    def __init__(self, source, controls: tuple[str, ...] = (), control_width: int = 0):
        """`controls`: the ControlNet samples it takes (their stages' outputs, added up), each `control_width` wide."""
        super().__init__(source)
        self.controls, self.control_width = controls, control_width
        self.own_inputs = self.input_names
        self.input_names = (*self.input_names, *controls)
        self.dynamic_axes = {**self.dynamic_axes, **{name: {0: "B", 1: "tokens"} for name in controls}}

    def tokens(self, height: int, width: int) -> int:
        """The image's tokens at this size: its latents in patches a side (the transformer's, or Flux's packing)."""
        patch = self.source.family.packed_latents or self.config["patch_size"]
        rows, columns = self.latent_size(height, width)
        return (rows // patch) * (columns // patch)

    def control_shapes(self, batch: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        return {name: (batch, self.tokens(height, width), self.control_width) for name in self.controls}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        inputs["timestep"] = (torch.rand((1,), generator=generator) * 1000).to(device)
        return inputs

    def component_module(self, module):
        return module.transformer

    def component_skeleton(self):
        return self.meta_module().transformer


class SD3TransformerModel(_FlowTransformerModel):
    name = TRANSFORMER

    @property
    def text_length(self) -> int:
        """The text's tokens: the CLIP encoders' (side by side), then T5's (zeros where the model has no T5)."""
        return self.source.text_length + self.source.family.t5_length

    def input_shapes(self, batch, height, width):
        return {"hidden_states": (batch, self.config["in_channels"], *self.latent_size(height, width)),
                "timestep": (1,),
                "encoder_hidden_states": (batch, self.text_length, self.config["joint_attention_dim"]),
                "pooled_projections": (batch, self.config["pooled_projection_dim"]),
                **self.control_shapes(batch, height, width)}

    def output_shapes(self, batch, height, width):
        return {LATENT: (batch, self.config["out_channels"], *self.latent_size(height, width))}

    def input_dtypes(self, dtype):
        # Timesteps are sigmas times 1000, fractional: kept in float32.
        return {**{name: dtype for name in self.input_names}, "timestep": torch.float32}

    def load_module(self):
        from diffusers import SD3Transformer2DModel

        return _FlowPrediction(SD3Transformer2DModel.from_pretrained(self.source.component_dir(self.component)))

    def meta_module(self):
        from diffusers import SD3Transformer2DModel

        with torch.device("meta"):
            return _FlowPrediction(SD3Transformer2DModel.from_config(self.config))


GUIDANCE = "guidance"  # Flux [dev]'s input: the guidance scale its transformer embeds (FLUX.1 [schnell] takes none)


def packed(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """Latents [B, C, H, W] packed into tokens of patch x patch latents [B, H/p * W/p, C * p * p], as FluxPipeline's
    _pack_latents."""
    batch, channels, height, width = latents.shape
    p, rows, columns = patch, height // patch, width // patch
    tokens = latents.view(batch, channels, rows, p, columns, p).permute(0, 2, 4, 1, 3, 5)
    return tokens.reshape(batch, rows * columns, channels * p * p)


def unpacked(tokens: torch.Tensor, shape: torch.Size, patch: int) -> torch.Tensor:
    """Tokens [B, H/p * W/p, C * p * p] back to latents of `shape` [B, C, H, W], as FluxPipeline's _unpack_latents."""
    batch, channels, height, width = shape
    latents = tokens.view(batch, height // patch, width // patch, channels, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(batch, channels, height, width)


def flux_positions(latents: torch.Tensor, text: torch.Tensor, patch: int) -> dict[str, torch.Tensor]:
    """The positions of the image's tokens (their row and column) and the text's (zeros), as FluxPipeline makes them
    and Flux's transformer and ControlNets take them."""
    rows, columns = latents.shape[2] // patch, latents.shape[3] // patch
    image_ids = torch.zeros(rows, columns, 3, dtype=latents.dtype, device=latents.device)
    image_ids[..., 1] += torch.arange(rows, device=latents.device)[:, None]
    image_ids[..., 2] += torch.arange(columns, device=latents.device)[None, :]
    return {"txt_ids": text.new_zeros(text.shape[1], 3), "img_ids": image_ids.reshape(rows * columns, 3)}


def flux_time(timestep: torch.Tensor, latents: torch.Tensor, guidance: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The timestep in thousandths, one a row (diffusers' pipeline hands it over so, and the model multiplies it
    back), and the guidance scale, one a row (None: the model embeds none), as Flux's models take them."""
    batch = latents.shape[0]
    return {"timestep": (timestep / 1000).expand(batch).to(latents.dtype),
            "guidance": None if guidance is None else guidance.expand(batch)}


class _PackedFlowPrediction(torch.nn.Module):
    """Flux's transformer on latents as the VAE makes them: packed into tokens of 2x2 latents and back, with the
    positions of the image's tokens and the text's (flux_positions), as diffusers' FluxPipeline makes them (and the
    ControlNets' samples, `controls` of them after the guidance scale, where it takes one). Inside the stage, so that
    the pipeline's latents, noise and image-to-image are SD3's."""

    def __init__(self, transformer, patch: int, guided: bool = False, controls: tuple[str, ...] = ()):
        super().__init__()
        self.transformer, self.patch, self.guided = transformer, patch, guided
        self.blocks, self.single_blocks = of_kind(controls, CONTROL_BLOCK), of_kind(controls, CONTROL_SINGLE_BLOCK)

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, *rest):
        guidance, controls = (rest[0], rest[1:]) if self.guided else (None, rest)
        p = self.patch
        flow = self.transformer(
            hidden_states=packed(hidden_states, p), **flux_time(timestep, hidden_states, guidance),
            pooled_projections=pooled_projections, encoder_hidden_states=encoder_hidden_states,
            **flux_positions(hidden_states, encoder_hidden_states, p),
            controlnet_block_samples=[controls[index] for index in self.blocks] or None,
            controlnet_single_block_samples=[controls[index] for index in self.single_blocks] or None,
            return_dict=False)[0]
        return unpacked(flow, hidden_states.shape, p)


class _DecomposedRMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm as torch computes it (in float32 for half inputs, scaled by its weight, then cast back), in ops
    that ONNX opset 17 has: aten::rms_norm exports only at opset 23 (RMSNormalization), which no TensorRT flavour
    here takes. The same weight (the module's own parameter), so the export's initializers are the checkpoint's."""

    def __init__(self, norm: torch.nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x):
        wide = x.float()
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        return (normed if self.weight is None else normed * self.weight.float()).to(x.dtype)


def _decompose_rms_norms(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with each torch.nn.RMSNorm in it replaced by _DecomposedRMSNorm, in place."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.RMSNorm):
            setattr(module, name, _DecomposedRMSNorm(child))
        else:
            _decompose_rms_norms(child)
    return module


def _traced_rotary_embedding(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' apply_rotary_emb as Flux's attention calls it (real cos and sin, pairs interleaved along the last
    axis), the pairs split by unflatten: diffusers' own reshape to `(*x.shape[:-1], -1, 2)` traces as constants, the
    export's batch and token count baked into the graph."""
    if not use_real or use_real_unbind_dim != -1 or sequence_dim not in (1, 2):
        raise NotImplementedError(f"rotary embedding use_real={use_real}, unbind_dim={use_real_unbind_dim}, "
                                  f"sequence_dim={sequence_dim}: not how Flux's attention calls it")
    cos, sin = freqs_cis
    cos, sin = (cos[None, :, None], sin[None, :, None]) if sequence_dim == 1 else (cos[None, None], sin[None, None])
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos.to(x.device) + rotated.float() * sin.to(x.device)).to(x.dtype)


class FluxTransformerModel(_FlowTransformerModel):
    name = FLUX_TRANSFORMER

    def __init__(self, source, controls: tuple[str, ...] = (), control_width: int = 0):
        super().__init__(source, controls, control_width)
        self.guided = bool(self.config.get(source.family.guidance_key))  # [dev]: the scale embedded
        if self.guided:  # after its own inputs, before the ControlNets' samples
            self.own_inputs = (*self.own_inputs, GUIDANCE)
            self.input_names = (*self.own_inputs, *controls)

    def input_shapes(self, batch, height, width):
        latents = self.source.latent_shape(batch, height, width)
        shapes = {"hidden_states": latents, "timestep": (1,),
                  "encoder_hidden_states": (batch, self.source.family.t5_length, self.config["joint_attention_dim"]),
                  "pooled_projections": (batch, self.config["pooled_projection_dim"]),
                  **({GUIDANCE: (1,)} if self.guided else {})}
        return {**shapes, **self.control_shapes(batch, height, width)}  # in input_names' order

    def output_shapes(self, batch, height, width):
        return {LATENT: self.source.latent_shape(batch, height, width)}

    def input_dtypes(self, dtype):
        # The timestep (sigmas times 1000, fractional) and the guidance scale stay in float32, as diffusers' are.
        return {name: torch.float32 if name in ("timestep", GUIDANCE) else dtype for name in self.input_names}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        if GUIDANCE in inputs:
            inputs[GUIDANCE] = torch.full((1,), 3.5, device=device)
        return inputs

    def load_module(self):
        from diffusers import FluxTransformer2DModel

        transformer = FluxTransformer2DModel.from_pretrained(self.source.component_dir(self.component))
        return _PackedFlowPrediction(transformer, self.source.family.packed_latents, self.guided, self.controls)

    def export_module(self):
        # Flux's attention normalizes its queries and keys with torch.nn.RMSNorm
        return _decompose_rms_norms(self.load_module())

    def export_onnx(self, path, device, dtype, opset=ONNX_OPSET):
        from unittest import mock

        from diffusers.models.transformers import transformer_flux

        # for the trace alone: the module's attention reads the function from its module's namespace
        with mock.patch.object(transformer_flux, "apply_rotary_emb", _traced_rotary_embedding):
            super().export_onnx(path, device, dtype, opset)

    def meta_module(self):
        from diffusers import FluxTransformer2DModel

        with torch.device("meta"):
            return _PackedFlowPrediction(FluxTransformer2DModel.from_config(self.config),
                                         self.source.family.packed_latents, self.guided, self.controls)
