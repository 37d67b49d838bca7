"""FLUX.1 ([dev] and [schnell]): a CLIP text encoder read for its pooled output alone and a T5 (its last states, 512
tokens), a transformer that predicts a rectified flow on the latents packed 2x2 into tokens, its sigmas shifted by the
image's token count (the scheduler's dynamic shifting), a 16-channel VAE whose latents are shifted as well as scaled.
[dev] embeds the guidance scale in its transformer (guidance_embeds: one half a step, no negative prompt); [schnell]
embeds none and takes no scale."""

from models import CLIP, FLUX_TRANSFORMER, T5
from models.families.base import (
    ADAPTIVE_CACHE,
    CACHE_FORECAST,
    CONTROLNET,
    ENGINES,
    IMAGE_TO_IMAGE,
    INPAINTING,
    LORA,
    NO_GUIDANCE,
    TEXT_TO_IMAGE,
    Family,
)
from models.recommended import Recommended

# diffusers' FluxPipeline's own defaults (num_inference_steps, guidance_scale), and FLUX.1 [schnell]'s as diffusers'
# docs run it (4 steps, guidance 0: it embeds none); its image-to-image pipeline's defaults are [dev]'s 28 at 7.0
TEXT_TO_IMAGE_RECOMMENDED = Recommended(denoising_steps=28, guidance_scale=3.5)
IMAGE_RECOMMENDED = Recommended(denoising_steps=28, guidance_scale=7.0)
SCHNELL_RECOMMENDED = Recommended(denoising_steps=4, guidance_scale=0.0)
PIPELINE_CLASSES = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline")

FLUX = Family(
    name="flux",
    label="Flux.1",
    pipeline_classes=PIPELINE_CLASSES,
    components=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer", "vae", "scheduler"),
    text_stages=(CLIP, T5),
    diffusers_pipelines={TEXT_TO_IMAGE: ("FluxPipeline", "FluxControlNetPipeline"),
                         IMAGE_TO_IMAGE: ("FluxImg2ImgPipeline", "FluxControlNetImg2ImgPipeline"),
                         INPAINTING: ("FluxInpaintPipeline", "FluxControlNetInpaintPipeline")},
    features=frozenset({IMAGE_TO_IMAGE, INPAINTING, CONTROLNET, LORA, ENGINES, ADAPTIVE_CACHE,
                        CACHE_FORECAST}),
    inpainting_denoisers=False,  # FluxInpaintPipeline blends; FLUX.1 Fill (FluxFillPipeline) is another pipeline
    # bf16 where TensorRT builds it (10+, TensorRT for RTX); TensorRT 8.6 builds the transformer in fp16, T5 in fp32
    bf16_engines={T5: "fp32", FLUX_TRANSFORMER: "fp16"},
    # on engines: image-to-image; inpainting, the step caches, LoRA (refit), ControlNets, INT8 not yet
    engine_features=frozenset({IMAGE_TO_IMAGE}),
    denoiser="transformer",
    denoiser_stage=FLUX_TRANSFORMER,
    denoiser_classes=("FluxTransformer2DModel",),
    controlnet_class="FluxControlNetModel",
    lora_components=("transformer", "text_encoder"),  # diffusers' FluxLoraLoaderMixin's (its CLIP; no T5)
    text_width_key="joint_attention_dim",
    pooled_text=(CLIP,),
    pooled_width_key="pooled_projection_dim",
    t5_length=512,
    t5_tokenizer="tokenizer_2",
    precisions=("bf16", "fp16", "fp32"),
    gpu_precision="bf16",  # as diffusers' guides run it; T5's feed-forward overflows fp16
    tuned_key="flux",  # its own --plugins auto entry: TensorRT 8.6 cannot build its transformer with our plugins
    flow_matching=True,
    shifts_latents=True,
    guidance_key="guidance_embeds",
    unembedded_guidance=NO_GUIDANCE,
    projected_pooled=False,
    stage_components={T5: "text_encoder_2"},
    packed_latents=2,
    default_sample_size=128,
    recommended={"FluxPipeline": TEXT_TO_IMAGE_RECOMMENDED, "FluxImg2ImgPipeline": IMAGE_RECOMMENDED,
                 "FluxInpaintPipeline": IMAGE_RECOMMENDED,
                 **{(name, NO_GUIDANCE): SCHNELL_RECOMMENDED for name in PIPELINE_CLASSES}},
)
