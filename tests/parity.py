"""Same seed, same image: our pipeline against diffusers' own (StableDiffusionPipeline or StableDiffusionXLPipeline,
as the model's model_index.json says), on the CPU in fp32."""

import diffusers
import numpy as np
import torch

from demo.pipeline import SCHEDULERS, GenerationRequest, make_pipeline, to_uint8
from demo.report import StageTimer

CPU = torch.device("cpu")


def diffusers_images(source, scheduler: str, request: GenerationRequest, **components) -> np.ndarray:
    """diffusers' pipeline for the model (with `components` in place of its own), as 8-bit pixels."""
    if source.is_xl:
        ref = diffusers.StableDiffusionXLPipeline.from_pretrained(source.path, **components)
    else:
        ref = diffusers.StableDiffusionPipeline.from_pretrained(source.path, safety_checker=None,
                                                                requires_safety_checker=False, **components)
    ref.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(ref.scheduler.config)
    ref.set_progress_bar_config(disable=True)
    images = ref(
        request.prompts, negative_prompt=request.negative_prompts, height=request.height, width=request.width,
        num_inference_steps=request.steps, guidance_scale=request.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np",
    ).images
    return (images * 255).round().astype(np.uint8)


def check_parity(source, stages, scheduler: str, request: GenerationRequest, **components) -> np.ndarray:
    """Our image against diffusers' within 2/255, and a real image (not a constant); returns ours."""
    ours = to_uint8(make_pipeline(source, stages, scheduler, CPU, torch.float32)(request, StageTimer(CPU)))
    theirs = diffusers_images(source, scheduler, request, **components)
    assert ours.shape == theirs.shape == (request.batch_size, request.height, request.width, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
    assert ours.std() > 5
    return ours
