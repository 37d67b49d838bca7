"""UNet: noisy latents, timestep and text embeddings -> the model's prediction (noise or v)."""

from __future__ import annotations

import torch

from models.base import StageModel


class _Denoiser(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class UNetModel(StageModel):
    name = "unet"
    component = "unet"
    input_names = ("sample", "timestep", "encoder_hidden_states")
    output_names = ("latent",)
    dynamic_axes = {
        "sample": {0: "B", 2: "latent_height", 3: "latent_width"},
        "encoder_hidden_states": {0: "B"},
        "latent": {0: "B", 2: "latent_height", 3: "latent_width"},
    }

    def input_shapes(self, batch, height, width):
        h, w = self.latent_size(height, width)
        return {
            "sample": (batch, self.config["in_channels"], h, w),
            "timestep": (1,),
            "encoder_hidden_states": (batch, self.source.text_length, self.config["cross_attention_dim"]),
        }

    def output_shapes(self, batch, height, width):
        h, w = self.latent_size(height, width)
        return {"latent": (batch, self.config["out_channels"], h, w)}

    def input_dtypes(self, dtype):
        # Timesteps reach 999 and some schedulers use fractional ones: keep them in float32.
        return {"sample": dtype, "timestep": torch.float32, "encoder_hidden_states": dtype}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        inputs["timestep"] = (torch.rand((1,), generator=generator) * 999).to(device)
        return inputs

    def load_module(self):
        from diffusers import UNet2DConditionModel

        return _Denoiser(UNet2DConditionModel.from_pretrained(self.source.path, subfolder=self.component))
