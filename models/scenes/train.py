"""Trains the `scenes` model from procedural scenes (models/scenes/world.py), fixed seeds, on one GPU.

    python scripts/train_scenes.py --output DIR      # 13 minutes (--minutes) on an H200

Two stages, as `shapes`' (models/shapes/train.py, whose loops this reuses): the VAE (256x256 images to 32x32x4
latents and back: patterns of 8 pixels' period must survive it), then the CLIP text encoder and the UNet together
(epsilon prediction on SD 1.5's noise schedule, a tenth of the prompts empty for classifier-free guidance). The UNet
is SD 1.x's family at a small width: cross-attention at 32x32, 16x16 and 8x8, so that both its shallow and its deep
features draw part of every scene (what a step cache or a quantized layer can lose). DIR receives `scenes/` (a
diffusers folder, fp16 safetensors) and `training.json` (steps, losses, times, a first reading by the detector). To
ship a new training, they replace models/scenes/model and training.json, and weights.sha256 is written again
(`cd models/scenes && find model -type f | sort | xargs sha256sum > weights.sha256`).
"""

from __future__ import annotations

import random
import sys

import torch

from models.builtin import bpe_tokenizer
from models.scenes import GUIDANCE_SCALE
from models.scenes.detector import expected_reading, read_image
from models.scenes.world import (
    COLOURS,
    FILLS,
    PLACE_PHRASES,
    SHAPES,
    SIZE,
    SIZES,
    random_scene,
    render_batch,
    scene_tensors,
)
from models.shapes import train as shapes_train

VAE_CONFIG = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": SIZE,
    "block_out_channels": [32, 64, 64, 64], "layers_per_block": 1, "norm_num_groups": 32,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
# Attention at every resolution (head size 32): a step cache's shallow pass keeps the 32x32 level alone.
UNET_CONFIG = {
    "sample_size": SIZE // 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
    "block_out_channels": [64, 96, 128], "attention_head_dim": [2, 3, 4], "norm_num_groups": 32,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 128,
}
TEXT_CONFIG = shapes_train.TEXT_CONFIG
# Every word a prompt may use, so that each is one token.
CORPUS = " ".join(["a on background the over and ,", *SHAPES, *COLOURS, *SIZES, *FILLS, *PLACE_PHRASES.values()])
EMPTY_SHARE = 0.1  # of a batch's prompts, the empty one: classifier-free guidance's unconditional half


def tokenizer():
    return bpe_tokenizer(10_000, TEXT_CONFIG["max_position_embeddings"], corpus=CORPUS)


class Scenes:
    """Random scenes rendered on the device, in [-1, 1]."""

    def __init__(self, device, seed: int):
        self.device, self.rng = device, random.Random(seed)

    def draw(self, n: int) -> tuple[torch.Tensor, list]:
        scenes = [random_scene(self.rng) for _ in range(n)]
        return render_batch(scene_tensors(scenes, self.rng, self.device)) * 2 - 1, scenes


def latent_set(vae, tok, device, count: int, seed: int) -> shapes_train.LatentSet:
    """The training set: every prompt names the whole scene."""
    return shapes_train.LatentSet(vae, tok, device, count, seed, Scenes(device, seed), lambda scene, rng: scene.prompt,
                                  chunk=250)


def read_back(pipe, count: int, seed: int, device, guidance: float) -> dict:
    """A first reading of what the model draws (30 steps): the share of `count` random scenes the detector reads
    exactly, and of their objects each read right. sd-quality is the yardstick; this only tells the run how it went."""
    rng = random.Random(seed)
    scenes = [random_scene(rng) for _ in range(count)]
    exact = objects = right = 0
    for start in range(0, count, 50):
        chunk = scenes[start:start + 50]
        generator = torch.Generator(device).manual_seed(seed + start)
        images = pipe([s.prompt for s in chunk], num_inference_steps=30, guidance_scale=guidance, generator=generator,
                      height=SIZE, width=SIZE).images
        for scene, image in zip(chunk, images):
            reading, expected = read_image(image).as_dict(), expected_reading(scene)
            exact += reading == expected
            read_objects = reading["objects"]
            objects += len(expected["objects"])
            right += sum(o in read_objects for o in expected["objects"])
    return {"exact": round(100 * exact / count, 1), "objects_right": round(100 * right / max(1, objects), 1)}


def vae_read_back(vae, count: int, device) -> float:
    """The share (%) of `count` scenes whose VAE reconstruction the detector reads exactly."""
    exact = 0
    for start in range(0, count, 50):
        images, scenes = Scenes(device, 4321 + start).draw(min(50, count - start))
        with torch.no_grad():
            decoded = vae.decode(vae.encode(images).latent_dist.mode()).sample
        pixels = ((decoded.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        exact += sum(read_image(image).as_dict() == expected_reading(scene) for scene, image in zip(scenes, pixels))
    return round(100 * exact / count, 1)


def main(argv=None) -> int:
    parser = shapes_train.training_parser(__doc__.split("\n\n")[0], "folder for scenes/ and training.json", 2000, 32,
                                          256, "latents per UNet step", 200_000, "scenes encoded for the UNet", 13.0)
    args, device, start, deadline, record = shapes_train.start_training(
        parser, argv, ("vae_steps", "vae_batch", "unet_steps", "batch", "scenes"))

    vae, record["vae"] = shapes_train.train_vae(device, args.vae_steps, args.vae_batch, args.seed, scale_samples=512,
                                                config=VAE_CONFIG, data=Scenes(device, args.seed))
    if args.read_back:
        record["vae"]["read_back_exact"] = vae_read_back(vae, args.read_back, device)
        print(f"[vae] reconstructions read back exactly: {record['vae']['read_back_exact']}%", flush=True)
    tok, text, unet, record["unet"] = shapes_train.train_text_unet(
        vae, device, args.unet_steps, args.batch, args.seed + 1, deadline, 0, args.scenes, world=sys.modules[__name__])
    pipe = shapes_train.pipeline(vae, text, tok, unet)
    if args.read_back:
        record["read_back"] = read_back(pipe, args.read_back, 1234, device, GUIDANCE_SCALE)
    shapes_train.save_training(pipe, args.output / "scenes", record, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
