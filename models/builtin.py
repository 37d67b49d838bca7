"""Built-in models: `shapes`, `scenes` and `scenes-sd3`, trained and shipped (models/shapes, models/scenes,
models/scenes_sd3), and real diffusers architectures with deterministic random weights.

They need no network and no checkpoint, so the demo, the tests and the benchmarks run anywhere. `shapes` draws what
its prompt says (one shape), `scenes` several objects with patterns (the quality yardstick's), `scenes-sd3` the same
world with SD3's transformer family (the yardstick's transformer); the others have
random weights, so they draw noise-like images, but their architectures are real. A generated built-in is written
once as a diffusers-format directory and then loaded like any other.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Callable

from core.atomic import atomic_directory, discard_directory, file_lock, writable_reason
from core.errors import RunFailure, UsageError
from models import scenes, scenes_sd3, shapes
from models.families import FLUX, IMAGE_TO_IMAGE, INPAINTING, SD, SD3, SDXL, TEXT_TO_IMAGE
from models.families.base import GUIDANCE_EMBEDDING_KEY
from models.validate import check_weight_file

# Bump when the generated files change, so cached directories (and artifacts keyed by them) are rebuilt.
BUILTIN_FORMAT_VERSION = 2  # 2: a manifest of the generated files

BOS, EOS = "<|startoftext|>", "<|endoftext|>"

# SD 1.5's scheduler configuration (PNDM, scaled-linear betas, epsilon prediction).
SD15_SCHEDULER = {
    "_class_name": "PNDMScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "clip_sample": False,
    "prediction_type": "epsilon",
}

BUILTIN_MODELS = {
    # Seconds on a CPU, yet every pattern the optimizers care about: self- and cross-attention,
    # GroupNorm, LayerNorm, GEGLU. Its VAE downsamples by 2 (not SD's 8) and its widths are not SD's,
    # which keeps the code honest about reading architecture numbers from the configs.
    "tiny": {
        "unet": {
            "sample_size": 32,
            "in_channels": 4,
            "out_channels": 4,
            "block_out_channels": [32, 64],
            "layers_per_block": 2,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
            "cross_attention_dim": 32,
            "attention_head_dim": 8,
            "norm_num_groups": 8,
        },
        "vae": {
            "in_channels": 3,
            "out_channels": 3,
            "block_out_channels": [32, 64],
            "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
            "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
            "latent_channels": 4,
            "layers_per_block": 1,
            "norm_num_groups": 8,
            "sample_size": 64,
            "scaling_factor": 0.18215,
        },
        "text_encoder": {
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "max_position_embeddings": 77,
            "projection_dim": 32,
            "vocab_size": 1000,
            "hidden_act": "quick_gelu",
        },
        "vocab_size": 1000,
        "scheduler": SD15_SCHEDULER,
    },
    # The exact Stable Diffusion 1.5 architecture (UNet 860M, VAE 84M, CLIP ViT-L/14 text 123M parameters).
    "sd1.5-arch": {
        "unet": {
            "sample_size": 64,
            "in_channels": 4,
            "out_channels": 4,
            "block_out_channels": [320, 640, 1280, 1280],
            "layers_per_block": 2,
            "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
            "cross_attention_dim": 768,
            "attention_head_dim": 8,
            "norm_num_groups": 32,
        },
        "vae": {
            "in_channels": 3,
            "out_channels": 3,
            "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4,
            "latent_channels": 4,
            "layers_per_block": 2,
            "norm_num_groups": 32,
            "sample_size": 512,
            "scaling_factor": 0.18215,
        },
        "text_encoder": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 77,
            "projection_dim": 768,
            "vocab_size": 49408,
            "hidden_act": "quick_gelu",
        },
        "vocab_size": 4096,
        "scheduler": SD15_SCHEDULER,
    },
}

# SDXL 1.0's scheduler configuration (Euler, scaled-linear betas, leading timestep spacing, epsilon prediction).
SDXL_SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
    "prediction_type": "epsilon",
}

# SDXL: two text encoders (CLIP ViT-L's penultimate states, concatenated with OpenCLIP bigG's, whose pooled and
# projected output joins the time ids as the UNet's added conditions), linear projections in the transformers.
BUILTIN_MODELS.update({
    # Seconds on a CPU: both text encoders, text-time added conditions, linear projections, two transformer
    # layers in the attention block, 16-wide attention heads (our kernels take them).
    "tiny-xl": {
        "unet": {
            **{k: v for k, v in BUILTIN_MODELS["tiny"]["unet"].items() if k != "attention_head_dim"},
            "attention_head_dim": [2, 4],  # diffusers' name for the number of heads (SDXL: 5, 10, 20)
            "transformer_layers_per_block": [1, 2],
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 6 * 8 + 32,  # six time ids, and text_encoder_2's projection
            "cross_attention_dim": 64,  # the two text encoders' widths, concatenated
        },
        "vae": BUILTIN_MODELS["tiny"]["vae"],
        "text_encoder": BUILTIN_MODELS["tiny"]["text_encoder"],
        "text_encoder_2": {**BUILTIN_MODELS["tiny"]["text_encoder"], "hidden_act": "gelu"},  # OpenCLIP's activation
        "vocab_size": 1000,
        "scheduler": SDXL_SCHEDULER,
    },
    # The exact SDXL 1.0 base architecture (UNet 2.6B, CLIP ViT-L text 123M, OpenCLIP bigG text 695M, VAE 84M
    # parameters), saved in fp16.
    "sdxl-arch": {
        "unet": {
            "sample_size": 128,
            "in_channels": 4,
            "out_channels": 4,
            "block_out_channels": [320, 640, 1280],
            "layers_per_block": 2,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            "attention_head_dim": [5, 10, 20],
            "transformer_layers_per_block": [1, 2, 10],
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,
            "cross_attention_dim": 2048,
            "norm_num_groups": 32,
        },
        "vae": {**BUILTIN_MODELS["sd1.5-arch"]["vae"], "sample_size": 1024, "scaling_factor": 0.13025},
        "text_encoder": BUILTIN_MODELS["sd1.5-arch"]["text_encoder"],
        "text_encoder_2": {
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_attention_heads": 20,
            "max_position_embeddings": 77,
            "projection_dim": 1280,
            "vocab_size": 49408,
            "hidden_act": "gelu",
        },
        "vocab_size": 4096,
        "scheduler": SDXL_SCHEDULER,
        "dtype": "float16",
    },
})
# SDXL's refiner: the second text encoder alone, and an aesthetic score in the time ids (5, not 6).
BUILTIN_MODELS["tiny-xl-refiner"] = {
    "unet": {**BUILTIN_MODELS["tiny-xl"]["unet"], "cross_attention_dim": 32, "attention_head_dim": [2, 4],
             "projection_class_embeddings_input_dim": 5 * 8 + 32},
    "vae": BUILTIN_MODELS["tiny"]["vae"],
    "text_encoder_2": BUILTIN_MODELS["tiny-xl"]["text_encoder_2"],
    "vocab_size": 1000,
    "scheduler": SDXL_SCHEDULER,
    "refiner": True,
}
# Inpainting models: the UNet takes the latents, the mask and the masked image's latents (4 + 1 + 4 channels).
for _base in ("tiny", "tiny-xl"):
    BUILTIN_MODELS[f"{_base}-inpaint"] = {**BUILTIN_MODELS[_base], "inpainting": True,
                                          "unet": {**BUILTIN_MODELS[_base]["unet"], "in_channels": 9}}
# A latent consistency model as LCM's are published (LCM Dreamshaper): `tiny` with the guidance scale embedded in its
# UNet (time_cond_proj_dim), LCMScheduler, saved by LatentConsistencyModelPipeline.
BUILTIN_MODELS["tiny-lcm"] = {
    **BUILTIN_MODELS["tiny"],
    "unet": {**BUILTIN_MODELS["tiny"]["unet"], GUIDANCE_EMBEDDING_KEY: 32},
    "scheduler": {**{key: value for key, value in SD15_SCHEDULER.items() if key != "skip_prk_steps"},  # PNDM's
                  "_class_name": "LCMScheduler", "original_inference_steps": 50},
    "pipeline": "LatentConsistencyModelPipeline",
}
# SD3's scheduler configuration (flow matching, its sigmas shifted by 3: stabilityai/stable-diffusion-3-medium's).
SD3_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
# SD3 (MMDiT), seconds on a CPU: two CLIP encoders 32 wide each (their states, 64 wide, padded to T5's 96 before joining
# it: the padding runs, as in SD3, where the CLIPs' 768 + 1280 meet T5's 4096), their projections joined as the 64-wide
# pooled projection, a two-layer T5 v1.1 (gated GELU) and a two-layer transformer, a 16-channel VAE with SD3's scaling
# and shift factors (its latents scaled and shifted, not only scaled), saved by StableDiffusion3Pipeline.
BUILTIN_MODELS["tiny-sd3"] = {
    "transformer": {
        "sample_size": 32,
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": 16,
        "num_layers": 2,
        "attention_head_dim": 8,
        "num_attention_heads": 4,
        "joint_attention_dim": 96,  # T5's width
        "caption_projection_dim": 32,  # the transformer's own width (heads x head width), as SD3's
        "pooled_projection_dim": 64,  # the two CLIP projections side by side
        "pos_embed_max_size": 32,  # patches a side: up to twice the native size
    },
    "vae": {**BUILTIN_MODELS["tiny"]["vae"], "latent_channels": 16, "scaling_factor": 1.5305, "shift_factor": 0.0609,
            "use_quant_conv": False, "use_post_quant_conv": False},
    "text_encoder": BUILTIN_MODELS["tiny"]["text_encoder"],
    "text_encoder_2": BUILTIN_MODELS["tiny-xl"]["text_encoder_2"],
    "text_encoder_3": {"d_model": 96, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 4,
                       "relative_attention_num_buckets": 8, "feed_forward_proj": "gated-gelu"},
    "vocab_size": 1000,
    "scheduler": SD3_SCHEDULER,
    "family": "sd3",
}
# The exact SD3.5 Medium architecture, written from stabilityai/stable-diffusion-3.5-medium's published configs
# (transformer 2.24B parameters and its 226M positional-embedding table, 2.47B in its file; CLIP ViT-L 124M and
# OpenCLIP bigG 695M text encoders with projections; T5-XXL's encoder 4.76B; a 16-channel VAE 84M), saved in fp16. Its
# tokenizers are the offline ones tiny-sd3's are (CLIP's BPE made from the corpus, T5's Unigram vocabulary): their ids
# fit the published vocabularies (49408 and 32128), which the embeddings keep.
BUILTIN_MODELS["sd3.5-medium-arch"] = {
    "transformer": {
        "sample_size": 128,
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": 16,
        "num_layers": 24,
        "attention_head_dim": 64,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "caption_projection_dim": 1536,
        "pooled_projection_dim": 2048,
        "pos_embed_max_size": 384,
        "qk_norm": "rms_norm",
        "dual_attention_layers": list(range(13)),  # MMDiT-X: the first 13 blocks attend over the image tokens twice
    },
    "vae": {**BUILTIN_MODELS["sdxl-arch"]["vae"], "latent_channels": 16, "scaling_factor": 1.5305,
            "shift_factor": 0.0609, "use_quant_conv": False, "use_post_quant_conv": False},
    "text_encoder": BUILTIN_MODELS["sdxl-arch"]["text_encoder"],
    "text_encoder_2": BUILTIN_MODELS["sdxl-arch"]["text_encoder_2"],
    "text_encoder_3": {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
                       "relative_attention_num_buckets": 32, "feed_forward_proj": "gated-gelu", "vocab_size": 32128},
    "vocab_size": 4096,
    "scheduler": SD3_SCHEDULER,
    "family": "sd3",
    "dtype": "float16",
}
# FLUX.1's scheduler configuration (flow matching, its sigmas shifted by the image's token count: dynamic shifting
# between 0.5 at 256 tokens and 1.15 at 4096, black-forest-labs/FLUX.1-dev's).
FLUX_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                  "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                  "max_image_seq_len": 4096}
# FLUX.1 [dev], seconds on a CPU: a CLIP 32 wide (its pooled output the transformer's pooled projections), a one-layer
# T5 v1.1 32 wide (gated GELU), a transformer of one double-stream and one single-stream block (two heads of 8, their
# rotary axes 2 + 2 + 4) on 2x2-packed latents (64 channels for 16) that embeds the guidance scale, a 16-channel VAE
# with FLUX.1's scaling and shift factors; saved by FluxPipeline. Its native size is diffusers' FluxPipeline's 128
# latents a side (the transformer's config has none): 256 pixels with this 2x VAE.
BUILTIN_MODELS["tiny-flux"] = {
    "transformer": {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1,
                    "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 32,
                    "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [2, 2, 4]},
    "vae": {**BUILTIN_MODELS["tiny-sd3"]["vae"], "scaling_factor": 0.3611, "shift_factor": 0.1159},
    "text_encoder": BUILTIN_MODELS["tiny"]["text_encoder"],
    "text_encoder_2": {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 1, "num_heads": 4,
                       "relative_attention_num_buckets": 8, "feed_forward_proj": "gated-gelu"},
    "vocab_size": 1000,
    "scheduler": FLUX_SCHEDULER,
    "family": "flux",
}
# FLUX.1 [schnell]: the same, its transformer embedding no guidance scale (timestep-distilled: no guidance at all).
BUILTIN_MODELS["tiny-flux-schnell"] = {
    **BUILTIN_MODELS["tiny-flux"],
    "transformer": {**BUILTIN_MODELS["tiny-flux"]["transformer"], "guidance_embeds": False},
}
# FLUX.1 [schnell]'s scheduler configuration (black-forest-labs/FLUX.1-schnell's): flow matching, no shift at all.
FLUX_SCHNELL_SCHEDULER = {**FLUX_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}
# The exact FLUX.1 [dev] architecture, written from black-forest-labs/FLUX.1-dev's published configs (transformer
# 11.9B parameters: 19 double-stream and 38 single-stream blocks of 24 heads x 128; CLIP ViT-L 123M, read for its
# pooled output; T5-XXL's encoder 4.76B; a 16-channel VAE 84M), saved in bf16 as those files are; its tokenizers are
# sd3.5-medium-arch's.
BUILTIN_MODELS["flux-dev-arch"] = {
    "transformer": {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]},
    "vae": {**BUILTIN_MODELS["sd3.5-medium-arch"]["vae"], "scaling_factor": 0.3611, "shift_factor": 0.1159},
    "text_encoder": BUILTIN_MODELS["sd1.5-arch"]["text_encoder"],
    "text_encoder_2": BUILTIN_MODELS["sd3.5-medium-arch"]["text_encoder_3"],
    "vocab_size": 4096,
    "scheduler": FLUX_SCHEDULER,
    "family": "flux",
    "dtype": "bfloat16",
}
# FLUX.1 [schnell]: [dev]'s architecture without the guidance embedding, its own scheduler (4 steps, no guidance).
BUILTIN_MODELS["flux-schnell-arch"] = {
    **BUILTIN_MODELS["flux-dev-arch"],
    "transformer": {**BUILTIN_MODELS["flux-dev-arch"]["transformer"], "guidance_embeds": False},
    "scheduler": FLUX_SCHNELL_SCHEDULER,
}
# Built-ins trained rather than generated, by name: the package holding each (its diffusers folder MODEL_DIR, and
# damage(): why its files are not the recorded ones).
SHIPPED_MODELS = {"shapes": shapes, "scenes": scenes, "scenes-sd3": scenes_sd3}
BUILTIN_NAMES = (*SHIPPED_MODELS, *BUILTIN_MODELS)  # what --model takes by name, the one that draws its prompt first
# Built-in ControlNets: trained and shipped (the package holding each: its CONTROLNET_DIR, checked by its damage()),
# and made with random weights from a built-in's UNet (by that built-in's name; models.controlnet).
SHIPPED_CONTROLNETS = {"shapes-controlnet": shapes}
GENERATED_CONTROLNETS = {"tiny-controlnet": "tiny", "tiny-xl-controlnet": "tiny-xl",
                         "sd15-controlnet-arch": "sd1.5-arch", "sdxl-controlnet-arch": "sdxl-arch"}
CONTROLNET_NAMES = (*SHIPPED_CONTROLNETS, *GENERATED_CONTROLNETS)  # what --controlnet takes by name
# Built-in LoRAs, trained and shipped: the package holding each (checked by its damage()) and the file.
SHIPPED_LORAS = {"shapes-outline": (shapes, shapes.OUTLINE_LORA), "shapes-lcm": (shapes, shapes.LCM_LORA)}
LORA_NAMES = tuple(SHIPPED_LORAS)  # what --lora takes by name
# The tiny autoencoder (diffusers' AutoencoderTiny) as madebyollin/taesd configures it, which is diffusers' defaults:
# 64-wide blocks, 1, 3, 3, 3 of them encoding and 3, 3, 3, 1 decoding, 4 latent channels, nearest upsampling, latents
# taken as the UNet makes them (scaling factor 1, no shift).
TAESD = {
    "in_channels": 3,
    "out_channels": 3,
    "encoder_block_out_channels": [64, 64, 64, 64],
    "decoder_block_out_channels": [64, 64, 64, 64],
    "act_fn": "relu",
    "upsample_fn": "nearest",
    "latent_channels": 4,
    "upsampling_scaling_factor": 2,
    "num_encoder_blocks": [1, 3, 3, 3],
    "num_decoder_blocks": [3, 3, 3, 1],
    "latent_magnitude": 3,
    "latent_shift": 0.5,
    "scaling_factor": 1.0,
    "shift_factor": 0.0,
}
# Built-in VAEs, generated with random weights (seed 0): their AutoencoderTiny configs, by the name --vae takes. TAESDXL
# (madebyollin/taesdxl) is TAESD's network trained for SDXL's latents.
BUILTIN_VAES = {"taesd-arch": TAESD, "taesdxl-arch": TAESD}


def scheduler_from(config: dict):
    """The diffusers scheduler a scheduler_config.json-style dict names (its `_class_name`), configured by it."""
    import diffusers

    return getattr(diffusers, config["_class_name"]).from_config({k: v for k, v in config.items()
                                                                  if k != "_class_name"})


XL_PAD = "!"  # SDXL's second tokenizer pads with "!" where the first pads with its end-of-text token


# A fixed corpus for the generated tokenizer's merges: prompt-like English, so common words become tokens.
_CORPUS = """
a photo of a cat sitting on a table, a painting of a mountain landscape at sunset, an astronaut riding
a horse on the moon, a portrait of a woman with red hair, highly detailed, digital art, trending on
artstation, a city street at night in the rain, neon lights, a bowl of fruit on a wooden table, oil
painting, a dog running in a field of flowers, the ocean with waves crashing against the rocks, a castle
on a hill under a starry sky, a forest in autumn with golden leaves, studio lighting, sharp focus, 4k,
photorealistic, a cup of coffee next to a book, a small house by the lake, a robot playing the piano,
watercolor, cinematic, beautiful, blurry, low quality, ugly, deformed, the quick brown fox jumps over the
lazy dog, a red car parked in front of a building, children playing in the snow, a bird flying over
the water, a vase of roses, a bridge over a river, mountains covered in snow, a desert with sand dunes
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable-unicode map (the tokenizer's base alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes)))


def corpus_words(corpus: str) -> Counter:
    """Each word (letters, a digit, a run of punctuation) of `corpus`, lowercased, with its count."""
    return Counter(re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]+", corpus.lower()))


def generate_bpe_vocabulary(vocab_size: int, corpus: str = _CORPUS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP BPE vocabulary and merge list learned deterministically from `corpus` (merging stops at `vocab_size`
    entries or once every word of the corpus is one token)."""
    alphabet = list(_bytes_to_unicode().values())
    vocab = alphabet + [c + "</w>" for c in alphabet]
    words = corpus_words(corpus)
    # Each word as a tuple of symbols; the last one carries CLIP's end-of-word marker.
    splits = {w: tuple(w[:-1]) + (w[-1] + "</w>",) for w in words}
    merges: list[tuple[str, str]] = []
    known = set(vocab)
    while len(vocab) + 2 < vocab_size:
        pairs: Counter = Counter()
        for word, symbols in splits.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        # Most frequent pair; ties broken by the pair itself so the result never depends on dict order.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = best[0] + best[1]
        if merged not in known:
            vocab.append(merged)
            known.add(merged)
        for word, symbols in splits.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            splits[word] = tuple(out)
    vocab += [BOS, EOS]
    return {tok: i for i, tok in enumerate(vocab)}, merges


def bpe_tokenizer(vocab_size: int, max_length: int, pad: str = EOS, corpus: str = _CORPUS):
    """A CLIPTokenizer over generate_bpe_vocabulary's vocabulary, padding with `pad`."""
    from transformers import CLIPTokenizer

    vocab, merges = generate_bpe_vocabulary(vocab_size, corpus)
    return CLIPTokenizer(vocab=vocab, merges=merges, bos_token=BOS, eos_token=EOS, pad_token=pad, unk_token=EOS,
                         model_max_length=max_length)


def _tokenizer(spec: dict, pad: str):
    return bpe_tokenizer(spec["vocab_size"], spec["text_encoder"]["max_position_embeddings"], pad)


def unigram_t5_tokenizer(corpus: str = _CORPUS):
    """A T5 tokenizer (transformers' T5TokenizerFast, saved as tokenizer.json) over a Unigram vocabulary made here:
    T5's own is a 32k-piece sentencepiece model that only a download brings, so the corpus' words (scored by their
    frequency) and letters (every other word spelt out) stand in; T5's special tokens and ids are its own (pad 0, end
    1, unknown 2)."""
    import math

    from transformers import T5TokenizerFast

    words = corpus_words(corpus)
    total = sum(words.values())
    letters = sorted({letter for word in words for letter in word})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]  # U+2581: sentencepiece's word start
    pieces += [("\u2581" + word, math.log(count / total)) for word, count in sorted(words.items())]
    pieces += [(letter, math.log(1 / total) - 1) for letter in letters]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def _drawn_parts(makers: dict[str, Callable], spec: dict) -> dict:
    """Each part of a transformer family's built-in drawn (seed 0, in order) and cast to the dtype it is saved in
    (`spec`'s "dtype"), one at a time: FLUX.1's 17B parameters would take 68 GB in fp32. A full-size built-in (saved
    in 16 bits) is drawn in fp16 (a CPU draws bf16 seven times slower: 48 against 6.6 s for 1.3B on two cores) and on
    the GPU where one is visible and the part fits there (SD3.5 Medium's 8B parameters: 3.5 minutes on 16 CPU cores,
    36 s with the save on an H200), so its random values depend on where it was drawn, which timing does not see; a
    tiny one is drawn in fp32 on the CPU, the same everywhere. Returned on the CPU, to be saved."""
    import torch

    dtype = getattr(torch, spec.get("dtype", "float32"))
    full_size = dtype != torch.float32
    where = "cuda" if full_size and torch.cuda.is_available() else "cpu"
    generator_state, default_dtype = torch.random.get_rng_state(), torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float16 if full_size else dtype)
    try:
        parts = {}
        for name, make in makers.items():
            try:
                with torch.device(where):
                    parts[name] = make().to(device="cpu", dtype=dtype)
            except torch.OutOfMemoryError:  # a GPU smaller than the part: drawn on the CPU
                torch.cuda.empty_cache()
                parts[name] = make().to(dtype)
            if where == "cuda":
                torch.cuda.empty_cache()
        return parts
    finally:
        torch.random.set_rng_state(generator_state)
        torch.set_default_dtype(default_dtype)


def build_sd3_model(spec: dict, directory: Path) -> None:
    """Write an SD3 built-in (its `spec`, as BUILTIN_MODELS' "tiny-sd3") as StableDiffusion3Pipeline saves it."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = _tokenizer(spec, EOS)
    special = {"bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
               "eos_token_id": tokenizer.convert_tokens_to_ids(EOS)}
    special["pad_token_id"] = special["eos_token_id"]
    tokenizer_3 = unigram_t5_tokenizer()
    t5 = {"vocab_size": len(tokenizer_3), **spec["text_encoder_3"]}  # a published vocabulary's size where given
    parts = _drawn_parts({
        **{name: partial(CLIPTextModelWithProjection, CLIPTextConfig(**spec[name], **special))
           for name in ("text_encoder", "text_encoder_2")},
        "text_encoder_3": lambda: T5EncoderModel(T5Config(**t5)),
        "transformer": lambda: diffusers.SD3Transformer2DModel(**spec["transformer"]),
        "vae": lambda: diffusers.AutoencoderKL(**spec["vae"])}, spec)
    pipe = getattr(diffusers, SD3.diffusers_pipeline(TEXT_TO_IMAGE))(
        **parts, tokenizer=tokenizer, tokenizer_2=_tokenizer(spec, XL_PAD), tokenizer_3=tokenizer_3,
        scheduler=scheduler_from(spec["scheduler"]))
    pipe.save_pretrained(directory)


def build_flux_model(spec: dict, directory: Path) -> None:
    """Write a Flux built-in (its `spec`, as BUILTIN_MODELS' "tiny-flux") as FluxPipeline saves it."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _tokenizer(spec, EOS)
    special = {"bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
               "eos_token_id": tokenizer.convert_tokens_to_ids(EOS)}
    special["pad_token_id"] = special["eos_token_id"]
    tokenizer_2 = unigram_t5_tokenizer()
    t5 = {"vocab_size": len(tokenizer_2), **spec["text_encoder_2"]}  # a published vocabulary's size where given
    parts = _drawn_parts({"text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**spec["text_encoder"], **special)),
                          "text_encoder_2": lambda: T5EncoderModel(T5Config(**t5)),
                          "transformer": lambda: diffusers.FluxTransformer2DModel(**spec["transformer"]),
                          "vae": lambda: diffusers.AutoencoderKL(**spec["vae"])}, spec)
    pipe = getattr(diffusers, FLUX.diffusers_pipeline(TEXT_TO_IMAGE))(
        **parts, tokenizer=tokenizer, tokenizer_2=tokenizer_2, scheduler=scheduler_from(spec["scheduler"]))
    pipe.save_pretrained(directory)


def build_builtin_model(name: str, directory: Path) -> None:
    """Write the built-in model `name` into `directory` in diffusers' save_pretrained layout."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    spec = BUILTIN_MODELS[name]
    if spec.get("family") == SD3.name:
        return build_sd3_model(spec, directory)
    if spec.get("family") == FLUX.name:
        return build_flux_model(spec, directory)
    xl = "text_encoder_2" in spec
    first = "text_encoder" in spec
    tokenizer = _tokenizer({**spec, "text_encoder": spec.get("text_encoder", spec.get("text_encoder_2"))}, EOS)
    special = {"bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
               "eos_token_id": tokenizer.convert_tokens_to_ids(EOS)}
    special["pad_token_id"] = special["eos_token_id"]

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        parts = {"text_encoder": CLIPTextModel(CLIPTextConfig(**spec["text_encoder"], **special)) if first else None,
                 "unet": UNet2DConditionModel(**spec["unet"]), "vae": AutoencoderKL(**spec["vae"])}
        if xl:
            parts["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**spec["text_encoder_2"], **special))
    finally:
        torch.random.set_rng_state(generator_state)
    scheduler = scheduler_from(spec["scheduler"])
    # saved by diffusers' pipeline of the family's mode: its model_index.json names it
    family, mode = (SDXL if xl else SD), INPAINTING if spec.get("inpainting") else TEXT_TO_IMAGE
    if spec.get("refiner"):  # as SDXL 1.0's refiner: aesthetic scores, an empty negative prompt encoded
        pipe = getattr(diffusers, family.diffusers_pipeline(IMAGE_TO_IMAGE))(
            **parts, tokenizer=None, tokenizer_2=_tokenizer({**spec, "text_encoder": spec["text_encoder_2"]}, XL_PAD),
            scheduler=scheduler, requires_aesthetics_score=True, force_zeros_for_empty_prompt=False)
    elif xl:
        pipe = getattr(diffusers, family.diffusers_pipeline(mode))(**parts, tokenizer=tokenizer,
                                                                   tokenizer_2=_tokenizer(spec, XL_PAD),
                                                                   scheduler=scheduler)
    else:  # saved by the model's own pipeline where it names one
        pipe = getattr(diffusers, spec.get("pipeline", family.diffusers_pipeline(mode)))(
            **parts, tokenizer=tokenizer, scheduler=scheduler, feature_extractor=None, **family.diffusers_options)
    if "dtype" in spec:
        pipe.to(getattr(torch, spec["dtype"]))
    pipe.save_pretrained(directory)


MANIFEST = "manifest.json"  # in a built-in model's folder: what it holds, to tell a damaged folder from a whole one
# Files up to this size are hashed (the tiny built-ins' weights among them, so a flipped byte is found); larger ones
# (full-size weights: hashing would take seconds on every use) are checked by size and header.
HASHED_UP_TO = 64 << 20


def _file_record(path: Path) -> dict:
    record = {"size": path.stat().st_size}
    if record["size"] <= HASHED_UP_TO:
        record["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return record


def write_manifest(directory: Path) -> None:
    files = {p.relative_to(directory).as_posix(): _file_record(p) for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / MANIFEST).write_text(json.dumps({"format": BUILTIN_FORMAT_VERSION, "files": files}, indent=1))


def manifest_damage(directory: Path) -> str | None:
    """Why a built-in model's folder is not what its generation wrote (None: it is whole). Each file is checked as its
    record says: its size, and its hash where one is recorded."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, dict) or not all(isinstance(record, dict) for record in files.values()):
        return f"no readable {MANIFEST}"
    for name, recorded in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        actual = _file_record(path)
        if actual["size"] != recorded.get("size"):
            return f"{name} changed ({actual['size']} bytes, recorded {recorded.get('size')})"
        if "sha256" in recorded and actual.get("sha256") != recorded["sha256"]:
            return f"{name} changed (its content is not the one recorded)"
        reason = check_weight_file(path) if path.suffix == ".safetensors" else None
        if reason:
            return f"{name}: {reason}"
    return None


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def builtin_model_dir(name: str, cache_root: Path, say: Callable[[str], None] = _to_stderr) -> Path:
    """The directory of built-in model `name`, generating it on first use (atomically, saying so) and again
    where its folder was damaged since."""
    reason = writable_reason(cache_root)
    if reason:
        raise UsageError(f"the model cache '{cache_root}' cannot be used: {reason} (set DEMO_DIFFUSION_CACHE to "
                         "another folder)")
    directory = cache_root / f"{name}-v{BUILTIN_FORMAT_VERSION}"
    return made_once(directory, lambda staging: build_builtin_model(name, staging), say,
                     f"generating built-in model '{name}' into {directory} (once; seconds for tiny, a minute or more "
                     "for the full-size architectures) ...",
                     lambda damage: f"built-in model '{name}' in {directory} is damaged ({damage}): generating it "
                                    "again")


def builtin_vae_dir(name: str, cache_root: Path, say: Callable[[str], None] = _to_stderr) -> Path:
    """The folder of built-in VAE `name` (an AutoencoderTiny's), generated on first use and again where it was damaged
    since, as the built-in models are."""
    directory = cache_root / f"{name}-v{BUILTIN_FORMAT_VERSION}"
    return made_once(directory, lambda staging: build_builtin_vae(name, staging), say,
                     f"generating built-in VAE '{name}' into {directory} (once) ...",
                     lambda damage: f"built-in VAE '{name}' in {directory} is damaged ({damage}): generating it again")


def build_builtin_vae(name: str, directory: Path) -> None:
    """Write the built-in VAE `name` into `directory` as diffusers' save_pretrained does."""
    import torch
    from diffusers import AutoencoderTiny

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        vae = AutoencoderTiny(**BUILTIN_VAES[name])
    finally:
        torch.random.set_rng_state(generator_state)
    vae.save_pretrained(directory)


def made_once(directory: Path, write: Callable[[Path], None], say: Callable[[str], None], making: str,
              remaking: Callable[[str], str], before: Callable[[], None] = lambda: None) -> Path:
    """`directory` where its manifest says it is whole; else `before()` (checks that may refuse), then `write(staging)`
    into a staging folder that becomes `directory` with its manifest, whole or not at all, under its lock, saying
    `making` (a damaged one is discarded first, saying `remaking(its damage)`). A full disk is one RunFailure."""
    from safetensors import SafetensorError

    if directory.is_dir() and manifest_damage(directory) is None:
        return directory
    before()
    with file_lock(directory.parent / f".{directory.name}.lock"):
        damage = manifest_damage(directory) if directory.exists() else None
        if directory.exists() and damage is None:  # another process made it while we waited
            return directory
        say(f"[model] {remaking(damage) if damage else making}")
        if damage:
            discard_directory(directory)
        try:
            with atomic_directory(directory) as staging:
                write(staging)
                write_manifest(staging)
        except (OSError, SafetensorError) as exc:  # safetensors' writer reports a full disk as its own error
            raise RunFailure(f"cannot write {directory}: {getattr(exc, 'strerror', None) or exc}") from None
    return directory
