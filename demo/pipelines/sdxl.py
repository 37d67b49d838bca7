"""SDXL: StableDiffusionXLPipeline's conditioning on text-to-image's steps (SDXLPipeline), and SDXL base then refiner as
an ensemble of experts (ExpertsPipeline), as diffusers runs them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from demo.pipelines.batch import Batch
from demo.pipelines.images import device_pixels, postprocess
from demo.pipelines.lora import LoraSpec
from demo.pipelines.text_to_image import Text2ImagePipeline
from demo.pipelines.timer import StageTimer
from demo.request import Request
from models import CLIP2Model, CLIPModel
from models.source import ModelSource
from models.step_cache import NO_CACHE, StepCache

if TYPE_CHECKING:
    from demo.backends.base import Stage


class SDXLPipeline(Text2ImagePipeline):
    """diffusers' StableDiffusionXLPipeline on the same steps: two text encoders, whose penultimate states are
    concatenated, and the UNet's added conditions (the second encoder's pooled embeddings and the time ids)."""

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler,
                 device: torch.device, dtype: torch.dtype, cache: StepCache = NO_CACHE):
        from transformers import CLIPTokenizer

        super().__init__(source, stages, scheduler, device, dtype, cache)
        self.tokenizer_2 = CLIPTokenizer.from_pretrained(source.path, subfolder="tokenizer_2")
        self.tokenizer = self.tokenizer or self.tokenizer_2  # a refiner has only the second
        # No negative prompt given: zero embeddings instead of an empty prompt's (SDXL's pipeline config).
        self.zero_negatives = source.index.get("force_zeros_for_empty_prompt", True)
        # The refiner's time ids end with an aesthetic score where the base's end with the target size.
        self.aesthetic = source.index.get("requires_aesthetics_score", False)

    def encode_prompt(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """Text embeddings (the two encoders' penultimate states side by side; a refiner's second alone), pooled
        text embeddings and time ids (time_ids)."""
        texts = self._texts(batch)
        embeddings, pooled = self.stage(CLIP2Model).call(self._token_ids(texts, self.tokenizer_2))
        if CLIPModel.name in self.stages:
            embeddings = torch.cat([self.stage(CLIPModel).call(self._token_ids(texts)), embeddings], dim=-1)
        if batch.head.guided and batch.negative_prompts is None and self.zero_negatives:
            keep = (torch.arange(len(texts), device=embeddings.device) >= batch.batch_size)  # the prompts' half
            embeddings, pooled = embeddings * keep[:, None, None], pooled * keep[:, None]
        return embeddings.to(self.dtype), pooled.to(self.dtype), self.time_ids(batch).to(self.dtype)

    def time_ids(self, batch: Batch) -> torch.Tensor:
        """Per text-encoder row: the original size and the crop's top-left corner (0, 0), then the target size (the
        request's), or a refiner's aesthetic score (diffusers' defaults: 6 for the prompts, 2.5 for the negatives)."""
        start = [batch.head.height, batch.head.width, 0, 0]
        target = start[:2]
        positive, negative = (start + [6.0], start + [2.5]) if self.aesthetic else (start + target, start + target)
        rows = ([negative] * batch.batch_size if batch.head.guided else []) + [positive] * batch.batch_size
        return torch.tensor(rows, device=self.device)


REFINER_CLIP, REFINER_UNET = "refiner_clip", "refiner_unet"  # the refiner's part of the "clip" and "unet" times


class ExpertsPipeline:
    """SDXL base then refiner, an ensemble of experts as diffusers runs it (denoising_end, then denoising_start):
    the base denoises the high-noise timesteps (down to `high_noise_frac` of the way), the refiner the rest from
    the base's latents, and decodes with its VAE. The same interface as Text2ImagePipeline."""

    def __init__(self, base: SDXLPipeline, refiner: SDXLPipeline, high_noise_frac: float):
        self.base, self.refiner, self.high_noise_frac = base, refiner, high_noise_frac
        self.device = base.device

    def split(self, steps: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The base's timesteps, the refiner's, and where the refiner's begin in its schedule."""
        for pipeline in (self.base, self.refiner):
            pipeline.scheduler.set_timesteps(steps, device=self.device)
        trained = self.base.scheduler.config.num_train_timesteps
        cutoff = int(round(trained - self.high_noise_frac * trained))
        base = self.base.scheduler.timesteps
        refiner = self.refiner.scheduler.timesteps
        start = len(refiner) - int((refiner < cutoff).sum())
        return base[base >= cutoff], refiner[start:], start

    def unet_calls(self, steps: int, strength: float = 1.0, explicit: Sequence[int] | None = None) -> int:
        """As Text2ImagePipeline.unet_calls (an ensemble runs text-to-image only, from `steps`: `strength` is 1 and
        `explicit` timesteps None, as PipelinePlan.check requires)."""
        return sum(self.unet_calls_each(steps))

    def unet_calls_each(self, steps: int) -> tuple[int, int]:
        """The base's UNet calls and the refiner's."""
        base, refiner, _ = self.split(steps)
        return len(base), len(refiner)

    def set_loras(self, loras: Sequence[LoraSpec]) -> float | None:
        """The base's: a LoRA is made for one UNet (the refiner's differs)."""
        return self.base.set_loras(loras)

    def dropped_text(self, text: str) -> str | None:
        return self.base.dropped_text(text)

    def __call__(self, requests: Request | Sequence[Request], timer: StageTimer, progress=None,
                 pixels: bool = False) -> np.ndarray:
        batch = Batch.of(requests)
        self.base.prepare(batch)
        self.refiner.prepare(batch)
        with timer.measure("pipeline"):
            # "clip" and "unet" time both models' stages, REFINER_CLIP and REFINER_UNET the refiner's part of them.
            with timer.measure("clip"):
                base_conditioning = self.base.encode_prompt(batch)
                with timer.measure(REFINER_CLIP):
                    refiner_conditioning = self.refiner.encode_prompt(batch)
            generator = batch.generator()
            base_steps, refiner_steps, start = self.split(batch.head.denoising_steps)
            latents = self.base.prepare_latents(batch, generator, base_steps)
            with timer.measure("unet"):
                latents = self.base.denoise(batch, latents, base_conditioning, generator, base_steps, progress)
                if hasattr(self.refiner.scheduler, "set_begin_index"):
                    self.refiner.scheduler.set_begin_index(start)
                with timer.measure(REFINER_UNET):
                    latents = self.refiner.denoise(batch, latents, refiner_conditioning, generator, refiner_steps,
                                                   progress)
            with timer.measure("vae"):
                images = self.refiner.decode(latents)
            if pixels:
                return device_pixels(images, self.refiner.dtype)
            images = images.float().cpu()
        return postprocess(images, self.refiner.dtype)
