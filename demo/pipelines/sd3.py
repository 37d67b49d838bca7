"""SD3 and SD3.5: StableDiffusion3Pipeline's conditioning and flow-matching loop on text-to-image's steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from demo.pipelines.batch import Batch
from demo.pipelines.text_to_image import Text2ImagePipeline
from models import CLIP2Model, CLIPModel, T5Model, stage_batch
from models.source import ModelSource
from models.step_cache import NO_CACHE, AdaptiveSchedule, FixedSchedule, StepCache
from models.transformer_cache import HEAD, INDICATOR, OUT, TAIL, TAIL_RESIDUAL, part_stage
from models.unet import LATENT

if TYPE_CHECKING:
    from demo.backends.base import Stage


class FlowPipeline(Text2ImagePipeline):
    """The steps of a family whose denoiser predicts a flow (Family.flow_matching: SD3's, Flux's): the latents drawn as
    they are and handed to the denoiser unscaled."""

    def initial_noise(self, noise):
        """Noise as it is: a flow starts from unit noise (the scheduler keeps no initial sigma to scale it by)."""
        return noise

    def scaled_input(self, model_input, timestep):
        return model_input

    def cached_parts(self) -> tuple[Stage, Stage, Stage] | None:
        """The adaptive step cache's head, tail and out parts of the transformer (models.transformer_cache), where
        they are among the stages (planned with a cache threshold above 0); else None."""
        names = [part_stage(self.source.family.denoiser_stage, part) for part in (HEAD, TAIL, OUT)]
        return tuple(self.stages[name] for name in names) if names[0] in self.stages else None

    def prepare(self, batch: Batch) -> None:
        """Each stage gets ready, but the whole transformer where its parts run in its place (it holds their
        weights, and is never called: readied, it would hold a CUDA graph's memory for nothing)."""
        idle = self.source.family.denoiser_stage if self.cached_parts() else None
        for name, stage in self.stages.items():
            if name != idle:
                stage.prepare(stage_batch(name, batch.batch_size, batch.head.guided), batch.head.height,
                              batch.head.width)

    def step_cache_call(self, schedule: FixedSchedule | AdaptiveSchedule) -> Callable[[dict], torch.Tensor] | None:
        """The transformer's calls under the adaptive step cache's `schedule` (First Block Cache: models.step_cache,
        models.transformer_cache): each takes the transformer's feed and returns its prediction (LATENT). Every
        call runs the head; where the schedule says whole, the tail, whose residual is kept; else the out part on
        the first block's tokens and the kept residual (with the forecast, extrapolated: AdaptiveSchedule.kept).
        None where the parts are not planned (no cache)."""
        parts = self.cached_parts()
        if parts is None:
            return None
        head, tail, out = parts

        def call(feed: dict[str, torch.Tensor]) -> torch.Tensor:
            first = head(feed)
            if not schedule.whole(first[INDICATOR]):
                return out({**feed, **first, TAIL_RESIDUAL: schedule.kept()})[LATENT]
            outputs = tail({**feed, **first})
            schedule.keep(outputs[TAIL_RESIDUAL])
            schedule.ran_whole(first[INDICATOR])
            return outputs[LATENT]

        return call


class SD3Pipeline(FlowPipeline):
    """diffusers' StableDiffusion3Pipeline on the same steps: the two CLIP encoders' penultimate states side by side,
    padded to T5's width, then T5's states (zeros without a T5) along the sequence; the CLIPs' pooled projections side
    by side; the flow's latents (FlowPipeline)."""

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler,
                 device: torch.device, dtype: torch.dtype, cache: StepCache = NO_CACHE):
        from transformers import CLIPTokenizer

        super().__init__(source, stages, scheduler, device, dtype, cache)
        self.tokenizer_2 = CLIPTokenizer.from_pretrained(source.path, subfolder="tokenizer_2")
        self.tokenizer_3 = source.t5_tokenizer if T5Model.name in stages else None

    def t5_states(self, texts: list[str]) -> torch.Tensor:
        """T5's last states of the texts, or, for a model without T5, zeros as wide as the transformer's text."""
        length = self.source.family.t5_length
        if self.tokenizer_3 is None:
            return torch.zeros((len(texts), length, self.source.text_width), device=self.device)
        return self.stage(T5Model).call(self._token_ids(texts, self.tokenizer_3, length))

    def encode_prompt(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The transformer's text (the CLIPs' states, padded, then T5's) and pooled projections, a row per text
        (the negative prompts' then the prompts' under guidance)."""
        texts = self._texts(batch)
        states, pooled = self.stage(CLIPModel).call(self._token_ids(texts))
        states_2, pooled_2 = self.stage(CLIP2Model).call(self._token_ids(texts, self.tokenizer_2))
        # each in the pipeline's precision first: T5's engine may run in another (bf16, fp32: Family.bf16_engines),
        # whose rounding the CLIPs' states must not go through
        t5 = self.t5_states(texts).to(self.dtype)
        clip = torch.cat([states, states_2], dim=-1).to(self.dtype)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([pooled, pooled_2], dim=-1).to(self.dtype)
