"""Same seed, same image: our pipeline against diffusers' own for the request's mode (StableDiffusionPipeline,
StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline or their SDXL twins, as the model's model_index.json
says), on the CPU in fp32; the torch backend's stages those tests run; its input images against diffusers' image
processors' (check_input_images), with the request's scheduler options (spacing, Karras sigmas, eta, timesteps) given to
diffusers as its pipelines take them; and diffusers' UNet with the step cache written from its own modules alone
(reference_unet), for diffusers' pipelines to run cached."""

import inspect

import diffusers
import numpy as np
import torch

from demo.backends.registry import REFERENCE
from demo.backends.torch.settings import FALLBACK
from demo.pipelines import StageTimer, make_pipeline, to_uint8
from demo.pipelines.images import preprocess
from demo.request import IMAGE_TO_IMAGE, INPAINTING, Request
from demo.schedulers import SCHEDULERS, config_overrides, make_scheduler
from models import STAGE_MODELS, text_to_image_stages

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731


def torch_stages(source, names=None, settings=FALLBACK, device=CPU, dtype=torch.float32) -> dict:
    """The model's stages (`names`, else its text-to-image ones) on the torch backend with `settings` (default: the
    diffusers modules as they are)."""
    models = [STAGE_MODELS[name](source) for name in names or text_to_image_stages(source)]
    return REFERENCE.create_stages(models, lambda _: settings, device, dtype, QUIET, QUIET)


def check_input_images(device: torch.device) -> None:
    """demo.pipelines.images.preprocess on `device` makes what diffusers' image processors make on the CPU, bit for
    bit: with the input image's, the mask's and a control image's processor (as diffusers' pipelines configure
    them), for random RGB and grayscale images at their own size and resized."""
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    mask = dict(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    processors = (VaeImageProcessor(vae_scale_factor=8), VaeImageProcessor(vae_scale_factor=8, **mask),
                  VaeImageProcessor(vae_scale_factor=8, do_convert_rgb=True, do_normalize=False))
    pixels = np.random.default_rng(5).integers(0, 256, (64, 48, 3), dtype=np.uint8)
    images = (Image.fromarray(pixels), Image.fromarray(pixels[..., 0]))
    for processor in processors:
        for image in images:
            for height, width in ((64, 48), (40, 56)):
                expected = processor.preprocess(image, height=height, width=width)
                made = preprocess(processor, image, height, width, device)
                assert made.device.type == device.type and made.is_contiguous()
                assert made.dtype == expected.dtype, (made.dtype, expected.dtype)
                assert torch.equal(made.cpu(), expected), (processor.config, image.mode, height, width)


def diffusers_images(source, scheduler: str, request: Request, **components) -> np.ndarray:
    """diffusers' pipeline for the model and the request's mode (with `components` in place of its own), as 8-bit
    pixels."""
    reference = getattr(diffusers, source.family.diffusers_pipeline(request.mode))
    ref = reference.from_pretrained(source.path, **source.family.diffusers_options, **components)
    overrides = config_overrides(request.timestep_spacing, request.karras_sigmas)
    ref.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(ref.scheduler.config, **overrides)
    ref.set_progress_bar_config(disable=True)
    inputs = dict(height=request.height, width=request.width)
    if request.eta is not None:
        inputs["eta"] = request.eta
    if request.timesteps is not None:
        inputs["timesteps"] = list(request.timesteps)
    if request.mode == IMAGE_TO_IMAGE:
        if "height" not in inspect.signature(ref.__call__).parameters:  # its size the image's (SD's, SDXL's)
            del inputs["height"], inputs["width"]
        inputs.update(image=request.image, strength=request.strength)
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
    made = make_scheduler(scheduler, source, request.timestep_spacing, request.karras_sigmas)
    ours = to_uint8(make_pipeline(source, stages, made, CPU, torch.float32, request.mode)(request, StageTimer(CPU)))
    theirs = diffusers_images(source, scheduler, request, **components)
    assert ours.shape == theirs.shape == (request.images, request.height, request.width, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
    assert ours.std() > 5
    return ours


def entry_module(unet, branch: int) -> torch.nn.Module:
    """The diffusers module whose output enters the up layer that consumes skip `branch` (counted as the UNet's
    forward collects its down_block_res_samples): the reference cache replaces its output."""
    down_outputs = 1 + sum(len(block.resnets) + (block.downsamplers is not None) for block in unet.down_blocks)
    entry = down_outputs - 1 - branch
    if entry == 0:
        return unet.mid_block
    layers = [(block, layer) for block in unet.up_blocks for layer in range(len(block.resnets))]
    block, layer = layers[entry - 1]
    if layer == len(block.resnets) - 1 and block.upsamplers is not None:
        return block.upsamplers[0]
    return block.attentions[layer] if getattr(block, "attentions", None) is not None else block.resnets[layer]


def reference_unet(source, interval: int, branch: int):
    """diffusers' UNet, cached as the step cache does it, by diffusers' modules alone."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(source.component_dir("unet"))
    module, state = entry_module(unet, branch), {"calls": 0, "kept": None}
    forward, module_forward = unet.forward, module.forward

    def unet_forward(*args, **kwargs):
        state["full"] = state["calls"] % interval == 0
        state["calls"] += 1
        return forward(*args, **kwargs)

    def cached_module_forward(*args, **kwargs):
        output = module_forward(*args, **kwargs)
        if state["full"]:
            state["kept"] = output
        return state["kept"]

    unet.forward, module.forward = unet_forward, cached_module_forward
    return unet
