"""VAE decoder (latents -> images) and encoder (images -> latent distribution parameters)."""

from __future__ import annotations

import torch

from models import VAE, VAE_ENCODER
from models.base import StageModel


class _Decoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent):
        return self.vae.decode(latent, return_dict=False)[0]


class _Encoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        vae.decoder = vae.post_quant_conv = None  # the decoder stage has its own; this one keeps only what encodes
        self.vae = vae

    def forward(self, images):
        # The Gaussian's parameters (mean and log-variance stacked on channels), not a sample: the
        # pipeline samples with its own generator, as diffusers does, so engines stay deterministic.
        return self.vae.encode(images, return_dict=False)[0].parameters


def _load_vae(source, component):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(source.component_dir(component))


class _VAEStage(StageModel):
    component = "vae"

    def stage_dtype(self, dtype):
        # SDXL's VAE overflows in fp16: its pipelines encode and decode in fp32 where the config says force_upcast.
        upcast = dtype == torch.float16 and self.source.family.fp16_runs_fp32(self.component, self.config)
        return torch.float32 if upcast else dtype


class VAEDecoderModel(_VAEStage):
    name = VAE
    input_names = ("latent",)
    output_names = ("images",)
    dynamic_axes = {"latent": {0: "B", 2: "latent_height", 3: "latent_width"},
                    "images": {0: "B", 2: "height", 3: "width"}}

    def input_shapes(self, batch, height, width):
        return {"latent": (batch, self.config["latent_channels"], *self.latent_size(height, width))}

    def output_shapes(self, batch, height, width):
        return {"images": (batch, self.config["out_channels"], height, width)}

    def load_module(self):
        return _Decoder(_load_vae(self.source, self.component))


class VAEEncoderModel(_VAEStage):
    """Image-to-image and inpainting: images in [-1, 1] to their latents' Gaussian, once per run at batch 1
    (models.stage_batch)."""

    name = VAE_ENCODER
    input_names = ("images",)
    output_names = ("latent_moments",)
    dynamic_axes = {"images": {0: "B", 2: "height", 3: "width"},
                    "latent_moments": {0: "B", 2: "latent_height", 3: "latent_width"}}

    def input_shapes(self, batch, height, width):
        return {"images": (batch, self.config["in_channels"], height, width)}

    def output_shapes(self, batch, height, width):
        return {"latent_moments": (batch, 2 * self.config["latent_channels"], *self.latent_size(height, width))}

    def load_module(self):
        return _Encoder(_load_vae(self.source, self.component))
