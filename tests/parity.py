"""Same seed, same image: our pipeline against diffusers' own for the request's mode (StableDiffusionPipeline,
StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline or their SDXL twins, as the model's model_index.json
says), on the CPU in fp32; and the torch backend's stages those tests run."""

import diffusers
import numpy as np
import torch

from demo.backends.registry import REFERENCE
from demo.backends.torch.settings import FALLBACK
from demo.pipelines import StageTimer, make_pipeline, to_uint8
from demo.request import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE, Request
from demo.schedulers import SCHEDULERS
from models import STAGE_MODELS, text_to_image_stages

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731


def torch_stages(source, names=None, settings=FALLBACK, device=CPU, dtype=torch.float32) -> dict:
    """The model's stages (`names`, else its text-to-image ones) on the torch backend with `settings` (default: the
    diffusers modules as they are)."""
    models = [STAGE_MODELS[name](source) for name in names or text_to_image_stages(source)]
    return REFERENCE.create_stages(models, lambda _: settings, device, dtype, QUIET, QUIET)
# A request's mode -> diffusers' pipelines for it (SD 1.x/2.x, SDXL).
REFERENCES = {
    TEXT_TO_IMAGE: ("StableDiffusionPipeline", "StableDiffusionXLPipeline"),
    IMAGE_TO_IMAGE: ("StableDiffusionImg2ImgPipeline", "StableDiffusionXLImg2ImgPipeline"),
    INPAINTING: ("StableDiffusionInpaintPipeline", "StableDiffusionXLInpaintPipeline"),
}


def diffusers_images(source, scheduler: str, request: Request, **components) -> np.ndarray:
    """diffusers' pipeline for the model and the request's mode (with `components` in place of its own), as 8-bit
    pixels."""
    reference = getattr(diffusers, REFERENCES[request.mode][source.is_xl])
    no_checker = {} if source.is_xl else dict(safety_checker=None, requires_safety_checker=False)
    ref = reference.from_pretrained(source.path, **no_checker, **components)
    ref.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(ref.scheduler.config)
    ref.set_progress_bar_config(disable=True)
    inputs = dict(height=request.height, width=request.width)
    if request.mode == IMAGE_TO_IMAGE:  # diffusers' image-to-image takes its size from the image
        inputs = dict(image=request.image, strength=request.strength)
    elif request.mode == INPAINTING:
        inputs.update(image=request.image, mask_image=request.mask, strength=request.strength)
    images = ref(
        request.prompts, negative_prompt=request.negative_prompts, num_inference_steps=request.denoising_steps,
        guidance_scale=request.guidance_scale, generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np", **inputs,
    ).images
    return (images * 255).round().astype(np.uint8)


def check_parity(source, stages, scheduler: str, request: Request, **components) -> np.ndarray:
    """Our image against diffusers' within 2/255, and a real image (not a constant); returns ours."""
    ours = to_uint8(make_pipeline(source, stages, scheduler, CPU, torch.float32, request.mode)(request,
                                                                                             StageTimer(CPU)))
    theirs = diffusers_images(source, scheduler, request, **components)
    assert ours.shape == theirs.shape == (request.images, request.height, request.width, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
    assert ours.std() > 5
    return ours
