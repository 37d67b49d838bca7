"""SDXL (base and refiner): two text encoders whose penultimate states are the context (a refiner has the second
alone), the second one's pooled embeddings and the time ids as the UNet's added conditions, a VAE that overflows in
fp16."""

from models import CLIP, CLIP2
from models.families.base import (
    ADAPTIVE_CACHE,
    CONTROLNET,
    ENGINES,
    GUESS_MODE,
    IMAGE_TO_IMAGE,
    INPAINTING,
    INT8,
    LORA,
    REFINER,
    STEP_CACHE,
    TEXT_TO_IMAGE,
    UNET_PRECISIONS,
    Family,
)

SDXL = Family(
    name="sdxl",
    label="SDXL",
    pipeline_classes=("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                      "StableDiffusionXLInpaintPipeline", "StableDiffusionXLControlNetPipeline",
                      "StableDiffusionXLControlNetImg2ImgPipeline", "StableDiffusionXLControlNetInpaintPipeline"),
    components=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "unet", "vae", "scheduler"),
    optional=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),  # model_index.json names those it has
    text_stages=(CLIP, CLIP2),
    diffusers_pipelines={
        TEXT_TO_IMAGE: ("StableDiffusionXLPipeline", "StableDiffusionXLControlNetPipeline"),
        IMAGE_TO_IMAGE: ("StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLControlNetImg2ImgPipeline"),
        INPAINTING: ("StableDiffusionXLInpaintPipeline", "StableDiffusionXLControlNetInpaintPipeline"),
    },
    precisions=UNET_PRECISIONS,
    features=frozenset({ENGINES, STEP_CACHE, ADAPTIVE_CACHE, CONTROLNET, GUESS_MODE, REFINER, INPAINTING,
                        IMAGE_TO_IMAGE, LORA, INT8}),
    penultimate_text=True,
    pooled_text=(CLIP2,),
    added_conditions=("text_embeds", "time_ids"),
    upcast_vae=True,
    tuned_key="sdxl",
    lora_components=("unet", "text_encoder", "text_encoder_2"),
    refiner_components=("text_encoder_2",),  # what a refiner reads the prompt with (SDXL's refiner has it alone)
)
