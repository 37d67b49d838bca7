"""The transformers (MMDiT) of SD3 and Flux: noisy latents, timestep, the text's states and its pooled projections (and
Flux [dev]'s guidance scale) -> the flow they predict (the velocity the flow-matching scheduler steps along)."""

from __future__ import annotations

import torch

from models import FLUX_TRANSFORMER, TRANSFORMER
from models.base import StageModel
from models.unet import LATENT


class _FlowPrediction(torch.nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections):
        # One timestep for the whole batch: its embedding broadcasts over the batch's pooled projections, the same
        # sum diffusers' pipelines get from the timestep expanded to the batch.
        return self.transformer(hidden_states=hidden_states, timestep=timestep,
                                encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                                return_dict=False)[0]


class _FlowTransformerModel(StageModel):
    """What SD3's and Flux's transformer stages share: their inputs and output, and a timestep of sigmas x 1000."""

    label = "Transformer"
    component = "transformer"
    input_names = ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")
    output_names = (LATENT,)
    dynamic_axes = {"hidden_states": {0: "B", 2: "latent_height", 3: "latent_width"},
                    "encoder_hidden_states": {0: "B"}, "pooled_projections": {0: "B"},
                    LATENT: {0: "B", 2: "latent_height", 3: "latent_width"}}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        inputs["timestep"] = (torch.rand((1,), generator=generator) * 1000).to(device)
        return inputs


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
                "pooled_projections": (batch, self.config["pooled_projection_dim"])}

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


class _PackedFlowPrediction(torch.nn.Module):
    """Flux's transformer on latents as the VAE makes them: packed into tokens of 2x2 latents and back, with the
    positions of the image's tokens (their row and column) and the text's (zeros), as diffusers' FluxPipeline makes
    them. Inside the stage, so that the pipeline's latents, noise and image-to-image are SD3's."""

    def __init__(self, transformer, patch: int):
        super().__init__()
        self.transformer, self.patch = transformer, patch

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, guidance=None):
        batch, channels, height, width = hidden_states.shape
        p, rows, columns = self.patch, height // self.patch, width // self.patch
        tokens = hidden_states.view(batch, channels, rows, p, columns, p).permute(0, 2, 4, 1, 3, 5)
        tokens = tokens.reshape(batch, rows * columns, channels * p * p)
        image_ids = torch.zeros(rows, columns, 3, dtype=hidden_states.dtype, device=hidden_states.device)
        image_ids[..., 1] += torch.arange(rows, device=hidden_states.device)[:, None]
        image_ids[..., 2] += torch.arange(columns, device=hidden_states.device)[None, :]
        text_ids = encoder_hidden_states.new_zeros(encoder_hidden_states.shape[1], 3)
        # diffusers' pipeline hands the transformer the timestep in thousandths (it multiplies it back), one a row
        flow = self.transformer(
            hidden_states=tokens, timestep=(timestep / 1000).expand(batch).to(hidden_states.dtype),
            guidance=None if guidance is None else guidance.expand(batch),
            pooled_projections=pooled_projections, encoder_hidden_states=encoder_hidden_states,
            txt_ids=text_ids, img_ids=image_ids.reshape(rows * columns, 3), return_dict=False)[0]
        flow = flow.view(batch, rows, columns, channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return flow.reshape(batch, channels, height, width)


class FluxTransformerModel(_FlowTransformerModel):
    name = FLUX_TRANSFORMER

    def __init__(self, source):
        super().__init__(source)
        if self.config.get(source.family.guidance_key):  # [dev]: the scale embedded
            self.input_names = (*FluxTransformerModel.input_names, GUIDANCE)

    def input_shapes(self, batch, height, width):
        latents = self.source.latent_shape(batch, height, width)
        shapes = {"hidden_states": latents, "timestep": (1,),
                  "encoder_hidden_states": (batch, self.source.family.t5_length, self.config["joint_attention_dim"]),
                  "pooled_projections": (batch, self.config["pooled_projection_dim"])}
        return {**shapes, GUIDANCE: (1,)} if GUIDANCE in self.input_names else shapes

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
        return _PackedFlowPrediction(transformer, self.source.family.packed_latents)

    def meta_module(self):
        from diffusers import FluxTransformer2DModel

        with torch.device("meta"):
            return _PackedFlowPrediction(FluxTransformer2DModel.from_config(self.config),
                                         self.source.family.packed_latents)
