"""UNet: noisy latents, timestep and text embeddings -> the model's prediction (noise or v).

An SDXL UNet (`addition_embed_type` "text_time" in its config) also takes the added conditions: the second
text encoder's pooled embeddings (`text_embeds`) and the six time ids (original size, crop corner, target size).
"""

from __future__ import annotations

import torch

from models import UNET
from models.base import StageModel

ADDED_CONDITIONS = ("text_embeds", "time_ids")


class _Denoiser(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, *added):
        added_cond_kwargs = dict(zip(ADDED_CONDITIONS, added)) if added else None
        return self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added_cond_kwargs,
                         return_dict=False)[0]


class UNetModel(StageModel):
    name = UNET
    component = "unet"
    input_names = ("sample", "timestep", "encoder_hidden_states")
    output_names = ("latent",)
    takes_lora = True
    takes_int8 = True
    dynamic_axes = {
        "sample": {0: "B", 2: "latent_height", 3: "latent_width"},
        "encoder_hidden_states": {0: "B"},
        "latent": {0: "B", 2: "latent_height", 3: "latent_width"},
    }

    def __init__(self, source):
        super().__init__(source)
        if self.added_conditions:  # the config decides the inputs
            self.input_names = (*UNetModel.input_names, *ADDED_CONDITIONS)
            self.dynamic_axes = {**UNetModel.dynamic_axes, **{name: {0: "B"} for name in ADDED_CONDITIONS}}

    @property
    def added_conditions(self) -> bool:
        return self.config.get("addition_embed_type") == "text_time"

    @property
    def text_embeds_width(self) -> int:
        """The pooled text embeddings' width: the second text encoder's projection."""
        return self.source.config("text_encoder_2")["projection_dim"]

    @property
    def time_ids(self) -> int:
        """How many time ids: 6 (original size, crop corner, target size), 5 for a refiner (an aesthetic score in
        place of the target size); what the added-embedding projection takes beyond the text embeddings."""
        rest = self.config["projection_class_embeddings_input_dim"] - self.text_embeds_width
        return rest // self.config["addition_time_embed_dim"]

    def input_shapes(self, batch, height, width):
        h, w = self.latent_size(height, width)
        shapes = {
            "sample": (batch, self.config["in_channels"], h, w),
            "timestep": (1,),
            "encoder_hidden_states": (batch, self.source.text_length, self.config["cross_attention_dim"]),
        }
        if self.added_conditions:
            shapes.update(text_embeds=(batch, self.text_embeds_width), time_ids=(batch, self.time_ids))
        return shapes

    def output_shapes(self, batch, height, width):
        h, w = self.latent_size(height, width)
        return {"latent": (batch, self.config["out_channels"], h, w)}

    def input_dtypes(self, dtype):
        # Timesteps reach 999 and some schedulers use fractional ones: keep them in float32.
        return {**{name: dtype for name in self.input_names}, "timestep": torch.float32}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        inputs["timestep"] = (torch.rand((1,), generator=generator) * 999).to(device)
        if self.added_conditions:  # sizes and crop corners, as the pipeline gives them
            inputs["time_ids"] = (torch.rand((batch, self.time_ids), generator=generator) * 1024).round().to(
                device=device, dtype=dtype)
        return inputs

    def load_module(self):
        from diffusers import UNet2DConditionModel

        return _Denoiser(UNet2DConditionModel.from_pretrained(self.source.component_dir(self.component)))

    def component_module(self, module):
        return module.unet

    def component_skeleton(self):
        from diffusers import UNet2DConditionModel

        with torch.device("meta"):
            return UNet2DConditionModel.from_config(self.config)
