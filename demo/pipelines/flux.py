"""Flux.1: FluxPipeline's conditioning, guidance and schedule on text-to-image's steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from demo.pipelines.batch import Batch
from demo.pipelines.sd3 import FlowPipeline
from demo.schedulers import dynamic_shift
from models import CLIPModel, T5Model
from models.source import ModelSource
from models.step_cache import NO_CACHE, StepCache
from models.transformer import GUIDANCE

if TYPE_CHECKING:
    from demo.backends.base import Stage


class FluxPipeline(FlowPipeline):
    """diffusers' FluxPipeline on the same steps: T5's states as the text the transformer attends to, the CLIP's
    pooled output as its pooled projections, one half a step (FLUX.1 [dev] embeds the guidance scale, [schnell] none;
    diffusers' true classifier-free guidance, true_cfg_scale, is not offered), the flow's latents (FlowPipeline; the
    transformer's stage packs them into tokens), sigmas from 1 down to 1/steps shifted by the image's token count."""

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler,
                 device: torch.device, dtype: torch.dtype, cache: StepCache = NO_CACHE):
        super().__init__(source, stages, scheduler, device, dtype, cache)
        self.tokenizer_2 = source.t5_tokenizer

    def encode_prompt(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The transformer's text (T5's last states) and pooled projections (the CLIP's pooled output), a row per
        prompt."""
        texts = self._texts(batch)
        _, pooled = self.stage(CLIPModel).call(self._token_ids(texts))
        states = self.stage(T5Model).call(self._token_ids(texts, self.tokenizer_2, self.source.family.t5_length))
        return states.to(self.dtype), pooled.to(self.dtype)

    def guidance_embedding(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The guidance scale as [dev]'s transformer takes it (it embeds it), in fp32; {} for [schnell]'s."""
        if GUIDANCE not in self.denoiser.model.input_names:
            return {}
        return {GUIDANCE: torch.full((1,), batch.head.guidance_scale, device=self.device, dtype=torch.float32)}

    def set_timesteps(self, steps, size):
        """FluxPipeline's sigmas, 1 down to 1/steps, shifted for the image's tokens (its latents packed 2x2)."""
        tokens = np.prod([side // self.source.vae_scale_factor // self.source.latent_patch for side in size])
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=self.device,
                                     **dynamic_shift(self.scheduler, int(tokens)))
