"""INT8 and FP8 calibration's renders: the UNet's own activations, recorded while the torch pipeline renders the
calibration prompts (the engines' side, and the cache of what it records, is demo.backends.tensorrt.int8; the torch
backend's FP8 UNet reads the same cache: demo.backends.torch.fp8)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from demo.pipelines.timer import StageTimer
from demo.request import TEXT_TO_IMAGE, Request
from demo.runtime.spec import PipelineSpec, reference_spec
from models.quantize import ActivationRecorder, Calibration


def calibration_spec(spec: PipelineSpec) -> PipelineSpec:
    """The pipeline calibration renders with: the model's own torch modules as they are (reference_spec), in the
    backend's own precision there, text-to-image."""
    return replace(reference_spec(spec), precision="auto", modes=(TEXT_TO_IMAGE,), height=None, width=None,
                   batch_size=1, max_batch_size=None, guided=True, controlnets=())


def record_unet_activations(pipeline, prompts: tuple[str, ...], steps: int, scheduler: str, guidance_scale: float,
                            height: int, width: int, progress: Callable[[str], None]) -> Calibration:
    """Renders each prompt (seed = its index) on `pipeline` (a loaded calibration_spec pipeline), recording the
    UNet's Linear and Conv2d inputs (models.quantize.ActivationRecorder)."""
    unet = pipeline.stages["unet"]
    with ActivationRecorder(unet.model.component_module(unet.module)) as recorder:
        for index, prompt in enumerate(prompts):
            progress(f"[calibration] the UNet's activations: prompt {index + 1}/{len(prompts)}, {steps} steps")
            request = Request(prompt, height=height, width=width, denoising_steps=steps, guidance_scale=guidance_scale,
                              scheduler=scheduler, seed=index)
            pipeline.run([request], StageTimer(pipeline.device))
    return recorder.calibration()
