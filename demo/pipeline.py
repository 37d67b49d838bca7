"""Text-to-image: tokenize -> text encoder(s) -> denoising loop with classifier-free guidance -> VAE decode.

The arithmetic follows diffusers' pipelines step for step (latents drawn from a CPU generator, scheduler scaling,
guidance, the scheduler's own step), so with the torch backend the same seed gives the same image as diffusers:
Text2ImagePipeline as StableDiffusionPipeline, SDXLPipeline as StableDiffusionXLPipeline (and, for a refiner,
StableDiffusionXLImg2ImgPipeline from latents), ExpertsPipeline as SDXL base then refiner.
"""

from __future__ import annotations

import inspect
import math
import random
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from core.errors import UsageError
from demo.report import StageTimer
from demo.settings import RequestFlags, at_least
from demo.stages import Stage
from models import CLIP2Model, CLIPModel, UNetModel, VAEDecoderModel, stage_batch
from models.base import StageModel
from models.source import ModelSource

# CLI name -> diffusers scheduler class name (diffusers' own implementations are used).
SCHEDULERS = {
    "DDIM": "DDIMScheduler",
    "PNDM": "PNDMScheduler",
    "Euler": "EulerDiscreteScheduler",
    "EulerA": "EulerAncestralDiscreteScheduler",
    "DPM++2M": "DPMSolverMultistepScheduler",
    "LMSD": "LMSDiscreteScheduler",
    "UniPC": "UniPCMultistepScheduler",
}


def default_scheduler_name(source: ModelSource) -> str:
    class_name = source.config("scheduler").get("_class_name")
    for name, cls in SCHEDULERS.items():
        if cls == class_name:
            return name
    raise UsageError(
        f"model '{source.name}' uses scheduler {class_name}, which this toolkit does not offer; "
        f"choose one with --scheduler ({', '.join(SCHEDULERS)})"
    )


def make_scheduler(name: str, source: ModelSource):
    """diffusers' scheduler class `name`, configured from the model's scheduler config."""
    import diffusers

    if name not in SCHEDULERS:
        raise UsageError(f"unknown scheduler '{name}'; choose one of {', '.join(SCHEDULERS)}")
    return getattr(diffusers, SCHEDULERS[name]).from_config(source.config("scheduler"))


def random_seed() -> int:
    """A seed for a request given none (reported with the images, so they can be made again)."""
    return random.randrange(2**31)


def resolve_request(flags: RequestFlags, source: ModelSource,
                    draw_seed: Callable[[], int] = random_seed) -> RequestFlags:
    """The request with what the user left to the model filled in: its native size, its own scheduler, and a
    seed from `draw_seed`."""
    return replace(flags, height=flags.height or source.native_image_size,
                   width=flags.width or source.native_image_size,
                   scheduler=flags.scheduler or default_scheduler_name(source),
                   seed=flags.seed if flags.seed is not None else draw_seed())


def check_request(flags: RequestFlags, source: ModelSource) -> None:
    """A resolved request's values against their limits and the model: a one-line UsageError for the first bad one."""
    from demo.arguments import check_image_size

    at_least("--batch-size", flags.batch_size, 1)
    at_least("--denoising-steps", flags.denoising_steps, 1)
    if not (math.isfinite(flags.guidance_scale) and flags.guidance_scale >= 0):
        raise UsageError(f"--guidance-scale must be a finite number, 0 or more, got {flags.guidance_scale}")
    if not 0 <= flags.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise UsageError(f"--seed must be 0..{2**64 - 1}, got {flags.seed}")
    check_steps(make_scheduler(flags.scheduler, source), flags.scheduler, flags.denoising_steps)
    check_image_size(source, flags.height, flags.width)


def _distinct_timesteps(scheduler, steps: int) -> int:
    """How many different timesteps the scheduler runs for `steps` (0 where it refuses them)."""
    try:
        scheduler.set_timesteps(steps)
    except ValueError:  # e.g. DDIM above its training timesteps
        return 0
    return len(set(scheduler.timesteps.tolist()))


def check_steps(scheduler, name: str, steps: int) -> None:
    """A UsageError where the scheduler cannot run `steps` distinct steps: above its limit diffusers' schedulers
    refuse, repeat the last timestep (PNDM, Euler) or collapse to one (DPM++2M, UniPC)."""
    if _distinct_timesteps(scheduler, steps) >= steps:
        return
    low, high = 1, steps - 1  # the most steps it runs distinctly, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if _distinct_timesteps(scheduler, middle) >= middle else (low, middle - 1)
    raise UsageError(f"--denoising-steps {steps} is more than scheduler {name} can take for this model: at most "
                     f"{low} (it has {scheduler.config.num_train_timesteps} training timesteps)")


@dataclass(frozen=True)
class GenerationRequest:
    prompts: list[str]
    negative_prompts: list[str] | None  # None: not given (an empty prompt, or zeros where an SDXL config says so)
    height: int
    width: int
    steps: int
    guidance_scale: float
    seed: int

    @classmethod
    def from_flags(cls, flags: RequestFlags) -> "GenerationRequest":
        """A resolved request's batch: its prompt and negative prompt repeated --batch-size times."""
        negatives = None if flags.negative_prompt is None else [flags.negative_prompt] * flags.batch_size
        return cls([flags.prompt] * flags.batch_size, negatives, flags.height, flags.width, flags.denoising_steps,
                   flags.guidance_scale, flags.seed)

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1.0


class Text2ImagePipeline:
    """diffusers' text-to-image, as step methods that the image-to-image, inpainting and SDXL pipelines reuse:
    encode_prompt -> prepare_latents -> denoise -> decode. Stages are looked up by their models' names and fed
    in their models' input order (Stage.call), so no stage or tensor name is spelt here."""

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler_name: str,
                 device: torch.device, dtype: torch.dtype):
        from transformers import CLIPTokenizer

        self.source = source
        self.stages = stages
        self.scheduler = make_scheduler(scheduler_name, source)
        self.tokenizer = (CLIPTokenizer.from_pretrained(source.path, subfolder="tokenizer")
                          if "tokenizer" in source.components else None)
        self.device = device
        self.dtype = dtype
        self.scaling_factor = source.config("vae")["scaling_factor"]

    def stage(self, model: type[StageModel]) -> Stage:
        return self.stages[model.name]

    def unet_calls(self, steps: int) -> int:
        """How many times the UNet runs for `steps` (some schedulers take extra warm-up steps)."""
        self.scheduler.set_timesteps(steps)
        return len(self.scheduler.timesteps)

    def timed_runs(self, request: "GenerationRequest", warmup_runs: int, runs: int,
                   say: Callable[[str], None] = lambda _: None) -> tuple[np.ndarray, list[dict[str, float]]]:
        """`warmup_runs` untimed runs, then `runs` timed ones: the last run's images and each run's stage
        milliseconds, for benchmarks to take medians of. `say` hears of each run."""
        for run in range(warmup_runs):
            say(f"warm-up run {run + 1}/{warmup_runs}")
            self(request, StageTimer(self.device))
        timings = []
        for run in range(runs):
            timer = StageTimer(self.device)
            images = self(request, timer)
            timings.append(timer.milliseconds())
            say(f"run {run + 1}/{runs}: pipeline {timings[-1]['pipeline']:.2f} ms, UNet {timings[-1]['unet']:.2f} ms")
        return images, timings

    def dropped_text(self, text: str) -> str | None:
        """What of `text` the text encoder's token limit cuts off (None: all of it fits), as diffusers reports it."""
        ids = self.tokenizer(text, truncation=False).input_ids
        limit = self.source.text_length
        if len(ids) <= limit:
            return None
        return self.tokenizer.decode(ids[limit - 1:-1])  # the kept part ends with the end-of-text token

    def _token_ids(self, texts: list[str], tokenizer=None) -> torch.Tensor:
        ids = (tokenizer or self.tokenizer)(
            texts, padding="max_length", max_length=self.source.text_length, truncation=True, return_tensors="pt"
        ).input_ids
        return ids.to(device=self.device, dtype=torch.int32)

    def _texts(self, request: GenerationRequest) -> list[str]:
        """What the text encoders take: the negative prompts, then the prompts, in one batch under guidance."""
        negatives = request.negative_prompts or [""] * request.batch_size
        return (negatives + request.prompts) if request.guided else request.prompts

    def _step_kwargs(self, generator: torch.Generator) -> dict:
        # As diffusers does: stochastic schedulers (e.g. Euler ancestral) draw from the same generator.
        accepted = inspect.signature(self.scheduler.step).parameters
        kwargs = {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0
        if "generator" in accepted:
            kwargs["generator"] = generator
        return kwargs

    def prepare(self, request: GenerationRequest) -> None:
        """Each stage gets ready for this request's batch and size (engines size their buffers here)."""
        for name, stage in self.stages.items():
            stage.prepare(stage_batch(name, request.batch_size, request.guided), request.height, request.width)

    def encode_prompt(self, request: GenerationRequest) -> tuple[torch.Tensor, ...]:
        """The UNet's conditioning, its inputs after sample and timestep: here the text embeddings (the negative
        prompts' then the prompts' under guidance, one batch; else the prompts')."""
        return (self.stage(CLIPModel).call(self._token_ids(self._texts(request))).to(self.dtype),)

    def prepare_latents(self, request: GenerationRequest, generator: torch.Generator) -> torch.Tensor:
        """The initial noise as diffusers draws it (CPU generator, fp32), scaled by the scheduler; sets its
        timesteps."""
        from diffusers.utils.torch_utils import randn_tensor

        self.scheduler.set_timesteps(request.steps, device=self.device)
        # Latents and the scheduler's arithmetic stay in fp32; only stage inputs take the stages' dtype.
        latents = randn_tensor(self.source.latent_shape(request.batch_size, request.height, request.width),
                               generator=generator, device=self.device, dtype=torch.float32)
        return latents * self.scheduler.init_noise_sigma

    def denoise(self, request: GenerationRequest, latents: torch.Tensor, conditioning: tuple[torch.Tensor, ...],
                generator: torch.Generator, timesteps=None, progress=None) -> torch.Tensor:
        """The scheduler's loop over `timesteps` (default: all it set), with classifier-free guidance;
        `conditioning` as encode_prompt gives it."""
        unet = self.stage(UNetModel)
        step_kwargs = self._step_kwargs(generator)
        for t in self.scheduler.timesteps if timesteps is None else timesteps:
            model_input = torch.cat([latents] * 2) if request.guided else latents
            model_input = self.scheduler.scale_model_input(model_input, t)
            timestep = t.reshape(1).to(device=self.device, dtype=torch.float32)
            prediction = unet.call(model_input.to(self.dtype), timestep, *conditioning).float()
            if request.guided:
                uncond, cond = prediction.chunk(2)
                prediction = uncond + request.guidance_scale * (cond - uncond)
            latents = self.scheduler.step(prediction, t, latents, **step_kwargs, return_dict=False)[0]
            if progress is not None:
                progress.update()
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from the VAE decoder, in its stage's dtype (fp32 where an SDXL config asks) and device."""
        vae = self.stage(VAEDecoderModel)
        return vae.call((latents / self.scaling_factor).to(vae.model.stage_dtype(self.dtype)))

    def __call__(self, request: GenerationRequest, timer: StageTimer, progress=None) -> np.ndarray:
        """Images as float32 [B, H, W, 3] in [0, 1] (diffusers' output_type="np")."""
        self.prepare(request)
        with timer.measure("pipeline"):
            with timer.measure("clip"):
                conditioning = self.encode_prompt(request)
            generator = torch.Generator("cpu").manual_seed(request.seed)
            latents = self.prepare_latents(request, generator)
            with timer.measure("unet"):
                latents = self.denoise(request, latents, conditioning, generator, progress=progress)
            with timer.measure("vae"):
                images = self.decode(latents)
            images = images.float().cpu()
        return postprocess(images, self.dtype)


def postprocess(images: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Decoded images in [-1, 1] as float32 [B, H, W, 3] in [0, 1], as diffusers' image processor makes them."""
    if not torch.isfinite(images).all():  # e.g. fp16 overflow: say so rather than save black images
        warnings.warn(f"non-finite values in the decoded images ({dtype}); they will be saved clamped",
                      RuntimeWarning, stacklevel=3)
    return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


class SDXLPipeline(Text2ImagePipeline):
    """diffusers' StableDiffusionXLPipeline on the same steps: two text encoders, whose penultimate states are
    concatenated, and the UNet's added conditions (the second encoder's pooled embeddings and the time ids)."""

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler_name: str,
                 device: torch.device, dtype: torch.dtype):
        from transformers import CLIPTokenizer

        super().__init__(source, stages, scheduler_name, device, dtype)
        self.tokenizer_2 = CLIPTokenizer.from_pretrained(source.path, subfolder="tokenizer_2")
        self.tokenizer = self.tokenizer or self.tokenizer_2  # a refiner has only the second
        # No negative prompt given: zero embeddings instead of an empty prompt's (SDXL's pipeline config).
        self.zero_negatives = source.index.get("force_zeros_for_empty_prompt", True)
        # The refiner's time ids end with an aesthetic score where the base's end with the target size.
        self.aesthetic = source.index.get("requires_aesthetics_score", False)

    def encode_prompt(self, request: GenerationRequest) -> tuple[torch.Tensor, ...]:
        """Text embeddings (the two encoders' penultimate states side by side; a refiner's second alone), pooled
        text embeddings and time ids (time_ids)."""
        texts = self._texts(request)
        embeddings, pooled = self.stage(CLIP2Model).call(self._token_ids(texts, self.tokenizer_2))
        if CLIPModel.name in self.stages:
            embeddings = torch.cat([self.stage(CLIPModel).call(self._token_ids(texts)), embeddings], dim=-1)
        if request.guided and request.negative_prompts is None and self.zero_negatives:
            keep = (torch.arange(len(texts), device=embeddings.device) >= request.batch_size)  # the prompts' half
            embeddings, pooled = embeddings * keep[:, None, None], pooled * keep[:, None]
        return embeddings.to(self.dtype), pooled.to(self.dtype), self.time_ids(request).to(self.dtype)

    def time_ids(self, request: GenerationRequest) -> torch.Tensor:
        """Per text-encoder row: the original size and the crop's top-left corner (0, 0), then the target size (the
        request's), or a refiner's aesthetic score (diffusers' defaults: 6 for the prompts, 2.5 for the negatives)."""
        start = [request.height, request.width, 0, 0]
        target = start[:2]
        positive, negative = (start + [6.0], start + [2.5]) if self.aesthetic else (start + target, start + target)
        rows = ([negative] * request.batch_size if request.guided else []) + [positive] * request.batch_size
        return torch.tensor(rows, device=self.device)


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

    def unet_calls(self, steps: int) -> int:
        base, refiner, _ = self.split(steps)
        return len(base) + len(refiner)

    def dropped_text(self, text: str) -> str | None:
        return self.base.dropped_text(text)

    def __call__(self, request: GenerationRequest, timer: StageTimer, progress=None) -> np.ndarray:
        self.base.prepare(request)
        self.refiner.prepare(request)
        with timer.measure("pipeline"):
            with timer.measure("clip"):
                base_conditioning = self.base.encode_prompt(request)
                refiner_conditioning = self.refiner.encode_prompt(request)
            generator = torch.Generator("cpu").manual_seed(request.seed)
            latents = self.base.prepare_latents(request, generator)
            base_steps, refiner_steps, start = self.split(request.steps)
            with timer.measure("unet"):
                latents = self.base.denoise(request, latents, base_conditioning, generator, base_steps, progress)
                if hasattr(self.refiner.scheduler, "set_begin_index"):
                    self.refiner.scheduler.set_begin_index(start)
                latents = self.refiner.denoise(request, latents, refiner_conditioning, generator, refiner_steps,
                                               progress)
            with timer.measure("vae"):
                images = self.refiner.decode(latents)
            images = images.float().cpu()
        return postprocess(images, self.refiner.dtype)


def make_pipeline(source: ModelSource, stages: dict[str, Stage], scheduler_name: str, device: torch.device,
                  dtype: torch.dtype) -> Text2ImagePipeline:
    """The text-to-image pipeline this model needs."""
    return (SDXLPipeline if source.is_xl else Text2ImagePipeline)(source, stages, scheduler_name, device, dtype)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats to 8-bit pixels, rounding as diffusers' numpy_to_pil does."""
    return (images * 255).round().astype(np.uint8)


def image_psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB between two 8-bit images (inf where they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
