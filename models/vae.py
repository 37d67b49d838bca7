"""VAE decoder (latents -> images) and encoder (images -> latents, or their distribution's parameters), for each VAE
class the stages load (models.validate.VAE_ENCODES_GAUSSIAN): diffusers' AutoencoderKL and AutoencoderTiny (TAESD)."""

from __future__ import annotations

import torch

from models import VAE, VAE_ENCODER
from models.base import StageModel
from models.source import VAE_PRECISIONS
from models.validate import VAE_ENCODES_GAUSSIAN


class _Decoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent):
        return self.vae.decode(latent, return_dict=False)[0]


class _Encoder(torch.nn.Module):
    def __init__(self, vae, gaussian: bool):
        super().__init__()
        vae.decoder = None  # the decoder stage has its own; this one keeps only what encodes
        if getattr(vae, "post_quant_conv", None) is not None:  # an AutoencoderKL's: the decoder's first layer
            vae.post_quant_conv = None
        self.vae = vae
        self.gaussian = gaussian

    def forward(self, images):
        encoded = self.vae.encode(images, return_dict=False)[0]
        # A Gaussian's parameters (mean and log-variance stacked on channels), not a sample: the pipeline samples with
        # its own generator, as diffusers does, so engines stay deterministic. An AutoencoderTiny's latents as they are.
        return encoded.parameters if self.gaussian else encoded


def _load_vae(source, component):
    import diffusers

    return getattr(diffusers, source.vae_class).from_pretrained(source.component_dir(component))


class _VAEStage(StageModel):
    component = "vae"

    def stage_dtype(self, dtype):
        if self.source.vae_precision is not None:  # the spec's (models.source.resolve_model checked it)
            return getattr(torch, VAE_PRECISIONS[self.source.vae_precision])
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

    def meta_module(self):
        import diffusers

        with torch.device("meta"):
            return _Decoder(getattr(diffusers, self.source.vae_class).from_config(self.config))


class VAEEncoderModel(_VAEStage):
    """Image-to-image and inpainting: images in [-1, 1] to their latents' Gaussian (an AutoencoderKL's) or their latents
    (an AutoencoderTiny's), once per run at batch 1 (models.stage_batch)."""

    name = VAE_ENCODER
    input_names = ("images",)

    def __init__(self, source):
        super().__init__(source)
        # Whether its latents are a sample of the Gaussian it gives, drawn from the run's generator (latents()), as
        # diffusers' retrieve_latents draws one: an AutoencoderKL's; an AutoencoderTiny gives the latents themselves.
        self.draws_sample = VAE_ENCODES_GAUSSIAN[source.vae_class]

    @property
    def output_names(self):
        return ("latent_moments",) if self.draws_sample else ("latents",)

    @property
    def dynamic_axes(self):
        return {"images": {0: "B", 2: "height", 3: "width"},
                self.output_names[0]: {0: "B", 2: "latent_height", 3: "latent_width"}}

    def input_shapes(self, batch, height, width):
        return {"images": (batch, self.config["in_channels"], height, width)}

    def output_shapes(self, batch, height, width):
        channels = self.config["latent_channels"] * (2 if self.draws_sample else 1)  # a Gaussian: mean, log-variance
        return {self.output_names[0]: (batch, channels, *self.latent_size(height, width))}

    def latents(self, encoded: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The (unscaled) latents of the stage's output, in fp32: a sample of its Gaussian drawn from `generator` where
        it draws_sample, else the output itself."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        encoded = encoded.float()
        return DiagonalGaussianDistribution(encoded).sample(generator) if self.draws_sample else encoded

    def mean_latents(self, encoded: torch.Tensor) -> torch.Tensor:
        """The (unscaled) latents of the stage's output, in fp32, drawing nothing: its Gaussian's mean where it gives
        one, else the output itself."""
        encoded = encoded.float()
        return encoded.chunk(2, dim=1)[0] if self.draws_sample else encoded

    def load_module(self):
        return _Encoder(_load_vae(self.source, self.component), self.draws_sample)
