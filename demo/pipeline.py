"""Text-to-image: tokenize -> CLIP -> denoising loop with classifier-free guidance -> VAE decode.

The arithmetic follows diffusers' StableDiffusionPipeline step for step (latents drawn from a CPU
generator, scheduler scaling, guidance, the scheduler's own step), so with the torch backend the same
seed gives the same image as diffusers.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from core.errors import UsageError
from demo.report import StageTimer
from demo.stages import Stage
from models import stage_batch
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


@dataclass(frozen=True)
class GenerationRequest:
    prompts: list[str]
    negative_prompts: list[str]
    height: int
    width: int
    steps: int
    guidance_scale: float
    seed: int

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1.0


class Text2ImagePipeline:
    def __init__(self, source: ModelSource, stages: dict[str, Stage], scheduler_name: str,
                 device: torch.device, dtype: torch.dtype):
        from transformers import CLIPTokenizer

        self.source = source
        self.stages = stages
        self.scheduler = make_scheduler(scheduler_name, source)
        self.tokenizer = CLIPTokenizer.from_pretrained(source.path, subfolder="tokenizer")
        self.device = device
        self.dtype = dtype
        self.scaling_factor = source.config("vae")["scaling_factor"]

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

    def _token_ids(self, texts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(
            texts, padding="max_length", max_length=self.source.text_length, truncation=True, return_tensors="pt"
        ).input_ids
        return ids.to(device=self.device, dtype=torch.int32)

    def _step_kwargs(self, generator: torch.Generator) -> dict:
        # As diffusers does: stochastic schedulers (e.g. Euler ancestral) draw from the same generator.
        accepted = inspect.signature(self.scheduler.step).parameters
        kwargs = {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0
        if "generator" in accepted:
            kwargs["generator"] = generator
        return kwargs

    def __call__(self, request: GenerationRequest, timer: StageTimer, progress=None) -> np.ndarray:
        """Images as float32 [B, H, W, 3] in [0, 1] (diffusers' output_type="np")."""
        from diffusers.utils.torch_utils import randn_tensor

        for name, stage in self.stages.items():
            stage.prepare(stage_batch(name, request.batch_size, request.guided), request.height, request.width)
        with timer.measure("pipeline"):
            with timer.measure("clip"):
                texts = (request.negative_prompts + request.prompts) if request.guided else request.prompts
                embeddings = self.stages["clip"]({"input_ids": self._token_ids(texts)})["text_embeddings"]
                embeddings = embeddings.to(self.dtype)

            generator = torch.Generator("cpu").manual_seed(request.seed)
            self.scheduler.set_timesteps(request.steps, device=self.device)
            # Latents and the scheduler's arithmetic stay in fp32; only stage inputs take the stages' dtype.
            latents = randn_tensor(
                self.source.latent_shape(request.batch_size, request.height, request.width),
                generator=generator, device=self.device, dtype=torch.float32,
            )
            latents = latents * self.scheduler.init_noise_sigma
            step_kwargs = self._step_kwargs(generator)

            with timer.measure("unet"):
                for t in self.scheduler.timesteps:
                    model_input = torch.cat([latents] * 2) if request.guided else latents
                    model_input = self.scheduler.scale_model_input(model_input, t)
                    prediction = self.stages["unet"]({
                        "sample": model_input.to(self.dtype),
                        "timestep": t.reshape(1).to(device=self.device, dtype=torch.float32),
                        "encoder_hidden_states": embeddings,
                    })["latent"].float()
                    if request.guided:
                        uncond, cond = prediction.chunk(2)
                        prediction = uncond + request.guidance_scale * (cond - uncond)
                    latents = self.scheduler.step(prediction, t, latents, **step_kwargs, return_dict=False)[0]
                    if progress is not None:
                        progress.update()

            with timer.measure("vae"):
                images = self.stages["vae"]({"latent": (latents / self.scaling_factor).to(self.dtype)})["images"]
            images = images.float().cpu()
        if not torch.isfinite(images).all():  # e.g. fp16 overflow: say so rather than save black images
            warnings.warn(f"non-finite values in the decoded images ({self.dtype}); they will be saved clamped",
                          RuntimeWarning, stacklevel=2)
        return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats to 8-bit pixels, rounding as diffusers' numpy_to_pil does."""
    return (images * 255).round().astype(np.uint8)


def image_psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB between two 8-bit images (inf where they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
