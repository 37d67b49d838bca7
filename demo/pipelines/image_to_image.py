"""Image-to-image and inpainting: the input image through the VAE encoder stage into the latents, as diffusers'
StableDiffusion(XL)Img2ImgPipeline and StableDiffusion(XL)InpaintPipeline make them (and the flow families' own:
StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline), on
text-to-image's steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from demo.pipelines.batch import Batch
from demo.pipelines.flux import FluxPipeline
from demo.pipelines.images import preprocess
from demo.pipelines.sd3 import SD3Pipeline
from demo.pipelines.sdxl import SDXLPipeline
from demo.pipelines.text_to_image import Text2ImagePipeline
from models.source import ModelSource
from models.step_cache import NO_CACHE, StepCache
from models.vae import VAEEncoderModel

if TYPE_CHECKING:
    from demo.backends.base import Stage


class Image2ImagePipeline(Text2ImagePipeline):
    """diffusers' StableDiffusionImg2ImgPipeline on the same steps: the input image, resized to the request's size,
    through the VAE encoder stage, sampled from the run's generator and noised to the first of the timesteps its
    strength leaves; those are denoised."""

    encodes_image = True

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler,
                 device: torch.device, dtype: torch.dtype, cache: StepCache = NO_CACHE):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(source, stages, scheduler, device, dtype, cache)
        self.image_processor = VaeImageProcessor(vae_scale_factor=source.vae_scale_factor)

    def preprocess(self, batch: Batch) -> torch.Tensor:
        """The input image as diffusers' image processor makes it: resized to the request's size (Lanczos), in
        [-1, 1], [1, 3, H, W] (fp32, on the device)."""
        return preprocess(self.image_processor, batch.head.image, batch.head.height, batch.head.width, self.device)

    def encode_image(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The latents of images in [-1, 1] (fp32): the VAE encoder stage's output, in the stage's dtype (fp32 where
        an SDXL config says force_upcast), as latents as diffusers takes them (an AutoencoderKL's Gaussian sampled
        from `generator`: VAEEncoderModel.latents), shifted (SD3) and times the scaling factor."""
        encoder = self.stage(VAEEncoderModel)
        encoded = encoder.call(images.to(device=self.device, dtype=encoder.model.stage_dtype(self.dtype)))
        return (encoder.model.latents(encoded, generator) - self.shift_factor) * self.scaling_factor

    def prepare_latents(self, batch, generator, timesteps):
        """The input image's latents, repeated for the batch, noised to the first timestep by noise drawn after
        them."""
        image_latents = self.encode_image(self.preprocess(batch), generator).repeat(batch.batch_size, 1, 1, 1)
        noise = self.noise(image_latents.shape, generator)
        return self.noised(image_latents, noise, timesteps[:1].repeat(batch.batch_size))

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The latents noised to `timesteps` (one per row) by `noise`, as the scheduler noises them."""
        return self.scheduler.add_noise(latents, noise, timesteps)


@dataclass(frozen=True)
class MaskLatents:
    """What an inpainting run's denoising loop needs beside the latents (InpaintPipeline.prepare_latents)."""

    mask: torch.Tensor  # [B, 1, h, w] at latent size: 1 where the image is repainted
    unet_extra: torch.Tensor | None  # an inpainting UNet's: the mask and the masked image's latents, per UNet row
    image_latents: torch.Tensor | None  # an ordinary UNet's: the input image's latents, put back where kept
    noise: torch.Tensor  # the initial noise, which noises them to each next timestep


class InpaintPipeline(Image2ImagePipeline):
    """diffusers' StableDiffusionInpaintPipeline on the same steps. An inpainting UNet (models.source inpainting)
    takes the mask and the masked image's latents beside the latents; with an ordinary UNet the part the mask keeps
    is put back after each step, noised to the next timestep (the latent blend)."""

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler,
                 device: torch.device, dtype: torch.dtype, cache: StepCache = NO_CACHE):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(source, stages, scheduler, device, dtype, cache)
        self.mask_processor = VaeImageProcessor(vae_scale_factor=source.vae_scale_factor, do_normalize=False,
                                                do_binarize=True, do_convert_grayscale=True)
        self.masking: MaskLatents | None = None  # the run's, from prepare_latents

    def prepare_latents(self, batch, generator, timesteps):
        """The initial latents (noise, or at strength < 1 the input image noised to the first timestep) and the
        loop's MaskLatents, the generator drawing as diffusers' does: the image's sample, the noise, the masked
        image's sample."""
        size, inpainting_unet, full = batch.batch_size, self.source.inpainting, batch.strength == 1.0
        height, width = batch.head.height, batch.head.width
        image = self.preprocess(batch)
        mask = preprocess(self.mask_processor, batch.head.mask, height, width, self.device)
        shape = self.source.latent_shape(size, height, width)
        image_latents = None
        if not (inpainting_unet and full):  # for the noised start, or the blend
            image_latents = self.encode_image(image, generator).repeat(size, 1, 1, 1)
        noise = self.noise(shape, generator)
        latents = (self.initial_noise(noise) if full
                   else self.noised(image_latents, noise, timesteps[:1].repeat(size)))
        latent_mask = torch.nn.functional.interpolate(mask, size=shape[2:]).repeat(size, 1, 1, 1)
        if inpainting_unet:
            masked = self.encode_image(image * (mask < 0.5), generator).repeat(size, 1, 1, 1)
            extra = torch.cat([latent_mask, masked], dim=1)
            self.masking = MaskLatents(latent_mask, torch.cat([extra] * 2) if batch.head.guided else extra, None, noise)
        else:
            # diffusers encodes the masked image for an ordinary UNet too, which never sees it: its sample is drawn
            # all the same (where the VAE draws one), so that later draws (a stochastic scheduler's) match.
            if self.stage(VAEEncoderModel).model.draws_sample:
                self.noise((1, *shape[1:]), generator)
            self.masking = MaskLatents(latent_mask, None, image_latents, noise)
        return latents

    def unet_sample(self, model_input):
        if self.masking.unet_extra is None:
            return model_input
        return torch.cat([model_input, self.masking.unet_extra], dim=1)

    def after_step(self, latents, next_timestep):
        if self.masking.image_latents is None:  # an inpainting UNet repaints by itself
            return latents
        kept = self.masking.image_latents
        if next_timestep is not None:
            kept = self.noised(kept, self.masking.noise, next_timestep.reshape(1))
        return (1 - self.masking.mask) * kept + self.masking.mask * latents


class SDXLImage2ImagePipeline(SDXLPipeline, Image2ImagePipeline):
    """diffusers' StableDiffusionXLImg2ImgPipeline: SDXL's conditioning, image-to-image's latents."""


class SDXLInpaintPipeline(SDXLPipeline, InpaintPipeline):
    """diffusers' StableDiffusionXLInpaintPipeline: SDXL's conditioning, inpainting's latents and UNet input."""


class FlowImage2ImagePipeline(Image2ImagePipeline):
    """Image-to-image's latents for a family that predicts a flow: the image's, shifted and scaled, moved along the
    flow to the first timestep (a start from noise is FlowPipeline's, unscaled: its initial_noise)."""

    def noised(self, latents, noise, timesteps):
        return self.scheduler.scale_noise(latents, timesteps, noise)  # a flow's point between them at each sigma


class SD3Image2ImagePipeline(FlowImage2ImagePipeline, SD3Pipeline):
    """diffusers' StableDiffusion3Img2ImgPipeline: SD3's conditioning and flow, a flow's image-to-image latents."""


class FluxImage2ImagePipeline(FlowImage2ImagePipeline, FluxPipeline):
    """diffusers' FluxImg2ImgPipeline: Flux's conditioning, guidance and schedule, a flow's image-to-image latents."""


class FlowInpaintPipeline(FlowImage2ImagePipeline, InpaintPipeline):
    """Inpainting's latents and loop for a family that predicts a flow: the start from unit noise, or the image's
    latents moved along the flow to the first timestep, and with an ordinary denoiser the kept part moved along it to
    each next one (scale_noise); a denoiser that takes the mask and masked image (SD3's 33-channel transformer) gets
    them beside the latents at every step, as an inpainting UNet does."""


class SD3InpaintPipeline(FlowInpaintPipeline, SD3Pipeline):
    """diffusers' StableDiffusion3InpaintPipeline: SD3's conditioning and flow, a flow's inpainting (the latent blend
    for a 16-channel transformer, the mask and masked image's latents for a 33-channel one). Its images are decoded
    as SD3's other pipelines decode them, shifted back by the VAE's shift_factor, where diffusers 0.42's inpaint
    pipeline leaves the shift out (huggingface/diffusers#13611)."""


class FluxInpaintPipeline(FlowInpaintPipeline, FluxPipeline):
    """diffusers' FluxInpaintPipeline: Flux's conditioning, guidance and schedule, a flow's latent blend. diffusers
    blends the packed latents with the mask packed as they are; packing moves values without changing them, so the
    blend on the unpacked latents (which the transformer's stage packs) is the same, value for value."""
