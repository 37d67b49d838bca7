"""Text-to-image: tokenize -> text encoder(s) -> denoising loop, guided as the model is (classifier-free guidance's
two halves, or the scale as the UNet's embedding) -> VAE decode, as step methods that every other pipeline family
reuses.

The arithmetic follows diffusers' pipelines step for step (latents drawn from a CPU generator, scheduler scaling,
guidance, the scheduler's own step), so with the torch backend the same seed gives the same image as diffusers:
Text2ImagePipeline as StableDiffusionPipeline.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

import numpy as np
import torch

from demo.pipelines.batch import Batch
from demo.pipelines.images import device_pixels, postprocess
from demo.pipelines.lora import LoraSpec, StageLoras
from demo.pipelines.timer import StageTimer
from demo.request import Request
from demo.schedulers import first_step, make_scheduler
from models import CLIPModel, VAEDecoderModel, stage_batch
from models.base import StageModel
from models.source import ModelSource
from models.step_cache import NO_CACHE, AdaptiveSchedule, FixedSchedule, StepCache
from models.unet import LATENT, TIMESTEP_COND, UNetShallowModel
from models.unet_cache import DEEP_FEATURES

if TYPE_CHECKING:
    from demo.backends.base import Stage


class Text2ImagePipeline:
    """diffusers' text-to-image, as step methods that the image-to-image, inpainting and SDXL pipelines reuse:
    encode_prompt -> prepare_latents -> denoise -> decode. Stages are looked up by their models' names and fed
    in their models' input order (Stage.call), so no stage or tensor name is spelt here."""

    # Whether prepare_latents runs the VAE encoder (the input image): then it is timed as its own region.
    encodes_image: ClassVar[bool] = False

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler,
                 device: torch.device, dtype: torch.dtype, cache: StepCache = NO_CACHE):
        """`scheduler`: a diffusers scheduler, our name of one (demo.schedulers), or None: set before each call (a
        loaded pipeline sets its request's, demo.runtime.loaded). `cache`: with the step cache's shallow UNet among
        `stages`, the calls its schedule says run whole (models.step_cache) and the others the shallow pass from the
        last whole call's deep features."""
        from transformers import CLIPTokenizer

        self.cache = cache
        self.source = source
        self.stages = stages
        self.scheduler = make_scheduler(scheduler, source) if isinstance(scheduler, str) else scheduler
        self.tokenizer = (CLIPTokenizer.from_pretrained(source.path, subfolder="tokenizer")
                          if "tokenizer" in source.components else None)
        self.device = device
        self.dtype = dtype
        vae = source.config("vae")
        self.scaling_factor = vae["scaling_factor"]
        # The latents the VAE decodes are scaled and, in families whose pipelines shift them (SD3), shifted too.
        self.shift_factor = (vae.get("shift_factor") or 0.0) if source.family.shifts_latents else 0.0
        self.loras = StageLoras(stages)
        self.last_schedule: FixedSchedule | AdaptiveSchedule | None = None  # the last run's (its calls, whole ones)

    def stage(self, model: type[StageModel]) -> Stage:
        return self.stages[model.name]

    @property
    def denoiser(self) -> Stage:
        """The stage that denoises: the family's (a UNet, SD3's transformer)."""
        return self.stages[self.source.family.denoiser_stage]

    def timesteps(self, steps: int, strength: float = 1.0, explicit: Sequence[int] | None = None,
                  size: tuple[int, int] | None = None) -> torch.Tensor:
        """Sets the scheduler's timesteps for `steps` (or the `explicit` ones, as many) for images of `size` (height,
        width; None: the model's native size) and returns those a run denoises: the last `strength` of them
        (text-to-image: all), as diffusers' image-to-image pipelines pick them."""
        if explicit is None:
            self.set_timesteps(steps, size or (self.source.native_image_size,) * 2)
        else:  # as diffusers' retrieve_timesteps
            self.scheduler.set_timesteps(timesteps=list(explicit), device=self.device)
            steps = len(self.scheduler.timesteps)
        start = self.first_step(steps, strength) * self.scheduler.order
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(start)
        return self.scheduler.timesteps[start:]

    def set_timesteps(self, steps: int, size: tuple[int, int]) -> None:
        """The scheduler's timesteps for `steps`, as the model's diffusers pipeline sets them for images of `size`
        (height, width): here by the count alone."""
        self.scheduler.set_timesteps(steps, device=self.device)

    def first_step(self, steps: int, strength: float) -> int:
        """Of `steps`, the first a run at `strength` denoises, as the model's diffusers image-to-image pipeline counts
        it (demo.schedulers.first_step: SD3's flow counted its own way)."""
        return first_step(steps, strength, self.source.family.flow_matching)

    def unet_calls(self, steps: int, strength: float = 1.0, explicit: Sequence[int] | None = None) -> int:
        """How many times the UNet runs for `steps` (or the `explicit` timesteps; some schedulers take extra warm-up
        steps) at `strength`."""
        return len(self.timesteps(steps, strength, explicit))

    def set_loras(self, loras: Sequence[LoraSpec]) -> float | None:
        """Fuse LoRA files, (path, scale) each, added up, into the denoiser and text encoders in place of those set
        before ([]: the base weights, bit for bit), without reloading: into the torch modules, or by refit into
        engines built refittable (demo.pipelines.lora). Returns how long the engines' refit took, in ms (None:
        no engine was refitted)."""
        return self.loras.set(loras)

    def dropped_text(self, text: str) -> str | None:
        """What of `text` the text encoder's token limit cuts off (None: all of it fits), as diffusers reports it."""
        ids = self.tokenizer(text, truncation=False).input_ids
        limit = self.source.text_length
        if len(ids) <= limit:
            return None
        return self.tokenizer.decode(ids[limit - 1:-1])  # the kept part ends with the end-of-text token

    def _token_ids(self, texts: list[str], tokenizer=None, length: int | None = None) -> torch.Tensor:
        """The texts' token ids, each padded or cut to `length` tokens (None: the CLIP encoders' length)."""
        ids = (tokenizer or self.tokenizer)(
            texts, padding="max_length", max_length=length or self.source.text_length, truncation=True,
            return_tensors="pt"
        ).input_ids
        return ids.to(device=self.device, dtype=torch.int32)

    def _texts(self, batch: Batch) -> list[str]:
        """What the text encoders take: the negative prompts, then the prompts, in one batch under guidance."""
        negatives = batch.negative_prompts or [""] * batch.batch_size
        return (negatives + batch.prompts) if batch.head.guided else batch.prompts

    def _step_kwargs(self, generator: torch.Generator, eta: float | None) -> dict:
        # As diffusers does: stochastic schedulers (e.g. Euler ancestral) draw from the same generator; eta, where the
        # step takes it, is the request's, else diffusers' pipelines' 0.
        accepted = inspect.signature(self.scheduler.step).parameters
        kwargs = {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0 if eta is None else eta
        if "generator" in accepted:
            kwargs["generator"] = generator
        return kwargs

    def prepare(self, batch: Batch) -> None:
        """Each stage gets ready for this request's batch and size (engines size their buffers here)."""
        for name, stage in self.stages.items():
            stage.prepare(stage_batch(name, batch.batch_size, batch.head.guided), batch.head.height, batch.head.width)

    def encode_prompt(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The UNet's conditioning, its inputs after sample and timestep: here the text embeddings (the negative
        prompts' then the prompts' under guidance, one batch; else the prompts')."""
        return (self.stage(CLIPModel).call(self._token_ids(self._texts(batch))).to(self.dtype),)

    def noise(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Noise as diffusers draws it: from the CPU generator, in fp32 (latents and the scheduler's arithmetic stay
        in fp32; only stage inputs take the stages' dtype)."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    def prepare_latents(self, batch: Batch, generator: torch.Generator,
                        timesteps: torch.Tensor) -> torch.Tensor:
        """The initial latents: noise scaled by the scheduler. `timesteps` are those the run denoises (image-to-image
        noises its image for the first)."""
        shape = self.source.latent_shape(batch.batch_size, batch.head.height, batch.head.width)
        return self.initial_noise(self.noise(shape, generator))

    def initial_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """The latents a run from pure noise starts from: the noise scaled by the scheduler's initial sigma."""
        return noise * self.scheduler.init_noise_sigma

    def unet_extra(self, step: int, steps: int, model_input: torch.Tensor, timestep: torch.Tensor,
                   conditioning: tuple[torch.Tensor, ...], batch: Batch, whole: bool) -> dict[str, torch.Tensor]:
        """The UNet's inputs beside its sample and conditioning at `step` of `steps` (ControlNets' residuals), from the
        scaled model input, for a whole UNet pass or (not `whole`) the step cache's shallow pass; none here."""
        return {}

    def guidance_embedding(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The UNet's embedding of the guidance scale, where the model embeds it (models.families EMBEDDED), as
        diffusers' pipelines make it (get_guidance_scale_embedding of the scale less 1, on the CPU in fp32, a row per
        image); {} where it takes none."""
        width = self.source.family.guidance_embedding_width(self.source.denoiser_config)
        if not width:
            return {}
        scale = torch.full((batch.batch_size,), batch.head.guidance_scale - 1.0) * 1000.0
        half = width // 2
        frequencies = torch.exp(torch.arange(half, dtype=torch.float32) * -(torch.log(torch.tensor(10000.0)) /
                                                                             (half - 1)))
        embedding = scale[:, None] * frequencies[None, :]
        embedding = torch.nn.functional.pad(torch.cat([torch.sin(embedding), torch.cos(embedding)], dim=1),
                                            (0, width % 2))
        return {TIMESTEP_COND: embedding.to(device=self.device, dtype=self.dtype)}

    def scaled_input(self, model_input: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """The denoiser's input at `timestep`: the latents as the scheduler scales them (flow matching's: as they
        are)."""
        return self.scheduler.scale_model_input(model_input, timestep)

    def unet_sample(self, model_input: torch.Tensor) -> torch.Tensor:
        """The UNet's sample for a scaled model input (an inpainting UNet's has the mask and masked image too)."""
        return model_input

    def after_step(self, latents: torch.Tensor, next_timestep: torch.Tensor | None) -> torch.Tensor:
        """The latents after a scheduler step, on their way to `next_timestep` (None: the last step); inpainting with
        an ordinary UNet puts the kept part of the image back here."""
        return latents

    def step_cache_call(self, schedule: FixedSchedule | AdaptiveSchedule) -> Callable[[dict], torch.Tensor] | None:
        """The denoiser's call under the adaptive cache (`schedule` an AdaptiveSchedule, the shallow UNet among the
        stages): from the denoiser's whole feed, its prediction by the rule (models.step_cache). The first call runs
        whole (the full pass, keeping its deep features); each later one runs the shallow pass from them, whose
        prediction is the indicator: where the schedule says so the full pass runs too (its prediction is used, and
        refreshes the features and the reference), else the shallow prediction is. None where no adaptive cache
        applies: denoise calls the stages itself (the fixed cache decides before the feed is made, which ControlNets'
        shallow residuals need)."""
        shallow = self.stages.get(UNetShallowModel.name)
        if shallow is None or not isinstance(schedule, AdaptiveSchedule):
            return None
        unet, kept = self.denoiser, {}

        def call(feed: dict) -> torch.Tensor:
            if DEEP_FEATURES in kept:
                prediction = shallow({**feed, DEEP_FEATURES: kept[DEEP_FEATURES]})[LATENT]
                if not schedule.whole(prediction):
                    return prediction
            else:
                schedule.whole(None)  # the first call: nothing kept yet, so whole
            # The full pass's outputs stay valid as the features and the reference until its next run, which comes
            # after the next decision: no copy needed even where a stage reuses its output buffers (CUDA graphs).
            outputs = unet(feed)
            kept[DEEP_FEATURES] = outputs[DEEP_FEATURES]
            schedule.ran_whole(outputs[LATENT])
            return outputs[LATENT]

        return call

    def denoise(self, batch: Batch, latents: torch.Tensor, conditioning: tuple[torch.Tensor, ...],
                generator: torch.Generator, timesteps: torch.Tensor, progress=None) -> torch.Tensor:
        """The scheduler's loop over `timesteps`, guided as the request is (classifier-free: both halves in one batch;
        embedded: the scale's embedding beside the text); `conditioning` as encode_prompt gives it."""
        unet, shallow = self.denoiser, self.stages.get(UNetShallowModel.name)
        step_kwargs = self._step_kwargs(generator, batch.head.eta)
        guidance = self.guidance_embedding(batch)
        features, schedule = None, self.cache.schedule()
        self.last_schedule = schedule  # what this run's cache did, for the report
        cached_call = self.step_cache_call(schedule)
        fixed = shallow is not None and cached_call is None  # the fixed cache: each call's pass known before it
        # The scheduler steps on the host's copy of the timesteps: DDIM and PNDM index host tables with the timestep
        # and compare it with 0, which for a timestep on the GPU waits for the GPU every step. The stages take theirs
        # from the device's copy, so the loop never waits and the GPU never idles between steps.
        unet_timesteps = timesteps.to(device=self.device, dtype=torch.float32).reshape(-1, 1)
        for i, t in enumerate(timesteps.cpu()):
            model_input = torch.cat([latents] * 2) if batch.head.guided else latents
            model_input = self.scaled_input(model_input, t)
            timestep = unet_timesteps[i]
            whole = not fixed or schedule.whole()  # ControlNets' residuals for the pass that runs
            extra = self.unet_extra(i, len(timesteps), model_input, timestep, conditioning, batch, whole)
            inputs = (self.unet_sample(model_input).to(self.dtype), timestep, *conditioning)
            feed = dict(zip(unet.model.input_names, inputs), **guidance, **extra)  # by name: stages take what they read
            if cached_call is not None:
                prediction = cached_call(feed)
            elif not fixed:
                prediction = unet(feed)[LATENT]
            elif whole:  # both guidance halves' features, kept together
                outputs = unet(feed)
                prediction, features = outputs[LATENT], outputs[DEEP_FEATURES]
                schedule.ran_whole()
            else:
                prediction = shallow({**feed, DEEP_FEATURES: features})[LATENT]
            prediction = prediction.float()
            if batch.head.guided:
                uncond, cond = prediction.chunk(2)
                prediction = uncond + batch.head.guidance_scale * (cond - uncond)
            latents = self.scheduler.step(prediction, t, latents, **step_kwargs, return_dict=False)[0]
            latents = self.after_step(latents, timesteps[i + 1] if i + 1 < len(timesteps) else None)
            if progress is not None:
                progress.update()
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from the VAE decoder, in its stage's dtype (fp32 where an SDXL config asks) and device."""
        vae = self.stage(VAEDecoderModel)
        return vae.call((latents / self.scaling_factor + self.shift_factor).to(vae.model.stage_dtype(self.dtype)))

    def __call__(self, requests: Request | Sequence[Request], timer: StageTimer, progress=None,
                 pixels: bool = False) -> np.ndarray:
        """The images of resolved requests that share a call (Batch.of), as float32 [B, H, W, 3] in [0, 1] (diffusers'
        output_type="np"); with `pixels`, 8-bit ones made on the device (device_pixels). `progress` hears of each
        denoising step (update())."""
        batch = Batch.of(requests)
        self.prepare(batch)
        with timer.measure("pipeline"):
            with timer.measure("clip"):
                conditioning = self.encode_prompt(batch)
            generator = batch.generator()
            timesteps = self.timesteps(batch.head.denoising_steps, batch.strength, batch.head.timesteps,
                                       (batch.head.height, batch.head.width))
            with timer.measure("vae_encoder") if self.encodes_image else contextlib.nullcontext():
                latents = self.prepare_latents(batch, generator, timesteps)
            with timer.measure("unet"):
                latents = self.denoise(batch, latents, conditioning, generator, timesteps, progress)
            with timer.measure("vae"):
                images = self.decode(latents)
            if pixels:
                return device_pixels(images, self.dtype)
            images = images.float().cpu()
        return postprocess(images, self.dtype)
