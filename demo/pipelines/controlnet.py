"""ControlNet: diffusers' StableDiffusion(XL)ControlNet(Img2Img|Inpaint)Pipeline on the family pipelines' steps. Each
ControlNet stage (controlnet0, controlnet1, ...) sees the UNet's input and its conditioning image's embedding (made
once per call by its image stage, controlnet0_image ...); the residuals of all of them add up (diffusers'
MultiControlNetModel) and go into the UNet by name. Outside a ControlNet's guidance window
(control_guidance_start/end) its scale is 0; in guess mode it sees the prompt's half of the batch alone, its residuals
ramp from 0.1 to 1 times its scale down the skip connections, and the unconditional half gets none. A ControlNet whose
residuals are averaged over the image (global_pool_conditions) runs in guess mode unramped, and where it is the first,
so do all (as diffusers' pipelines decide it). Under the step cache, a step that runs the UNet's shallow pass runs each
ControlNet's (controlnet0_shallow ...): the residuals of the skip connections that pass recomputes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from demo.pipelines.batch import Batch
from demo.pipelines.image_to_image import (
    Image2ImagePipeline,
    InpaintPipeline,
    SDXLImage2ImagePipeline,
    SDXLInpaintPipeline,
)
from demo.pipelines.images import preprocess
from demo.pipelines.sdxl import SDXLPipeline
from demo.pipelines.text_to_image import Text2ImagePipeline
from models import control_image_stage, is_controlnet_stage, shallow_controlnet_stage
from models.controlnet import EMBEDDING

if TYPE_CHECKING:
    from demo.backends.base import Stage


class ControlNetSteps:
    """What a family pipeline does with ControlNet stages among its stages (a mixin, before the family's class)."""

    stages: dict[str, Stage]

    @property
    def controlnets(self) -> list[Stage]:
        return [stage for name, stage in self.stages.items() if is_controlnet_stage(name)]

    def control_images(self, batch: Batch) -> list[torch.Tensor]:
        """Each ControlNet's conditioning images, as diffusers prepares them: resized to the request's size, in
        [0, 1], one row per image of the call, twice under guidance unless in guess mode; embedded by its image
        stage."""
        from diffusers.image_processor import VaeImageProcessor

        processor = VaeImageProcessor(vae_scale_factor=self.source.vae_scale_factor, do_convert_rgb=True,
                                      do_normalize=False)
        head = batch.head
        images = []
        for index in range(len(self.controlnets)):
            rows = torch.cat([preprocess(processor, request.control_images[index], head.height, head.width,
                                         self.device).repeat_interleave(request.images, dim=0)
                              for request in batch.requests]).to(self.dtype)
            rows = torch.cat([rows] * 2) if head.guided and not self.guess_mode(batch) else rows
            images.append(self.stages[control_image_stage(index)]({"controlnet_cond": rows})[EMBEDDING])
        return images

    def guess_mode(self, batch: Batch) -> bool:
        """Whether the ControlNets run in guess mode: the request asks for it, or the first ControlNet's residuals are
        averaged over the image (diffusers' `guess_mode or global_pool_conditions`)."""
        return batch.head.guess_mode or self.controlnets[0].model.controlnet.pools_residuals

    def prepare(self, batch: Batch) -> None:
        super().prepare(batch)
        self._scales: dict[tuple[str, bool], torch.Tensor] = {}

    def denoise(self, batch, latents, conditioning, generator, timesteps, progress=None):
        self._control = self.control_images(batch)  # timed with the denoiser, whose work it is
        return super().denoise(batch, latents, conditioning, generator, timesteps, progress)

    def conditioning_scales(self, stage: Stage, on: bool, batch: Batch) -> torch.Tensor:
        """The scale of each of `stage`'s ControlNet's residuals (a shallow pass reads the first of them): its
        ControlNet's (0 where not `on`), ramped in guess mode unless that ControlNet averages its residuals; made once
        per request batch (a step takes one of two)."""
        key = (stage.model.part_of or stage.model.name, on)
        if key not in self._scales:
            count, scale = stage.model.count + 1, stage.model.scale * float(on)
            ramped = self.guess_mode(batch) and not stage.model.controlnet.pools_residuals
            self._scales[key] = (torch.logspace(-1, 0, count, device=self.device) * scale if ramped
                                 else torch.full((count,), scale, device=self.device))
        return self._scales[key]

    def unet_extra(self, step, steps, model_input, timestep, conditioning, batch, whole):
        head = batch.head
        halves = head.guided and self.guess_mode(batch)  # the ControlNets see the prompts' half alone
        sample = model_input.chunk(2)[1] if halves else model_input
        text = tuple(part.chunk(2)[1] for part in conditioning) if halves else conditioning
        inside = head.control_guidance_start <= step / steps and (step + 1) / steps <= head.control_guidance_end
        stages = self.controlnets if whole else [self.stages[shallow_controlnet_stage(index)]
                                                 for index in range(len(self.controlnets))]
        inputs = dict(zip(self.controlnets[0].model.input_names, (sample.to(self.dtype), timestep, *text)))
        calls = [(stage, {**inputs, EMBEDDING: embedding,  # by name: a shallow pass reads fewer
                          "conditioning_scale": self.conditioning_scales(stage, inside, batch)})
                 for stage, embedding in zip(stages, self._control)]
        residuals = controlnet_residuals(calls)
        if halves:  # the unconditional half gets no residual
            residuals = {name: torch.cat([torch.zeros_like(value), value]) for name, value in residuals.items()}
        return residuals


def controlnet_residuals(calls: list[tuple[Stage, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The UNet's residual inputs, by name: each ControlNet stage's outputs (named as the UNet's residual inputs,
    models.unet.residual_names) for its feed, added up over the (stage, feed) pairs, as diffusers' MultiControlNetModel
    adds them."""
    total: dict[str, torch.Tensor] = {}
    for stage, feed in calls:
        for name, residual in stage(feed).items():
            total[name] = total[name] + residual if name in total else residual
    return total


class ControlNetPipeline(ControlNetSteps, Text2ImagePipeline):
    """StableDiffusionControlNetPipeline."""


class ControlNetImage2ImagePipeline(ControlNetSteps, Image2ImagePipeline):
    """StableDiffusionControlNetImg2ImgPipeline."""


class ControlNetInpaintPipeline(ControlNetSteps, InpaintPipeline):
    """StableDiffusionControlNetInpaintPipeline."""


class SDXLControlNetPipeline(ControlNetSteps, SDXLPipeline):
    """StableDiffusionXLControlNetPipeline."""


class SDXLControlNetImage2ImagePipeline(ControlNetSteps, SDXLImage2ImagePipeline):
    """StableDiffusionXLControlNetImg2ImgPipeline."""


class SDXLControlNetInpaintPipeline(ControlNetSteps, SDXLInpaintPipeline):
    """StableDiffusionXLControlNetInpaintPipeline."""
