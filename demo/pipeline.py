"""Text-to-image: tokenize -> text encoder(s) -> denoising loop with classifier-free guidance -> VAE decode;
image-to-image and inpainting start from an input image, through the VAE encoder.

The arithmetic follows diffusers' pipelines step for step (latents drawn from a CPU generator, scheduler scaling,
guidance, the scheduler's own step), so with the torch backend the same seed gives the same image as diffusers:
Text2ImagePipeline as StableDiffusionPipeline, SDXLPipeline as StableDiffusionXLPipeline (and, for a refiner,
StableDiffusionXLImg2ImgPipeline from latents), ExpertsPipeline as SDXL base then refiner, Image2ImagePipeline and
SDXLImage2ImagePipeline as StableDiffusion(XL)Img2ImgPipeline, InpaintPipeline and SDXLInpaintPipeline as
StableDiffusion(XL)InpaintPipeline.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

import numpy as np
import torch

from core.errors import UsageError
from demo.lora import LoraSpec, StageLoras
from demo.report import StageTimer
from demo.settings import RequestFlags, at_least
from demo.stages import Stage
from models import CLIP2Model, CLIPModel, UNetModel, VAEDecoderModel, VAEEncoderModel, stage_batch
from models.base import StageModel
from models.source import ModelSource

if TYPE_CHECKING:
    from PIL.Image import Image

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

# What a run does: the pipeline follows from it (make_pipeline), and so do the stages it needs.
TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINTING = "text-to-image", "image-to-image", "inpainting"
# How much of the schedule re-draws the input image unless the request says: diffusers' pipelines' defaults.
DEFAULT_STRENGTH = {IMAGE_TO_IMAGE: 0.8, INPAINTING: 1.0}


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


def resolve_request(flags: RequestFlags, source: ModelSource, draw_seed: Callable[[], int] = random_seed,
                    size: tuple[int, int] | None = None) -> RequestFlags:
    """The request with what the user left to the model filled in: a size (`size`, height and width, where given,
    else the model's native size), its own scheduler, and a seed from `draw_seed`."""
    height, width = size or (source.native_image_size, source.native_image_size)
    return replace(flags, height=flags.height or height, width=flags.width or width,
                   scheduler=flags.scheduler or default_scheduler_name(source),
                   seed=flags.seed if flags.seed is not None else draw_seed())


def check_request(flags: RequestFlags, source: ModelSource, mode: str = TEXT_TO_IMAGE, strength: float = 1.0) -> None:
    """A resolved request's values against their limits and the model, for `mode` at `strength` (image-to-image and
    inpainting): a one-line UsageError for the first bad one."""
    from demo.arguments import check_image_size

    at_least("--batch-size", flags.batch_size, 1)
    at_least("--denoising-steps", flags.denoising_steps, 1)
    if not (math.isfinite(flags.guidance_scale) and flags.guidance_scale >= 0):
        raise UsageError(f"--guidance-scale must be a finite number, 0 or more, got {flags.guidance_scale}")
    if not 0 <= flags.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise UsageError(f"--seed must be 0..{2**64 - 1}, got {flags.seed}")
    check_steps(make_scheduler(flags.scheduler, source), flags.scheduler, flags.denoising_steps)
    check_image_size(source, flags.height, flags.width)
    check_mode(source, mode)
    if mode != TEXT_TO_IMAGE:
        if not 0 < strength <= 1:
            raise UsageError(f"--strength must be more than 0 and at most 1, got {strength}")
        if int(flags.denoising_steps * strength) < 1:  # the steps diffusers runs: int(steps x strength)
            raise UsageError(f"--strength {strength} leaves none of the {flags.denoising_steps} denoising steps to "
                             "run; raise --strength or --denoising-steps")


def check_mode(source: ModelSource, mode: str) -> None:
    """A UsageError where the model's UNet cannot run `mode`: an inpainting UNet (mask and masked image beside the
    latents) only inpaints, other UNets must take just the latents."""
    channels = source.config("unet")["in_channels"]
    if source.inpainting and mode != INPAINTING:
        raise UsageError(f"model '{source.name}' is an inpainting model (its UNet takes {channels} channels: latents, "
                         "mask, masked image): it only inpaints, with --input-image and --mask-image")
    if not source.inpainting and channels != source.latent_channels:
        raise UsageError(f"model '{source.name}': its UNet takes {channels} channels for {source.latent_channels} "
                         "latent ones, neither an ordinary nor an inpainting UNet")


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
    image: Image | None = None  # image-to-image and inpainting: the input image (RGB), resized to height x width
    mask: Image | None = None  # inpainting: white is repainted, black kept
    strength: float = 1.0  # the part of the schedule that noises the input image and denoises it again
    # Text-to-image batches of several requests (sd-serve): one seed per image, each drawn as a one-image run of its
    # seed draws it (None: the whole batch from `seed`, as diffusers draws a batch).
    seeds: tuple[int, ...] | None = None

    @classmethod
    def from_flags(cls, flags: RequestFlags, image: Image | None = None, mask: Image | None = None,
                   strength: float | None = None) -> "GenerationRequest":
        """A resolved request's batch: its prompt and negative prompt repeated --batch-size times, and the one input
        image and mask for all of them (`strength` None: the mode's DEFAULT_STRENGTH)."""
        negatives = None if flags.negative_prompt is None else [flags.negative_prompt] * flags.batch_size
        request = cls([flags.prompt] * flags.batch_size, negatives, flags.height, flags.width, flags.denoising_steps,
                      flags.guidance_scale, flags.seed, image, mask)
        return replace(request, strength=DEFAULT_STRENGTH.get(request.mode, 1.0) if strength is None else strength)

    @property
    def mode(self) -> str:
        return INPAINTING if self.mask is not None else IMAGE_TO_IMAGE if self.image is not None else TEXT_TO_IMAGE

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    def generator(self) -> torch.Generator | list[torch.Generator]:
        """What draws the run's noise: a CPU generator of `seed`, or of each of `seeds` (diffusers draws row i of the
        latents, and a stochastic scheduler's noise, from the i-th as a one-image run draws them from its one)."""
        if self.seeds is None:
            return torch.Generator("cpu").manual_seed(self.seed)
        return [torch.Generator("cpu").manual_seed(seed) for seed in self.seeds]

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1.0


class Text2ImagePipeline:
    """diffusers' text-to-image, as step methods that the image-to-image, inpainting and SDXL pipelines reuse:
    encode_prompt -> prepare_latents -> denoise -> decode. Stages are looked up by their models' names and fed
    in their models' input order (Stage.call), so no stage or tensor name is spelt here."""

    # Whether prepare_latents runs the VAE encoder (the input image): then it is timed as its own region.
    encodes_image: ClassVar[bool] = False

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
        self.loras = StageLoras(stages)

    def stage(self, model: type[StageModel]) -> Stage:
        return self.stages[model.name]

    def timesteps(self, steps: int, strength: float = 1.0) -> torch.Tensor:
        """Sets the scheduler's timesteps for `steps` and returns those a run denoises: the last `strength` of them
        (text-to-image: all), as diffusers' image-to-image pipelines pick them."""
        self.scheduler.set_timesteps(steps, device=self.device)
        start = (steps - min(int(steps * strength), steps)) * self.scheduler.order
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(start)
        return self.scheduler.timesteps[start:]

    def unet_calls(self, steps: int, strength: float = 1.0) -> int:
        """How many times the UNet runs for `steps` (some schedulers take extra warm-up steps) at `strength`."""
        return len(self.timesteps(steps, strength))

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

    def set_loras(self, loras: Sequence[LoraSpec]) -> float | None:
        """Fuse LoRA files, (path, scale) each, added up, into the UNet and text encoders in place of those set
        before ([]: the base weights, bit for bit), without reloading: into the torch modules, or by refit into
        engines built with --build-enable-refit (demo.lora). Returns how long the engines' refit took, in ms (None:
        no engine was refitted)."""
        return self.loras.set(loras)

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

    def noise(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Noise as diffusers draws it: from the CPU generator, in fp32 (latents and the scheduler's arithmetic stay
        in fp32; only stage inputs take the stages' dtype)."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    def prepare_latents(self, request: GenerationRequest, generator: torch.Generator,
                        timesteps: torch.Tensor) -> torch.Tensor:
        """The initial latents: noise scaled by the scheduler. `timesteps` are those the run denoises (image-to-image
        noises its image for the first)."""
        shape = self.source.latent_shape(request.batch_size, request.height, request.width)
        return self.noise(shape, generator) * self.scheduler.init_noise_sigma

    def unet_sample(self, model_input: torch.Tensor) -> torch.Tensor:
        """The UNet's sample for a scaled model input (an inpainting UNet's has the mask and masked image too)."""
        return model_input

    def after_step(self, latents: torch.Tensor, next_timestep: torch.Tensor | None) -> torch.Tensor:
        """The latents after a scheduler step, on their way to `next_timestep` (None: the last step); inpainting with
        an ordinary UNet puts the kept part of the image back here."""
        return latents

    def denoise(self, request: GenerationRequest, latents: torch.Tensor, conditioning: tuple[torch.Tensor, ...],
                generator: torch.Generator, timesteps: torch.Tensor, progress=None) -> torch.Tensor:
        """The scheduler's loop over `timesteps`, with classifier-free guidance; `conditioning` as encode_prompt
        gives it."""
        unet = self.stage(UNetModel)
        step_kwargs = self._step_kwargs(generator)
        for i, t in enumerate(timesteps):
            model_input = torch.cat([latents] * 2) if request.guided else latents
            model_input = self.unet_sample(self.scheduler.scale_model_input(model_input, t))
            timestep = t.reshape(1).to(device=self.device, dtype=torch.float32)
            prediction = unet.call(model_input.to(self.dtype), timestep, *conditioning).float()
            if request.guided:
                uncond, cond = prediction.chunk(2)
                prediction = uncond + request.guidance_scale * (cond - uncond)
            latents = self.scheduler.step(prediction, t, latents, **step_kwargs, return_dict=False)[0]
            latents = self.after_step(latents, timesteps[i + 1] if i + 1 < len(timesteps) else None)
            if progress is not None:
                progress.update()
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from the VAE decoder, in its stage's dtype (fp32 where an SDXL config asks) and device."""
        vae = self.stage(VAEDecoderModel)
        return vae.call((latents / self.scaling_factor).to(vae.model.stage_dtype(self.dtype)))

    def __call__(self, request: GenerationRequest, timer: StageTimer, progress=None, pixels: bool = False) \
            -> np.ndarray:
        """Images as float32 [B, H, W, 3] in [0, 1] (diffusers' output_type="np"); with `pixels`, 8-bit ones made on
        the device (device_pixels)."""
        self.prepare(request)
        with timer.measure("pipeline"):
            with timer.measure("clip"):
                conditioning = self.encode_prompt(request)
            generator = request.generator()
            timesteps = self.timesteps(request.steps, request.strength)
            with timer.measure("vae_encoder") if self.encodes_image else contextlib.nullcontext():
                latents = self.prepare_latents(request, generator, timesteps)
            with timer.measure("unet"):
                latents = self.denoise(request, latents, conditioning, generator, timesteps, progress)
            with timer.measure("vae"):
                images = self.decode(latents)
            if pixels:
                return device_pixels(images, self.dtype)
            images = images.float().cpu()
        return postprocess(images, self.dtype)


def postprocess(images: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Decoded images in [-1, 1] as float32 [B, H, W, 3] in [0, 1], as diffusers' image processor makes them."""
    _warn_if_not_finite(images, dtype)
    return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def device_pixels(images: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Decoded images in [-1, 1] as 8-bit [B, H, W, 3], computed where they are: bit for bit to_uint8(postprocess())
    (the same float32 operations; halving is exact; both round half to even), with a quarter of the bytes to copy
    and no arithmetic on the CPU, where a server's per-GPU processes would otherwise do it side by side. Laid out
    [B, H, W, 3] in memory too (the channels moved on the device): a permuted view stays one through .cpu()."""
    _warn_if_not_finite(images, dtype)
    pixels = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def _warn_if_not_finite(images: torch.Tensor, dtype: torch.dtype) -> None:
    if not torch.isfinite(images).all():  # e.g. fp16 overflow: say so rather than save black images
        warnings.warn(f"non-finite values in the decoded images ({dtype}); they will be saved clamped",
                      RuntimeWarning, stacklevel=4)


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

    def set_loras(self, loras: Sequence[LoraSpec]) -> float | None:
        """The base's: a LoRA is made for one UNet (the refiner's differs)."""
        return self.base.set_loras(loras)

    def dropped_text(self, text: str) -> str | None:
        return self.base.dropped_text(text)

    def __call__(self, request: GenerationRequest, timer: StageTimer, progress=None, pixels: bool = False) \
            -> np.ndarray:
        self.base.prepare(request)
        self.refiner.prepare(request)
        with timer.measure("pipeline"):
            with timer.measure("clip"):
                base_conditioning = self.base.encode_prompt(request)
                refiner_conditioning = self.refiner.encode_prompt(request)
            generator = request.generator()
            base_steps, refiner_steps, start = self.split(request.steps)
            latents = self.base.prepare_latents(request, generator, base_steps)
            with timer.measure("unet"):
                latents = self.base.denoise(request, latents, base_conditioning, generator, base_steps, progress)
                if hasattr(self.refiner.scheduler, "set_begin_index"):
                    self.refiner.scheduler.set_begin_index(start)
                latents = self.refiner.denoise(request, latents, refiner_conditioning, generator, refiner_steps,
                                               progress)
            with timer.measure("vae"):
                images = self.refiner.decode(latents)
            if pixels:
                return device_pixels(images, self.refiner.dtype)
            images = images.float().cpu()
        return postprocess(images, self.refiner.dtype)


class Image2ImagePipeline(Text2ImagePipeline):
    """diffusers' StableDiffusionImg2ImgPipeline on the same steps: the input image, resized to the request's size,
    through the VAE encoder stage, sampled from the run's generator and noised to the first of the timesteps its
    strength leaves; those are denoised."""

    encodes_image = True

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler_name: str,
                 device: torch.device, dtype: torch.dtype):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(source, stages, scheduler_name, device, dtype)
        self.image_processor = VaeImageProcessor(vae_scale_factor=source.vae_scale_factor)

    def preprocess(self, request: GenerationRequest) -> torch.Tensor:
        """The input image as diffusers' image processor makes it: resized to the request's size (Lanczos), in
        [-1, 1], [1, 3, H, W] on the host."""
        return self.image_processor.preprocess(request.image, height=request.height, width=request.width)

    def encode_image(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The latents of images in [-1, 1] (fp32): the VAE encoder stage's Gaussian, in the stage's dtype (fp32 where
        an SDXL config says force_upcast), sampled from `generator` as diffusers samples it, times the scaling
        factor."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        encoder = self.stage(VAEEncoderModel)
        moments = encoder.call(images.to(device=self.device, dtype=encoder.model.stage_dtype(self.dtype)))
        return DiagonalGaussianDistribution(moments.float()).sample(generator) * self.scaling_factor

    def prepare_latents(self, request, generator, timesteps):
        """The input image's latents, repeated for the batch, noised to the first timestep by noise drawn after
        them."""
        image_latents = self.encode_image(self.preprocess(request), generator).repeat(request.batch_size, 1, 1, 1)
        noise = self.noise(image_latents.shape, generator)
        return self.scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(request.batch_size))


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

    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler_name: str,
                 device: torch.device, dtype: torch.dtype):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(source, stages, scheduler_name, device, dtype)
        self.mask_processor = VaeImageProcessor(vae_scale_factor=source.vae_scale_factor, do_normalize=False,
                                                do_binarize=True, do_convert_grayscale=True)
        self.masking: MaskLatents | None = None  # the run's, from prepare_latents

    def prepare_latents(self, request, generator, timesteps):
        """The initial latents (noise, or at strength < 1 the input image noised to the first timestep) and the
        loop's MaskLatents, the generator drawing as diffusers' does: the image's sample, the noise, the masked
        image's sample."""
        batch, inpainting_unet, full = request.batch_size, self.source.inpainting, request.strength == 1.0
        image = self.preprocess(request)
        mask = self.mask_processor.preprocess(request.mask, height=request.height, width=request.width)
        shape = self.source.latent_shape(batch, request.height, request.width)
        image_latents = None
        if not (inpainting_unet and full):  # for the noised start, or the blend
            image_latents = self.encode_image(image, generator).repeat(batch, 1, 1, 1)
        noise = self.noise(shape, generator)
        latents = (noise * self.scheduler.init_noise_sigma if full
                   else self.scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(batch)))
        latent_mask = torch.nn.functional.interpolate(mask, size=shape[2:]).to(self.device).repeat(batch, 1, 1, 1)
        if inpainting_unet:
            masked = self.encode_image(image * (mask < 0.5), generator).repeat(batch, 1, 1, 1)
            extra = torch.cat([latent_mask, masked], dim=1)
            self.masking = MaskLatents(latent_mask, torch.cat([extra] * 2) if request.guided else extra, None, noise)
        else:
            # diffusers encodes the masked image for an ordinary UNet too, which never sees it: its sample is drawn
            # all the same, so that later draws (a stochastic scheduler's) match.
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
            kept = self.scheduler.add_noise(kept, self.masking.noise, next_timestep.reshape(1))
        return (1 - self.masking.mask) * kept + self.masking.mask * latents


class SDXLImage2ImagePipeline(SDXLPipeline, Image2ImagePipeline):
    """diffusers' StableDiffusionXLImg2ImgPipeline: SDXL's conditioning, image-to-image's latents."""


class SDXLInpaintPipeline(SDXLPipeline, InpaintPipeline):
    """diffusers' StableDiffusionXLInpaintPipeline: SDXL's conditioning, inpainting's latents and UNet input."""


# mode -> (the SD 1.x/2.x pipeline, the SDXL one)
PIPELINES = {
    TEXT_TO_IMAGE: (Text2ImagePipeline, SDXLPipeline),
    IMAGE_TO_IMAGE: (Image2ImagePipeline, SDXLImage2ImagePipeline),
    INPAINTING: (InpaintPipeline, SDXLInpaintPipeline),
}


def make_pipeline(source: ModelSource, stages: dict[str, Stage], scheduler_name: str, device: torch.device,
                  dtype: torch.dtype, mode: str = TEXT_TO_IMAGE) -> Text2ImagePipeline:
    """The pipeline this model needs for `mode` (a GenerationRequest's)."""
    return PIPELINES[mode][source.is_xl](source, stages, scheduler_name, device, dtype)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats to 8-bit pixels, rounding as diffusers' numpy_to_pil does."""
    return (images * 255).round().astype(np.uint8)


def image_psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB between two 8-bit images (inf where they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
