"""SD 1.x/2.x: one CLIP text encoder (its last layer's states), a UNet with no added conditions, classifier-free
guidance (or the scale embedded, where the UNet takes it: LCM)."""

from models import CLIP
from models.families.base import (
    ADAPTIVE_CACHE,
    CONTROLNET,
    ENGINES,
    GUESS_MODE,
    IMAGE_TO_IMAGE,
    INPAINTING,
    INT8,
    LORA,
    STEP_CACHE,
    TEXT_TO_IMAGE,
    UNET_PRECISIONS,
    Family,
)
from models.recommended import Recommended

# diffusers' LatentConsistencyModel pipelines' own defaults (num_inference_steps, guidance_scale)
LCM_RECOMMENDED = Recommended(denoising_steps=4, guidance_scale=8.5)

SD = Family(
    name="sd",
    label="SD 1.x/2.x",
    pipeline_classes=("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline",
                      "StableDiffusionControlNetPipeline", "StableDiffusionControlNetImg2ImgPipeline",
                      "StableDiffusionControlNetInpaintPipeline", "LatentConsistencyModelPipeline",
                      "LatentConsistencyModelImg2ImgPipeline"),
    components=("text_encoder", "tokenizer", "unet", "vae", "scheduler"),
    text_stages=(CLIP,),
    diffusers_pipelines={
        TEXT_TO_IMAGE: ("StableDiffusionPipeline", "StableDiffusionControlNetPipeline"),
        IMAGE_TO_IMAGE: ("StableDiffusionImg2ImgPipeline", "StableDiffusionControlNetImg2ImgPipeline"),
        INPAINTING: ("StableDiffusionInpaintPipeline", "StableDiffusionControlNetInpaintPipeline"),
    },
    precisions=UNET_PRECISIONS,
    features=frozenset({ENGINES, STEP_CACHE, ADAPTIVE_CACHE, CONTROLNET, GUESS_MODE, INPAINTING, IMAGE_TO_IMAGE,
                        LORA, INT8}),
    lora_components=("unet", "text_encoder"),
    diffusers_options={"safety_checker": None, "requires_safety_checker": False},
    recommended=dict.fromkeys(("LatentConsistencyModelPipeline", "LatentConsistencyModelImg2ImgPipeline"),
                              LCM_RECOMMENDED),
)
