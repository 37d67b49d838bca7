"""SD3's transformer (MMDiT): noisy latents, timestep, the text's states and its pooled projections -> the flow it
predicts (the velocity the flow-matching scheduler steps along)."""

from __future__ import annotations

import torch

from models import TRANSFORMER
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


class SD3TransformerModel(StageModel):
    name = TRANSFORMER
    label = "Transformer"
    component = "transformer"
    input_names = ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")
    output_names = (LATENT,)
    dynamic_axes = {"hidden_states": {0: "B", 2: "latent_height", 3: "latent_width"},
                    "encoder_hidden_states": {0: "B"}, "pooled_projections": {0: "B"},
                    LATENT: {0: "B", 2: "latent_height", 3: "latent_width"}}

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

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        inputs["timestep"] = (torch.rand((1,), generator=generator) * 1000).to(device)
        return inputs

    def load_module(self):
        from diffusers import SD3Transformer2DModel

        return _FlowPrediction(SD3Transformer2DModel.from_pretrained(self.source.component_dir(self.component)))

    def meta_module(self):
        from diffusers import SD3Transformer2DModel

        with torch.device("meta"):
            return _FlowPrediction(SD3Transformer2DModel.from_config(self.config))
