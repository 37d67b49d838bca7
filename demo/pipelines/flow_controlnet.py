"""ControlNets of the transformer families: diffusers' StableDiffusion3ControlNetPipeline, FluxControlNetPipeline and
FluxControlNetImg2ImgPipeline on the family pipelines' steps. Each control image, resized to the request's size, goes
through the model's VAE encoder into latents, shifted and scaled (models.flow_controlnet says how each ControlNet's
pipeline takes them: Flux's drawn from the run's generator before anything else, SD3's the Gaussian's mean), one row
per image of the call (twice under classifier-free guidance); at each step each ControlNet stage sees the
transformer's own inputs and those latents, its scale 0 outside the guidance window (control_guidance_start/end), and
the samples of all of them add up into the transformer's. Neither pipeline has guess mode (refused: GUESS_MODE)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from demo.pipelines.batch import Batch
from demo.pipelines.controlnet import controlnet_residuals
from demo.pipelines.flux import FluxPipeline
from demo.pipelines.image_to_image import FluxImage2ImagePipeline
from demo.pipelines.images import preprocess
from demo.pipelines.sd3 import SD3Pipeline
from models import is_controlnet_stage
from models.flow_controlnet import CONTROL_LATENTS, SCALE
from models.transformer import GUIDANCE
from models.vae import VAEEncoderModel

if TYPE_CHECKING:
    from demo.backends.base import Stage


class TransformerControlNetSteps:
    """What a transformer family's pipeline does with ControlNet stages among its stages (a mixin, before the
    family's class)."""

    stages: dict[str, Stage]
    encodes_image = True  # the control images, through the VAE encoder (timed as its own region)

    @property
    def controlnets(self) -> list[Stage]:
        return [stage for name, stage in self.stages.items() if is_controlnet_stage(name)]

    def control_latents(self, batch: Batch, generator) -> list[torch.Tensor]:
        """Each ControlNet's control images' latents, as its diffusers pipeline makes them: each image resized to the
        request's size, in [-1, 1], encoded once, a row per image of the call (drawn from `generator` where its
        pipeline samples them), shifted and scaled as it says, twice under guidance."""
        from diffusers.image_processor import VaeImageProcessor

        processor = VaeImageProcessor(vae_scale_factor=self.source.vae_scale_factor)
        encoder, head = self.stage(VAEEncoderModel), batch.head
        made = []
        for index, stage in enumerate(self.controlnets):
            encoded = torch.cat([encoder.call(preprocess(processor, request.control_images[index], head.height,
                                                         head.width, self.device)
                                              .to(encoder.model.stage_dtype(self.dtype))).repeat_interleave(
                request.images, dim=0) for request in batch.requests])
            latents = (encoder.model.latents(encoded, generator) if stage.model.samples_latents
                       else encoder.model.mean_latents(encoded))
            latents = (latents - (self.shift_factor if stage.model.shifts_latents else 0.0)) * self.scaling_factor
            made.append(torch.cat([latents] * 2 if head.guided else [latents]).to(self.dtype))
        return made

    def prepare_latents(self, batch, generator, timesteps):
        """The control images' latents first (Flux's pipelines draw them from the generator before the noise and
        the input image's sample), then the family's latents."""
        self._control = self.control_latents(batch, generator)
        return super().prepare_latents(batch, generator, timesteps)

    def unet_extra(self, step, steps, model_input, timestep, conditioning, batch, whole):
        head = batch.head
        inside = head.control_guidance_start <= step / steps and (step + 1) / steps <= head.control_guidance_end
        own = dict(zip(self.denoiser.model.own_inputs, (model_input.to(self.dtype), timestep, *conditioning)))
        # a ControlNet that embeds the guidance scale takes it where the transformer does not
        own[GUIDANCE] = torch.full((1,), head.guidance_scale, device=self.device, dtype=torch.float32)
        calls = [(stage, {**own, CONTROL_LATENTS: latents,
                          SCALE: torch.full((1,), stage.model.scale * float(inside), device=self.device)})
                 for stage, latents in zip(self.controlnets, self._control)]
        return controlnet_residuals(calls)


class SD3ControlNetPipeline(TransformerControlNetSteps, SD3Pipeline):
    """StableDiffusion3ControlNetPipeline."""


class FluxControlNetPipeline(TransformerControlNetSteps, FluxPipeline):
    """FluxControlNetPipeline."""


class FluxControlNetImage2ImagePipeline(TransformerControlNetSteps, FluxImage2ImagePipeline):
    """FluxControlNetImg2ImgPipeline."""
