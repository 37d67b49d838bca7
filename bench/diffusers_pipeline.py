"""diffusers' own pipeline as a benchmark contender: the family's text-to-image pipeline (StableDiffusion(XL)Pipeline,
StableDiffusion3Pipeline), or its ControlNet twin with the run's ControlNets, loaded from the model's folder as a
diffusers user loads it; the denoiser (UNet or SD3's transformer), ControlNets and VAE in channels-last memory and
compiled with torch.compile(mode="reduce-overhead"), as diffusers' guides make it fast. The other
contenders run diffusers' modules inside our pipeline's loop; this one runs diffusers' loop too. Timed in the regions
our pipeline reports (demo.pipelines.StageTimer): the text encoders, the denoising loop (from the initial latents to
the last scheduler step), the VAE decode, and the whole call up to the images on the host."""

from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np
import torch

from demo.pipelines import StageTimer
from demo.request import TEXT_TO_IMAGE, Request
from models.controlnet import resolve_controlnet
from models.source import ModelSource


class DiffusersPipeline:
    """One diffusers pipeline, compiled where `compile_mode` says (None: eager), called per request like ours."""

    def __init__(self, source: ModelSource, controlnets: tuple[tuple[str, float], ...], device: torch.device,
                 dtype: torch.dtype, compile_mode: str | None = "reduce-overhead"):
        import diffusers

        self.source, self.device = source, device
        sources = [resolve_controlnet(name, source) for name, _ in controlnets]
        nets = [net.diffusers_class.from_pretrained(net.path, torch_dtype=dtype) for net in sources]
        self.scales = [scale for _, scale in controlnets]
        family = source.family
        extra = dict(family.diffusers_options)
        if nets:
            extra["controlnet"] = nets if len(nets) > 1 else nets[0]
        pipe = getattr(diffusers, family.diffusers_pipeline(TEXT_TO_IMAGE, bool(nets))).from_pretrained(
            source.path, torch_dtype=dtype, **extra)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        # SDXL's pipelines cast a VAE whose config forces fp32 to it at every call: that one stays eager.
        vae_compiled = not (dtype == torch.float16 and family.fp16_runs_fp32("vae", pipe.vae.config))
        if compile_mode is not None:
            denoiser = getattr(pipe, family.denoiser)  # the UNet, or SD3's transformer
            for module in (denoiser, *nets, *([pipe.vae] if vae_compiled else [])):
                module.to(memory_format=torch.channels_last)
            setattr(pipe, family.denoiser, torch.compile(denoiser, mode=compile_mode))
            if len(nets) == 1:
                pipe.controlnet = torch.compile(pipe.controlnet, mode=compile_mode)
            elif nets:  # diffusers' MultiControlNetModel calls each of its nets
                pipe.controlnet.nets = torch.nn.ModuleList(torch.compile(net, mode=compile_mode) for net in nets)
            if vae_compiled:
                pipe.vae.decode = torch.compile(pipe.vae.decode, mode=compile_mode)
        self.pipe = pipe
        self._timer, self._loop = StageTimer(device), contextlib.ExitStack()  # each call's (__call__)
        pipe.encode_prompt = self._timed("clip", pipe.encode_prompt)
        pipe.vae.decode = self._timed("vae", pipe.vae.decode)
        prepare_latents = pipe.prepare_latents

        @functools.wraps(prepare_latents)
        def loop_starts(*args, **kwargs):  # the loop's region opens once the initial latents are made
            latents = prepare_latents(*args, **kwargs)
            self._loop.enter_context(self._timer.measure("unet"))
            return latents

        pipe.prepare_latents = loop_starts

    def _timed(self, region: str, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            with self._timer.measure(region):
                return method(*args, **kwargs)
        return timed

    def _step_end(self, pipe, step: int, timestep, tensors: dict) -> dict:
        if step == pipe.num_timesteps - 1:
            self._loop.close()
        return {}

    def __call__(self, request: Request, timer: StageTimer | None = None) -> np.ndarray:
        """The request's images (text-to-image) as float32 [B, H, W, 3] in [0, 1]; `timer` gets the regions."""
        self._timer = timer or StageTimer(self.device)
        self._loop = contextlib.ExitStack()  # a call that failed mid-loop leaves nothing open for the next
        inputs = {}
        self.pipe.scheduler = request.make_scheduler(self.source)
        if request.eta is not None:  # as its pipelines take the scheduler's options (the rest are its config's)
            inputs["eta"] = request.eta
        if request.timesteps is not None:
            inputs["timesteps"] = list(request.timesteps)
        if self.scales:
            images = list(request.control_images)
            takes = inspect.signature(self.pipe.__call__).parameters
            # SD3's and Flux's pipelines name the control image control_image (image: an input image), and have no
            # guess mode
            inputs.update({"control_image" if "control_image" in takes else "image":
                           images if len(images) > 1 else images[0]},
                          controlnet_conditioning_scale=self.scales if len(self.scales) > 1 else self.scales[0],
                          control_guidance_start=request.control_guidance_start,
                          control_guidance_end=request.control_guidance_end)
            if "guess_mode" in takes:
                inputs["guess_mode"] = request.guess_mode
        with self._timer.measure("pipeline"):
            images = self.pipe(request.prompts, negative_prompt=request.negative_prompts, height=request.height,
                               width=request.width, num_inference_steps=request.denoising_steps,
                               guidance_scale=request.guidance_scale,
                               generator=torch.Generator("cpu").manual_seed(request.seed), output_type="pt",
                               callback_on_step_end=self._step_end, **inputs).images
            images = images.float().cpu()
        return images.permute(0, 2, 3, 1).numpy()

    def unet_calls(self) -> int:
        """How many times the last call ran the denoiser."""
        return self.pipe.num_timesteps
