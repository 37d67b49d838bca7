"""SD3 and SD3.5 (MMDiT): two CLIP text encoders (their penultimate states and pooled projections) and an optional T5
(its last states; a model without it attends to zeros in their place, as diffusers' pipelines do), a transformer that
predicts a rectified flow (only flow-matching schedulers step it), classifier-free guidance, a 16-channel VAE whose
latents are shifted as well as scaled. Its inpainting models' transformer takes 33 channels (the latents, the mask,
the masked image's latents), as StableDiffusion3InpaintPipeline feeds it."""

from models import CLIP, CLIP2, T5, TRANSFORMER
from models.families.base import (
    ADAPTIVE_CACHE,
    CACHE_FORECAST,
    CONTROLNET,
    ENGINES,
    IMAGE_TO_IMAGE,
    INPAINTING,
    LORA,
    TEXT_TO_IMAGE,
    Family,
)
from models.recommended import Recommended

# diffusers' SD3 pipelines' own defaults (num_inference_steps, guidance_scale): a model folder of each class gets them
TEXT_TO_IMAGE_RECOMMENDED = Recommended(denoising_steps=28, guidance_scale=7.0)
IMAGE_RECOMMENDED = Recommended(denoising_steps=50, guidance_scale=7.0)

SD3 = Family(
    name="sd3",
    label="SD3",
    pipeline_classes=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline",
                      "StableDiffusion3InpaintPipeline"),
    components=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3",
                "transformer", "vae", "scheduler"),
    optional=("text_encoder_3", "tokenizer_3"),  # model_index.json names them null where a model has no T5
    text_stages=(CLIP, CLIP2, T5),
    diffusers_pipelines={TEXT_TO_IMAGE: ("StableDiffusion3Pipeline", "StableDiffusion3ControlNetPipeline"),
                         IMAGE_TO_IMAGE: ("StableDiffusion3Img2ImgPipeline", None),
                         INPAINTING: ("StableDiffusion3InpaintPipeline",
                                      "StableDiffusion3ControlNetInpaintingPipeline")},
    features=frozenset({IMAGE_TO_IMAGE, INPAINTING, CONTROLNET, LORA, ENGINES, ADAPTIVE_CACHE,
                        CACHE_FORECAST}),
    # bf16 where TensorRT builds it (10+, TensorRT for RTX); TensorRT 8.6 builds the transformer in fp16, T5 in fp32
    bf16_engines={T5: "fp32", TRANSFORMER: "fp16"},
    # on engines: image-to-image; inpainting, the step caches, LoRA (refit), ControlNets, INT8 not yet
    engine_features=frozenset({IMAGE_TO_IMAGE}),
    denoiser="transformer",
    denoiser_stage=TRANSFORMER,
    penultimate_text=True,
    lora_components=("transformer", "text_encoder", "text_encoder_2"),  # diffusers' SD3LoraLoaderMixin's (no T5)
    denoiser_classes=("SD3Transformer2DModel",),
    controlnet_class="SD3ControlNetModel",
    text_width_key="joint_attention_dim",
    pooled_text=(CLIP, CLIP2),
    pooled_width_key="pooled_projection_dim",
    t5_length=256,
    t5_tokenizer="tokenizer_3",
    precisions=("bf16", "fp16", "fp32"),
    gpu_precision="bf16",  # as diffusers' guides run it; T5's feed-forward overflows fp16
    flow_matching=True,
    shifts_latents=True,
    recommended={"StableDiffusion3Pipeline": TEXT_TO_IMAGE_RECOMMENDED,
                 "StableDiffusion3Img2ImgPipeline": IMAGE_RECOMMENDED,
                 "StableDiffusion3InpaintPipeline": IMAGE_RECOMMENDED},
)
