"""Trains `shapes-controlnet` on the shipped `shapes` model: a ControlNet that puts the prompt's shape where its
control image (the shape's silhouette, white on black) says, fixed seeds.

    python scripts/train_shapes_controlnet.py --output DIR [--minutes 27]     # the CPU (2 cores: 27 minutes)

The ControlNet starts as diffusers makes one from the UNet (its encoder's weights, zero output convolutions), its
conditioning embedding's last convolution drawn at random (below); the VAE, text encoder and UNet stay frozen. Its
scenes are the base model's, their prompts never naming the position (so only the control image can give it) and
sometimes naming fewer attributes or none (classifier-free guidance). DIR receives `controlnet/` (a ControlNetModel
folder, fp16 safetensors) and `controlnet-training.json` (steps, losses, time, and the detector's first reading of
the position with and without the ControlNet). To ship it, controlnet/ replaces models/shapes/controlnet, the record
models/shapes/controlnet-training.json, and weights.sha256 is written again (models/shapes/train.py says how).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from models.shapes import CONTROLNET_DIR, GUIDANCE_SCALE, MODEL_DIR
from models.shapes.detector import read_image
from models.shapes.scenes import (
    ATTRIBUTES,
    partial_prompt,
    random_scene,
    render_batch,
    scene_tensors,
    silhouette,
    silhouettes,
    unplaced_prompt,
)
from models.shapes.train import NOISE_OFFSET, Progress, _alphas_cumprod, _schedule

# Diffusers' default embedding of the conditioning image (three stride-2 convolutions: 128x128 to the 16x16 latents).
EMBEDDING_CHANNELS = (16, 32, 96, 256)


class ControlSet:
    """Scenes rendered, encoded and their prompts embedded once: a batch is latents, text embeddings and the control
    images, drawn with no Python per sample."""

    def __init__(self, pipe, count: int, seed: int, drop: float, chunk: int = 500):
        rng = random.Random(seed)
        means, stds, controls, prompt_of, prompts = [], [], [], [], {}
        for start in range(0, count, chunk):
            scenes = [random_scene(rng) for _ in range(min(chunk, count - start))]
            tensors = scene_tensors(scenes, rng)
            images = render_batch(**tensors) * 2 - 1
            with torch.no_grad():
                posterior = pipe.vae.encode(images).latent_dist
            means.append(posterior.mean)
            stds.append(posterior.std)
            controls.append((silhouettes(tensors) * 255).to(torch.uint8))
            for scene in scenes:
                keep = {a: a != "position" and rng.random() >= drop for a in ATTRIBUTES}
                prompt_of.append(prompts.setdefault(partial_prompt(scene, keep), len(prompts)))
        scale = pipe.vae.config.scaling_factor
        self.mean, self.std = torch.cat(means) * scale, torch.cat(stds) * scale
        self.controls, self.prompt_of = torch.cat(controls), torch.tensor(prompt_of)
        with torch.no_grad():
            self.text = embed(pipe, list(prompts))
            self.empty = embed(pipe, [""])

    def batch(self, n: int, empty: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, len(self.mean), (n,))
        latents = self.mean[pick] + self.std[pick] * torch.randn_like(self.mean[pick])
        text = self.text[self.prompt_of[pick]]
        text = torch.where((torch.rand(n) < empty).view(n, 1, 1), self.empty, text)
        return latents, text, self.controls[pick].float() / 255


def embed(pipe, prompts: list[str]) -> torch.Tensor:
    ids = pipe.tokenizer(prompts, padding="max_length", max_length=pipe.tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids
    return pipe.text_encoder(ids)[0]


def train(pipe, controlnet, steps: int, batch: int, seed: int, scenes: int, deadline: float, lr: float) -> dict:
    """Fits the ControlNet; fewer steps where `steps` would not fit before `deadline` (the pace measured early)."""
    torch.manual_seed(seed)
    data = ControlSet(pipe, scenes, seed, drop=0.1)
    print(f"[controlnet] {scenes} scenes encoded, {len(data.text)} distinct prompts", flush=True)
    alphas = _alphas_cumprod(torch.device("cpu"))
    params = [p for p in controlnet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    progress = Progress("controlnet", steps, every=25)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, progress.steps, 50))
    controlnet.train()
    done, paced_from = 0, None
    while done < progress.steps:
        latents, text, control = data.batch(batch, empty=0.1)
        noise = torch.randn_like(latents) + NOISE_OFFSET * torch.randn(batch, latents.shape[1], 1, 1)
        t = torch.randint(0, len(alphas), (batch,))
        a = alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        down, mid = controlnet(noisy, t, text, controlnet_cond=control, return_dict=False)
        predicted = pipe.unet(noisy, t, text, down_block_additional_residuals=down,
                              mid_block_additional_residual=mid).sample
        loss = ((predicted - noise) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        progress.step(done, loss)
        done += 1
        if done == 10:
            paced_from = time.monotonic()
        if done == 30:
            fits = done + int(20 / (time.monotonic() - paced_from) * (deadline - time.monotonic()))
            if fits < progress.steps:
                print(f"[controlnet] {progress.steps} steps do not fit the time budget: running {fits}", flush=True)
                progress.steps = fits
    controlnet.eval()
    return progress.record(done)


def read_back(pipe, controlnet, count: int, seed: int) -> dict:
    """The detector's reading of `count` random scenes drawn with their position left out of the prompt: the share
    with the position (and with every attribute) right, with the ControlNet and without it (where chance is 1/9)."""
    from diffusers import StableDiffusionControlNetPipeline

    steered = StableDiffusionControlNetPipeline(**pipe.components, controlnet=controlnet)
    steered.set_progress_bar_config(disable=True)
    rng = random.Random(seed)
    scenes = [random_scene(rng) for _ in range(count)]
    prompts = [unplaced_prompt(scene) for scene in scenes]
    hits = {"position": 0, "exact": 0, "position_without": 0}
    common = dict(num_inference_steps=20, guidance_scale=GUIDANCE_SCALE, height=128, width=128)
    for index, (scene, prompt) in enumerate(zip(scenes, prompts)):
        image = steered(prompt, image=silhouette(scene), generator=torch.Generator().manual_seed(seed + index),
                        **common).images[0]
        reading = read_image(image)
        hits["position"] += reading.position == scene.position
        hits["exact"] += all(getattr(reading, a) == getattr(scene, a) for a in ATTRIBUTES)
        plain = pipe(prompt, generator=torch.Generator().manual_seed(seed + index), **common).images[0]
        hits["position_without"] += read_image(plain).position == scene.position
    return {name: round(100 * value / count, 1) for name, value in hits.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for controlnet/ and its record")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--scenes", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=27.0,
                        help="time budget from the start, encoding included: fewer steps run where --steps would not "
                             "fit (controlnet-training.json records how many ran)")
    parser.add_argument("--read-back", type=int, default=45, help="scenes drawn for the first reading (0: none)")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.scenes) < 1 or not (args.minutes > 0 and args.lr > 0 and args.read_back >= 0):
        parser.error("--steps, --batch and --scenes must be at least 1, --minutes and --lr above 0")
    from diffusers import ControlNetModel, StableDiffusionPipeline

    start = time.monotonic()
    pipe = StableDiffusionPipeline.from_pretrained(MODEL_DIR, torch_dtype=torch.float32, safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.vae, pipe.text_encoder, pipe.unet):
        module.requires_grad_(False)
    controlnet = ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=EMBEDDING_CHANNELS)
    # With the embedding's last convolution zero as well as the output ones, no gradient reaches either for hundreds
    # of steps (a first run of 922 steps left them near 0 and the position at chance): the image's features flow
    # from the first step; the zero output convolutions still leave the UNet as it is at the start.
    controlnet.controlnet_cond_embedding.conv_out.reset_parameters()
    record = {"device": "cpu", "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    record["controlnet"] = train(pipe, controlnet, args.steps, args.batch, args.seed, args.scenes,
                                 start + 60 * args.minutes, args.lr)
    if args.read_back:
        record["read_back"] = read_back(pipe, controlnet, args.read_back, 1234)
        print(f"[controlnet] read back: {record['read_back']}", flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    controlnet.to(torch.float16).save_pretrained(args.output / CONTROLNET_DIR.name)
    record["seconds"] = round(time.monotonic() - start, 1)
    (args.output / "controlnet-training.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
