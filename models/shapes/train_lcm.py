"""Distils `shapes-lcm` from the shipped `shapes` model: an LCM-LoRA with which `shapes` draws in 4 LCMScheduler steps,
without classifier-free guidance, what it draws in 30 guided steps of its own scheduler; fixed seeds.

    python scripts/train_shapes_lcm.py --output DIR/lcm.safetensors      # one GPU; 5 minutes (--minutes)

Latent consistency distillation (Luo et al. 2023, LCM-LoRA as diffusers' examples/consistency_distillation/
train_lcm_distill_lora_sd_wds.py trains one). The teacher is the shipped UNet, frozen; the student the same UNet with a
LoRA (train.py's adapters, on every layer LCM_LAYERS names). A step noises latents of the base model's own scenes
(train.latent_set) to a timestep LCMScheduler samples from, runs the teacher there with the prompt and with the empty
one, guided at GUIDANCE_SCALE, and takes one DDIM step back with it; the student's consistency function there
(LCMScheduler's boundary condition: c_skip x + c_out x0) is pulled towards its own at the DDIM step's end, taken under
no_grad (LCM-LoRA: no EMA target), with a Huber loss. fp32 weights, fp16 autocast on CUDA. `--minutes` and `--steps`
bound the run, whichever comes first; the learning rate is constant after its warm-up, so a run cut short by the time is
the same as one given that many --steps. The output receives the LoRA (fp16, diffusers/PEFT keys, as train.py writes the
outline LoRA) and, beside it, `<name>-training.json` (steps, losses, time, and the detector's first readings: the
teacher at 30 steps, LCMScheduler at 1 and 4 steps without the LoRA and with it). To ship it, the LoRA replaces
models/shapes/lcm.safetensors, the record models/shapes/lcm-training.json, and weights.sha256 is written again (train.py
says how).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save

from core.atomic import atomic_write_bytes
from models.lora import LoraFusion, read_lora
from models.recommended import Recommended, metadata_of
from models.shapes import GUIDANCE_SCALE, MODEL_DIR
from models.shapes.train import (
    OUTLINE_LAYERS,
    Progress,
    _parameters,
    attach_lora,
    latent_set,
    lora_weights,
    read_back,
    run_record,
)

# diffusers' LCM-LoRA targets: the outline LoRA's layers and every other Linear and convolution in the UNet's blocks.
LCM_LAYERS = (*OUTLINE_LAYERS, "proj_in", "proj_out", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv",
              "time_emb_proj")
LORA_RANK = 4  # 0.6 MB of fp16 on LCM_LAYERS
HUBER_C = 0.001  # diffusers' LCM scripts' Huber parameter: quadratic only for errors below it
WARMUP_STEPS = 100
# fp16 rather than bf16: x0 = (x - sqrt(1 - a) eps) / sqrt(a) multiplies the UNet's error by 15 at t = 999, where
# bf16's moves the consistency function by 0.048 on average and fp16's by 0.0055 (the shipped UNet, CPU autocast).
AUTOCAST_DTYPE = torch.float16
STUDENT_STEPS, TEACHER_STEPS = 4, 30  # what the LoRA is for, and what it is measured against
# The LoRA's readings: at its steps, and at 1, where LCMScheduler without it draws the blurred mean of what a prompt
# allows (at 4 the sampler alone draws shapes' full prompts as well as the teacher: lcm-training.json, 99.5% exact).
READ_BACK_STEPS = (1, STUDENT_STEPS)
# What the LoRA runs best with, in its file's metadata (models.recommended): a request that gives none gets it
RECOMMENDED = Recommended(denoising_steps=STUDENT_STEPS, guidance_scale=1.0, scheduler="LCM")


def lcm_scheduler(pipe):
    """The sampler the LoRA is for: diffusers' LCMScheduler, configured from the model's scheduler config."""
    from diffusers import LCMScheduler

    return LCMScheduler.from_config(pipe.scheduler.config)


class Consistency:
    """LCM's maths on the sampler's noise schedule: the timesteps a step starts from (all those the sampler draws its
    schedules from: 19, 39, ..., 999 for its 50 of 1000), how far one DDIM step goes back from each (`skip`), and the
    consistency function f(x, t) = c_skip(t) x + c_out(t) x0(x, t) with the sampler's own boundary condition
    scalings (c_skip(0) = 1, c_out(0) = 0: f(x, 0) = x)."""

    def __init__(self, sampler, device):
        self.sampler = copy.deepcopy(sampler)  # set_timesteps below changes its state; the caller's stays as it is
        self.sampler.set_timesteps(self.sampler.config.original_inference_steps)
        self.starts = self.sampler.timesteps.flip(0).to(device)
        self.skip = int(self.starts[1] - self.starts[0])
        self.alphas = self.sampler.alphas_cumprod.to(device)

    def noised(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x0 with `noise` at timesteps t (also a DDIM step, eta 0, to t: x0 and the noise predicted with it)."""
        a = self.alphas[t].view(-1, 1, 1, 1)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def original(self, noise: torch.Tensor, t: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        """x0 of the epsilon prediction `noise` for `noisy` at timesteps t."""
        a = self.alphas[t].view(-1, 1, 1, 1)
        return (noisy - (1 - a).sqrt() * noise) / a.sqrt()

    def consistency(self, noise: torch.Tensor, t: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        c_skip, c_out = (c.view(-1, 1, 1, 1) for c in self.sampler.get_scalings_for_boundary_condition_discrete(t))
        return c_skip * noisy + c_out * self.original(noise, t, noisy)


def consistency_loss(student, teacher, maths: Consistency, latents, noise, index, text, empty_text) -> torch.Tensor:
    """The distillation loss of one batch: `latents` noised with `noise` to the start timesteps maths.starts[index];
    `student` and `teacher` map (noisy latents, timesteps, text embeddings) to their noise predictions; `empty_text`:
    the empty prompt's embedding, the teacher's unconditional half."""
    start = maths.starts[index]
    end = (start - maths.skip).clamp(min=0)
    noisy = maths.noised(latents, noise, start)
    online = maths.consistency(student(noisy, start, text), start, noisy)
    with torch.no_grad():
        conditional, unconditional = teacher(torch.cat([noisy, noisy]), torch.cat([start, start]),
                                             torch.cat([text, empty_text.expand_as(text)])).chunk(2)
        # guided as a pipeline guides at GUIDANCE_SCALE: the student draws so at guidance 1
        guided = unconditional + GUIDANCE_SCALE * (conditional - unconditional)
        earlier = maths.noised(maths.original(guided, start, noisy), guided, end)
        target = maths.consistency(student(earlier, end, text), end, earlier)
    return (((online - target) ** 2 + HUBER_C ** 2).sqrt() - HUBER_C).mean()


def noise_predictor(unet):
    """The UNet as consistency_loss calls it: its noise prediction in float32."""
    return lambda noisy, t, text: unet(noisy, t, text).sample.float()


def distill(pipe, device, steps: int, batch: int, seed: int, scenes: int, lr: float, deadline: float):
    """The LoRA's adapters (in place in a copy of the teacher UNet, by module path) and the run's record (steps,
    time, losses, the settings that made it): `steps` steps, fewer where `deadline` (time.monotonic()) passes first
    (one at least)."""
    torch.manual_seed(seed)
    student = copy.deepcopy(pipe.unet)
    adapters = attach_lora(student, LORA_RANK, device, LCM_LAYERS)
    data = latent_set(pipe.vae, pipe.tokenizer, device, scenes, seed)
    print(f"[lcm] {scenes} scenes encoded, {len(data.ids)} distinct prompts", flush=True)
    maths = Consistency(lcm_scheduler(pipe), device)
    params = _parameters(student)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    mixed = device.type == "cuda"  # the CPU runs plain fp32
    autocast = torch.autocast(device.type, AUTOCAST_DTYPE, enabled=mixed)
    scaler = torch.amp.GradScaler(device.type, enabled=mixed)  # fp16's small gradients kept
    with torch.no_grad(), autocast:
        empty_text = pipe.text_encoder(data.empty_ids)[0]
    progress, done = Progress("lcm", steps, every=100), 0
    while done < progress.steps:
        latents, ids = data.batch(batch, empty=0.0)  # the student is drawn with its prompt only (guidance 1)
        noise = torch.randn_like(latents)
        index = torch.randint(0, len(maths.starts), (batch,), device=device)
        with autocast:
            with torch.no_grad():
                text = pipe.text_encoder(ids)[0]
            loss = consistency_loss(noise_predictor(student), noise_predictor(pipe.unet), maths, latents, noise,
                                    index, text, empty_text)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if time.monotonic() >= deadline and done + 1 < progress.steps:  # this step is the last: progress says so
            print(f"[lcm] the time budget ends the run after {done + 1} of {steps} steps", flush=True)
            progress.steps = done + 1
        progress.step(done, loss)
        done += 1
    settings = {"lora_rank": LORA_RANK, "lora_layers": list(LCM_LAYERS), "guidance_scale": GUIDANCE_SCALE,
                "ddim_timesteps": len(maths.starts), "skip": maths.skip, "huber_c": HUBER_C,
                "warmup_steps": WARMUP_STEPS, "autocast": str(AUTOCAST_DTYPE) if mixed else None}
    return adapters, {**progress.record(done), "settings": settings}


def teacher_pipeline(device):
    """The shipped model as diffusers' pipeline, float32 on `device`, frozen: the teacher and its parts."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(MODEL_DIR, dtype=torch.float32, safety_checker=None,
                                                   requires_safety_checker=False).to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.unet.requires_grad_(False)
    pipe.text_encoder.requires_grad_(False)
    pipe.vae.requires_grad_(False)
    return pipe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True,
                        help="the LoRA file to write (.safetensors); its record goes beside it, <name>-training.json")
    parser.add_argument("--minutes", type=float, default=5.0,
                        help="time budget of the distillation steps, from the start (loading and encoding included; "
                             "the read-backs after it take seconds on a GPU)")
    parser.add_argument("--steps", type=int, default=1500,
                        help="at most this many steps, about what 5 minutes run on an H200 at batch 256 (1161 steps in "
                             "222 s, 2026-12-02); the record says how many ran: pass them to repeat the run")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--scenes", type=int, default=100_000, help="scenes encoded once for the whole run")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--read-back", type=int, default=200, help="scenes drawn for the first readings (0: none)")
    args = parser.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--batch", args.batch), ("--scenes", args.scenes)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not (args.minutes > 0 and args.lr > 0 and args.read_back >= 0):
        parser.error("--minutes and --lr must be above 0, --read-back 0 or more")
    if args.output.suffix != ".safetensors" or args.output.is_dir():
        parser.error(f"--output {args.output} must name a .safetensors file")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA GPU here")

    start = time.monotonic()
    record = run_record(args, device)
    pipe = teacher_pipeline(device)
    adapters, record["lcm"] = distill(pipe, device, args.steps, args.batch, args.seed, args.scenes, args.lr,
                                      start + 60 * args.minutes)
    # as the outline LoRA's file is written, with what it runs best with in its metadata
    atomic_write_bytes(args.output, save(lora_weights(adapters), metadata_of(RECOMMENDED)))
    if args.read_back:
        record[f"read_back_teacher_{TEACHER_STEPS}"] = read_back(pipe, args.read_back, 1234, device, GUIDANCE_SCALE,
                                                                 steps=TEACHER_STEPS)
        pipe.scheduler = lcm_scheduler(pipe)
        fusion = LoraFusion({"unet": pipe.unet})
        for lora in ([], [(read_lora(args.output), 1.0)]):  # the sampler alone, then with the file as read and fused
            fusion.set(lora)
            for steps in READ_BACK_STEPS:
                name = f"read_back_lcm_{steps}{'' if lora else '_without_lora'}"
                record[name] = read_back(pipe, args.read_back, 1234, device, 1.0, steps=steps)
                print(f"[lcm] {name}: {record[name]}", flush=True)
    record["seconds"] = round(time.monotonic() - start, 1)
    atomic_write_bytes(args.output.with_name(f"{args.output.stem}-training.json"),
                       json.dumps(record, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
