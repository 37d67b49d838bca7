"""Trains the `shapes` model and its outline LoRA from procedural scenes (models/shapes/scenes.py), fixed seeds.

    python scripts/train_shapes.py --output DIR      # one GPU; 12 minutes (--minutes) on an H100

Three stages, each from the one before: the VAE (128x128 images to 16x16x4 latents and back), the CLIP text encoder
and the UNet together (epsilon prediction on SD 1.5's noise schedule, prompts sometimes naming fewer attributes and
sometimes empty, so that classifier-free guidance works), and a LoRA on the frozen UNet that draws outlines instead
of filled shapes. DIR receives `shapes/` (a diffusers folder, fp16 safetensors), `shapes-outline.safetensors` (the
LoRA, diffusers/PEFT keys) and `training.json` (steps, losses, times, a first accuracy reading by the detector).
To ship a new training, they replace models/shapes/model, outline.safetensors and training.json, and weights.sha256
is written again (`cd models/shapes && (find model controlnet -type f; echo outline.safetensors; echo lcm.safetensors)
| sort | xargs sha256sum > weights.sha256`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.builtin import SD15_SCHEDULER, bpe_tokenizer, scheduler_from
from models.shapes import GUIDANCE_SCALE
from models.shapes.detector import read_image
from models.shapes.scenes import (
    ATTRIBUTES,
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    STYLES,
    partial_prompt,
    random_scene,
    render_batch,
    scene_tensors,
)
from models.source import DEFAULT_GUIDANCE_SCALE

VAE_CONFIG = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": 128,
    "block_out_channels": [32, 64, 64, 64], "layers_per_block": 1, "norm_num_groups": 32,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
# Every pattern the passes and plugins handle: self- and cross-attention at head size 32 (64/2, 128/4, 192/6) on
# 16x16 and 8x8 latents, GroupNorm (32 groups), LayerNorm, GEGLU.
UNET_CONFIG = {
    "sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
    "block_out_channels": [64, 128, 192], "attention_head_dim": [2, 4, 6], "norm_num_groups": 32,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 128,
}
TEXT_CONFIG = {
    "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 4,
    "max_position_embeddings": 77, "projection_dim": 128, "hidden_act": "quick_gelu",
}
# Every word a prompt may use, so that each is one token.
CORPUS = " ".join(["a on background the", *SHAPES, *COLOURS, *SIZES, *(phrase for _, phrase in POSITIONS.values())])
LORA_RANK = 8
# The UNet's pace is measured over steps PACE_FROM..PACE_FROM+PACE_OVER (past the first steps' set-up), and
# RESERVE_SECONDS kept for the LoRA's scenes and the read-backs.
PACE_FROM, PACE_OVER, RESERVE_SECONDS = 20, 50, 60
NOISE_OFFSET = 0.05  # lets the model draw black and white backgrounds whatever the noise's mean


def tokenizer():
    return bpe_tokenizer(10_000, TEXT_CONFIG["max_position_embeddings"], corpus=CORPUS)


class Scenes:
    """Random scenes rendered on the device (`style` "filled", "outline" or "mixed")."""

    def __init__(self, device, seed: int, style: str = "filled"):
        self.device, self.rng, self.style = device, random.Random(seed), style

    def draw(self, n: int) -> tuple[torch.Tensor, list]:
        """n scenes and their images in [-1, 1]."""
        scenes = [random_scene(self.rng) for _ in range(n)]
        scenes = [s.with_(style=self.rng.choice(STYLES) if self.style == "mixed" else self.style) for s in scenes]
        return render_batch(**scene_tensors(scenes, self.rng, self.device)) * 2 - 1, scenes


def shapes_prompt(drop: float):
    """A scene's training prompt: naming each attribute but the shape with probability 1 - `drop`."""
    return lambda scene, rng: partial_prompt(scene, {a: rng.random() >= drop for a in ATTRIBUTES})


class LatentSet:
    """Scenes rendered, encoded and tokenized once, kept on the device: each training step draws a batch of them
    with no Python per sample (the UNet at 16x16 is so small that per-step host work would bound the run).

    Each scene of `source` (its draw(n): images in [-1, 1] and their scenes) keeps one prompt, `prompt(scene, rng)`;
    a batch swaps a share `empty` of prompts for the empty one (classifier-free guidance's unconditional half)."""

    def __init__(self, vae, tok, device, count: int, seed: int, source, prompt, chunk: int = 1000):
        rng = random.Random(seed + 1)
        means, stds, prompt_of, prompts = [], [], [], {}
        for start in range(0, count, chunk):
            images, scenes = source.draw(min(chunk, count - start))
            with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                posterior = vae.encode(images).latent_dist
            means.append(posterior.mean.float())
            stds.append(posterior.std.float())
            for scene in scenes:
                prompt_of.append(prompts.setdefault(prompt(scene, rng), len(prompts)))
        scale = vae.config.scaling_factor
        self.mean, self.std = torch.cat(means) * scale, torch.cat(stds) * scale
        self.prompt_of = torch.tensor(prompt_of, device=device)
        self.ids = _token_ids(tok, list(prompts), device)
        self.empty_ids = _token_ids(tok, [""], device)

    def batch(self, n: int, empty: float) -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, len(self.mean), (n,), device=self.mean.device)
        latents = self.mean[pick] + self.std[pick] * torch.randn_like(self.mean[pick])
        ids = self.ids[self.prompt_of[pick]]
        unconditional = torch.rand(n, 1, device=ids.device) < empty
        return latents, torch.where(unconditional, self.empty_ids, ids)


def latent_set(vae, tok, device, count: int, seed: int) -> LatentSet:
    """The base model's training set: filled shapes, prompts sometimes naming fewer attributes."""
    return LatentSet(vae, tok, device, count, seed, Scenes(device, seed, "filled"), shapes_prompt(drop=0.1))


def _token_ids(tok, prompts: list[str], device) -> torch.Tensor:
    return tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
               return_tensors="pt").input_ids.to(device)


def _schedule(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


class Progress:
    def __init__(self, stage: str, steps: int, every: int = 200):
        self.stage, self.steps, self.every, self.start, self.losses = stage, steps, every, time.monotonic(), []

    def step(self, step: int, loss: torch.Tensor) -> None:
        if (step + 1) % self.every and step + 1 != self.steps:
            return
        self.losses.append(float(loss.detach()))
        elapsed = time.monotonic() - self.start
        eta = elapsed / (step + 1) * (self.steps - step - 1)
        print(f"[{self.stage}] step {step + 1}/{self.steps} loss {self.losses[-1]:.4f} {(step + 1) / elapsed:.1f} it/s "
              f"elapsed {elapsed:.0f} s, {eta:.0f} s left", flush=True)

    def record(self, steps_done: int) -> dict:
        return {"steps": steps_done, "seconds": round(time.monotonic() - self.start, 1), "losses": self.losses}


class Budget:
    """Fits a stage's steps into the time left before `deadline` once its pace is known (steps PACE_FROM to
    PACE_FROM + PACE_OVER, past the first steps' set-up), leaving RESERVE_SECONDS and time for `reserve_steps` more at
    that pace; the learning-rate schedule, which reads progress.steps, is fitted to them."""

    def __init__(self, progress: Progress, deadline: float, reserve_steps: int = 0):
        self.progress, self.deadline, self.reserve_steps, self.paced_from = progress, deadline, reserve_steps, None

    def after(self, done: int) -> None:
        """Called with the count of steps done after each one."""
        if done == PACE_FROM:
            self.paced_from = time.monotonic()
        if done != PACE_FROM + PACE_OVER:
            return
        pace = PACE_OVER / (time.monotonic() - self.paced_from)
        fits = done + int(pace * (self.deadline - time.monotonic() - RESERVE_SECONDS)) - self.reserve_steps
        if fits < self.progress.steps:
            print(f"[{self.progress.stage}] {self.progress.steps} steps do not fit the time budget at {pace:.1f} it/s: "
                  f"running {max(fits, done)}", flush=True)
            self.progress.steps = max(fits, done)


def train_vae(device, steps: int, batch: int, seed: int, scale_samples: int = 2048, config: dict = VAE_CONFIG,
              data=None):
    """The VAE on `data`'s images (its draw(n); default: shapes' scenes, filled and outlined)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(**config).to(device).train()
    data = data or Scenes(device, seed, style="mixed")  # the LoRA's outlines must survive the VAE too
    optimizer = torch.optim.AdamW(vae.parameters(), lr=6e-4, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, steps, 200))
    progress, done = Progress("vae", steps), 0
    for done in range(steps):
        images, _ = data.draw(batch)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            posterior = vae.encode(images).latent_dist
            decoded = vae.decode(posterior.sample()).sample.float()
        loss = (decoded - images).abs().mean() + ((decoded - images) ** 2).mean() + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        progress.step(done, loss)
    vae.eval()
    with torch.no_grad():  # unit-variance latents, as SD's scaling factor gives its own
        latents = torch.cat([vae.encode(data.draw(min(256, scale_samples - start))[0]).latent_dist.sample()
                             for start in range(0, scale_samples, 256)])
    vae.register_to_config(scaling_factor=float(1 / latents.std()))
    return vae, progress.record(done + 1)


def _alphas_cumprod(device) -> torch.Tensor:
    """SD 1.5's noise schedule (the scheduler config the model ships with), as training draws from it."""
    return scheduler_from(SD15_SCHEDULER).alphas_cumprod.to(device)


def _parameters(*modules):
    return [p for m in modules for p in m.parameters() if p.requires_grad]


def train_text_unet(vae, device, steps: int, batch: int, seed: int, deadline: float, reserve_steps: int,
                    dataset: int, world=None):
    """The text encoder and the UNet, together. Where `steps` would not fit before `deadline` (leaving time for
    `reserve_steps` more at this pace, the LoRA's), fewer are run, the learning-rate schedule fitted to them.
    `world` (default: shapes'): its tokenizer, TEXT_CONFIG, UNET_CONFIG and latent_set(vae, tok, device, count,
    seed)."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    world = world or sys.modules[__name__]
    tok = world.tokenizer()
    torch.manual_seed(seed)
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}
    text = CLIPTextModel(CLIPTextConfig(**world.TEXT_CONFIG, vocab_size=len(tok), **special)).to(device).train()
    unet = UNet2DConditionModel(**world.UNET_CONFIG).to(device, memory_format=torch.channels_last).train()
    alphas = _alphas_cumprod(device)
    data = world.latent_set(vae, tok, device, dataset, seed)
    print(f"[unet] {dataset} scenes encoded, {len(data.ids)} distinct prompts", flush=True)
    record = train_together((text, unet), lambda: _diffusion_loss(unet, text, data, alphas, batch, device, empty=0.1),
                            Progress("unet", steps), device, deadline, reserve_steps)
    return tok, text.eval(), unet.eval(), record


def train_together(modules, loss, progress: Progress, device, deadline: float, reserve_steps: int = 0) -> dict:
    """Trains `modules` together on `loss()` (a batch's loss, drawn anew each call) for progress.steps steps
    (fewer where they would not fit before `deadline`: Budget): AdamW on a warm-up and cosine schedule, gradients
    clipped, and the weights' moving average, which the modules keep at the end. Returns the stage's record."""
    params = _parameters(*modules)
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=5e-4, betas=(0.9, 0.99), weight_decay=0.01,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, progress.steps, 300))
    budget, done = Budget(progress, deadline, reserve_steps), 0
    while done < progress.steps:
        value = loss()
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - min(0.999, (1 + done) / (10 + done)))
        progress.step(done, value)
        done += 1
        budget.after(done)
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    return progress.record(done)


def _diffusion_loss(unet, text, data: LatentSet, alphas, batch, device, empty):
    latents, ids = data.batch(batch, empty)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        noise = torch.randn_like(latents) + NOISE_OFFSET * torch.randn(batch, latents.shape[1], 1, 1, device=device)
        t = torch.randint(0, len(alphas), (batch,), device=device)
        a = alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        predicted = unet(noisy.contiguous(memory_format=torch.channels_last), t, text(ids)[0]).sample.float()
    return ((predicted - noise) ** 2).mean()


class LoraLinear(torch.nn.Module):
    """A frozen layer plus up(down(x)): Linear, or a convolution whose down keeps its kernel and up is 1x1."""

    def __init__(self, base: torch.nn.Module, rank: int):
        super().__init__()
        self.base = base
        if isinstance(base, torch.nn.Conv2d):
            self.down = torch.nn.Conv2d(base.in_channels, rank, base.kernel_size, base.stride, base.padding,
                                        bias=False)
            self.up = torch.nn.Conv2d(rank, base.out_channels, 1, bias=False)
        else:
            self.down = torch.nn.Linear(base.in_features, rank, bias=False)
            self.up = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


# The UNet modules the outline LoRA adapts: the transformers' projections and feed-forwards, and the ResNets' 3x3
# convolutions (a filled shape becoming an outline is a spatial change).
OUTLINE_LAYERS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "conv1", "conv2")


def lora_layers(unet, names: tuple[str, ...] = OUTLINE_LAYERS) -> dict[str, torch.nn.Module]:
    """The UNet's Linear and Conv2d modules whose paths end in one of `names`."""
    return {name: module for name, module in unet.named_modules()
            if name.endswith(names) and isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))}


def attach_lora(unet, rank: int, device, names: tuple[str, ...] = OUTLINE_LAYERS) -> dict[str, LoraLinear]:
    """LoraLinear adapters of `rank` in place of the UNet's `names` layers, by path; the UNet's own weights frozen."""
    unet.requires_grad_(False)
    adapters = {}
    for name, module in lora_layers(unet, names).items():
        parent, _, child = name.rpartition(".")
        adapter = LoraLinear(module, rank).to(device)
        setattr(unet.get_submodule(parent), child, adapter)
        adapters[name] = adapter
    return adapters


def train_lora(unet, text, vae, tok, device, steps: int, batch: int, seed: int, dataset: int):
    text.requires_grad_(False)
    adapters = attach_lora(unet, LORA_RANK, device)
    params = [p for a in adapters.values() for p in (a.down.weight, a.up.weight)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, steps, 100))
    alphas = _alphas_cumprod(device)
    data = LatentSet(vae, tok, device, dataset, seed, Scenes(device, seed, "outline"), shapes_prompt(drop=0.1))
    progress, done = Progress("lora", steps), 0
    unet.train()
    for done in range(steps):
        loss = _diffusion_loss(unet, text, data, alphas, batch, device, empty=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        progress.step(done, loss)
    unet.eval()
    return adapters, progress.record(done + 1)


def lora_weights(adapters: dict) -> dict[str, torch.Tensor]:
    """The adapters' weights under diffusers/PEFT keys (no alpha: scale 1), fp16."""
    weights = {}
    for name, adapter in adapters.items():
        weights[f"unet.{name}.lora_A.weight"] = adapter.down.weight.detach().to(torch.float16).cpu().contiguous()
        weights[f"unet.{name}.lora_B.weight"] = adapter.up.weight.detach().to(torch.float16).cpu().contiguous()
    return weights


def remove_lora(unet, adapters: dict) -> None:
    for name, adapter in adapters.items():
        parent, _, child = name.rpartition(".")
        setattr(unet.get_submodule(parent), child, adapter.base)


def read_back(pipe, count: int, seed: int, device, guidance: float, lora: bool = False, steps: int = 30) -> dict:
    """A first reading of what the model draws (`steps` of its scheduler): the detector's accuracy on `count`
    random scenes. sd-quality is the yardstick; this only tells the training run how it went."""
    rng = random.Random(seed)
    scenes = [random_scene(rng) for _ in range(count)]
    hits = dict.fromkeys((*ATTRIBUTES, "style", "exact"), 0)
    for start in range(0, count, 50):
        chunk = scenes[start:start + 50]
        generator = torch.Generator(device).manual_seed(seed + start)
        images = pipe([s.prompt for s in chunk], num_inference_steps=steps, guidance_scale=guidance,
                      generator=generator, height=128, width=128).images
        for scene, image in zip(chunk, images):
            reading = read_image(image)
            right = {a: getattr(reading, a) == getattr(scene, a) for a in ATTRIBUTES}
            for a, ok in right.items():
                hits[a] += ok
            hits["style"] += reading.style == ("outline" if lora else "filled")
            hits["exact"] += all(right.values())
    return {a: round(100 * h / count, 1) for a, h in hits.items()}


def vae_read_back(vae, count: int, device) -> dict:
    """The detector's exact-match rate on the VAE's reconstructions of `count` scenes (outlines included)."""
    exact = {"filled": 0, "outline": 0}
    for style in exact:
        images, scenes = Scenes(device, 4321, style).draw(count)
        with torch.no_grad():
            decoded = vae.decode(vae.encode(images).latent_dist.mode()).sample
        pixels = ((decoded.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        for scene, image in zip(scenes, pixels):
            exact[style] += read_image(image).as_dict() == {**scene.__dict__}
    return {style: round(100 * hits / count, 1) for style, hits in exact.items()}


def training_parser(description: str, output: str, vae_steps: int, vae_batch: int, batch: int, batch_help: str,
                    scenes: int, scenes_help: str, minutes: float) -> argparse.ArgumentParser:
    """The flags every trained built-in's training takes, at that built-in's defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path, required=True, help=output)
    parser.add_argument("--vae-steps", type=int, default=vae_steps)
    parser.add_argument("--vae-batch", type=int, default=vae_batch)
    parser.add_argument("--unet-steps", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)
    parser.add_argument("--scenes", type=int, default=scenes, help=scenes_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=minutes,
                        help="time budget: the UNet runs fewer steps where its own would not fit (training.json "
                             "records how many ran; pass them as --unet-steps to repeat the run)")
    parser.add_argument("--read-back", type=int, default=200, help="scenes drawn for the first reading (0: none)")
    return parser


def start_training(parser: argparse.ArgumentParser, argv, counts: tuple[str, ...]):
    """The parsed flags, checked (each of `counts` at least 1), and the run's device, deadline and record."""
    args = parser.parse_args(argv)
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not (args.minutes > 0 and args.read_back >= 0):
        parser.error("--minutes must be above 0 and --read-back 0 or more")
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"--output {args.output} is not a folder")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        print("[train] no CUDA GPU: training on the CPU takes many hours at the default sizes", flush=True)
    start = time.monotonic()
    record = run_record(args, device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return args, device, start, start + 60 * args.minutes, record


def run_record(args: argparse.Namespace, device: torch.device) -> dict:
    """What a training record starts with: the device it ran on, torch's version and the flags."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}


def main(argv=None) -> int:
    parser = training_parser(__doc__.split("\n\n")[0], "folder for shapes/, the LoRA and training.json", 3000, 64,
                             1024, "latents per UNet and LoRA step", 300_000,
                             "scenes encoded for the UNet (the LoRA: a third)", 12.0)
    parser.add_argument("--lora-steps", type=int, default=800)
    args, device, start, deadline, record = start_training(
        parser, argv, ("vae_steps", "vae_batch", "unet_steps", "lora_steps", "batch", "scenes"))

    vae, record["vae"] = train_vae(device, args.vae_steps, args.vae_batch, args.seed)
    if args.read_back:
        record["vae"]["read_back"] = vae_read_back(vae, args.read_back, device)
        print(f"[vae] reconstructions read back: {record['vae']['read_back']}", flush=True)
    tok, text, unet, record["unet"] = train_text_unet(vae, device, args.unet_steps, args.batch, args.seed + 1,
                                                      deadline, args.lora_steps, args.scenes)
    pipe = pipeline(vae, text, tok, unet)
    if args.read_back:  # at the model's guidance and at the toolkit's usual one
        for guidance in (GUIDANCE_SCALE, DEFAULT_GUIDANCE_SCALE):
            record[f"read_back_guidance_{guidance:g}"] = read_back(pipe, args.read_back, 1234, device, guidance)
    adapters, record["lora"] = train_lora(unet, text, vae, tok, device, args.lora_steps, args.batch, args.seed + 2,
                                          args.scenes // 3)
    if args.read_back:
        record["read_back_lora"] = read_back(pipe, args.read_back, 1234, device, GUIDANCE_SCALE, lora=True)
    remove_lora(unet, adapters)
    args.output.mkdir(parents=True, exist_ok=True)
    save_file(lora_weights(adapters), args.output / "shapes-outline.safetensors")
    save_training(pipe, args.output / "shapes", record, start)
    return 0


def save_training(pipe, folder: Path, record: dict, start: float) -> None:
    """A trained built-in's pipeline in fp16 as the diffusers folder `folder`, and the run's record (its seconds since
    `start` added) as training.json beside it; prints the record's read-backs and time."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    pipe.to(torch.float16).save_pretrained(folder)
    record["seconds"] = round(time.monotonic() - start, 1)
    (folder.parent / "training.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k.startswith("read_back") or k == "seconds"}), flush=True)


def pipeline(vae, text, tok, unet):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tok, unet=unet,
                                   scheduler=scheduler_from(SD15_SCHEDULER),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


if __name__ == "__main__":
    sys.exit(main())
