"""Trains the `scenes-sd3` model on the `scenes` world (models/scenes/world.py), fixed seeds, on one GPU.

    python scripts/train_scenes_sd3.py --output DIR      # 6 minutes (--minutes) on an H200

One stage: the two CLIP text encoders (both started from `scenes`' trained one, each with a projection of its own)
and the joint transformer together, by rectified flow (SD3's objective: the latents x0 and the noise e mixed as
(1 - s) x0 + s e, s drawn logit-normally, the transformer predicting e - x0), a tenth of the prompts empty for
classifier-free guidance, on `scenes`' latents (its shipped VAE, frozen). The transformer is SD3.5's (joint attention
over text and image tokens, Q/K RMS norms, AdaLN-modulated blocks) at a small width. No T5: the pipeline joins zeros
where its tokens would be (as diffusers' StableDiffusion3Pipeline does without one), and training sees the same.
DIR receives `scenes-sd3/` (a diffusers folder, fp16 safetensors) and `training.json` (steps, losses, times, a first
reading by the detector). To ship a new training, they replace models/scenes_sd3/model and training.json, and
weights.sha256 is written again (`cd models/scenes_sd3 && find model -type f | sort | xargs sha256sum >
weights.sha256`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from models import scenes
from models.builtin import scheduler_from
from models.scenes import train as scenes_train
from models.scenes.world import SIZE
from models.scenes_sd3 import GUIDANCE_SCALE
from models.shapes import train as shapes_train

TEXT_WIDTH = 128  # each CLIP's (scenes' text encoder's): their states side by side are the joint attention's input
T5_LENGTH = 256  # the zero tokens the pipeline joins for the T5 it lacks (StableDiffusion3Pipeline's default length)
TRANSFORMER_CONFIG = {
    "sample_size": SIZE // 8, "patch_size": 2, "in_channels": 4, "out_channels": 4,
    "num_layers": 6, "attention_head_dim": 32, "num_attention_heads": 4,
    "joint_attention_dim": 2 * TEXT_WIDTH, "caption_projection_dim": 4 * 32, "pooled_projection_dim": 2 * TEXT_WIDTH,
    "pos_embed_max_size": SIZE // 8,  # patches a side: up to twice the native size
    "qk_norm": "rms_norm",
}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0}
EMPTY_SHARE = scenes_train.EMPTY_SHARE


class Prompts(torch.nn.Module):
    """What StableDiffusion3Pipeline makes of prompt ids without a T5: both CLIPs' penultimate states side by side,
    then T5_LENGTH zero tokens; their pooled projections side by side."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        one = self.first(ids, output_hidden_states=True)
        two = self.second(ids, output_hidden_states=True)
        states = torch.cat([one.hidden_states[-2], two.hidden_states[-2]], dim=-1)
        states = torch.cat([states, states.new_zeros(states.shape[0], T5_LENGTH, states.shape[-1])], dim=1)
        return states, torch.cat([one.text_embeds, two.text_embeds], dim=-1)


def text_encoders(device) -> tuple:
    """Two CLIPs with projections, each started from `scenes`' trained text encoder (the projection new)."""
    from transformers import CLIPTextModelWithProjection

    return tuple(CLIPTextModelWithProjection.from_pretrained(scenes.MODEL_DIR / "text_encoder", dtype=torch.float32)
                 .to(device).train() for _ in range(2))


def scenes_vae(device):
    """`scenes`' shipped VAE, frozen, with SD3's shift factor (0: its latents are only scaled)."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(scenes.MODEL_DIR / "vae", torch_dtype=torch.float32).to(device).eval()
    vae.register_to_config(shift_factor=0.0)
    return vae.requires_grad_(False)


def flow_loss(transformer, prompts: Prompts, data, batch: int, device) -> torch.Tensor:
    """Rectified flow's loss on a batch of `data` (shapes' LatentSet)."""
    latents, ids = data.batch(batch, EMPTY_SHARE)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        noise = torch.randn_like(latents)
        sigma = torch.sigmoid(torch.randn(batch, device=device))
        s = sigma.view(-1, 1, 1, 1)
        states, pooled = prompts(ids)
        predicted = transformer(hidden_states=(1 - s) * latents + s * noise, timestep=sigma * 1000,
                                encoder_hidden_states=states, pooled_projections=pooled).sample.float()
    return ((predicted - (noise - latents)) ** 2).mean()


def train(device, steps: int, batch: int, seed: int, deadline: float, dataset: int):
    """The text encoders and the transformer, together; fewer steps where `steps` would not fit before `deadline`."""
    from diffusers import SD3Transformer2DModel

    tok = scenes_train.tokenizer()
    torch.manual_seed(seed)
    vae = scenes_vae(device)
    prompts = Prompts(*text_encoders(device))
    transformer = SD3Transformer2DModel(**TRANSFORMER_CONFIG).to(device).train()
    data = scenes_train.latent_set(vae, tok, device, dataset, seed)
    print(f"[transformer] {dataset} scenes encoded, {len(data.ids)} distinct prompts", flush=True)
    record = shapes_train.train_together((prompts, transformer),
                                         lambda: flow_loss(transformer, prompts, data, batch, device),
                                         shapes_train.Progress("transformer", steps), device, deadline)
    return pipeline(vae, prompts.first.eval(), prompts.second.eval(), tok, transformer.eval()), record


def pipeline(vae, first, second, tok, transformer):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler_from(SCHEDULER), vae=vae,
                                    text_encoder=first, tokenizer=tok, text_encoder_2=second, tokenizer_2=tok,
                                    text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for scenes-sd3/ and training.json")
    parser.add_argument("--steps", type=int, default=20_000, help="transformer steps (fewer where they do not fit "
                        "--minutes: training.json records how many ran; pass them here to repeat the run)")
    parser.add_argument("--batch", type=int, default=256, help="latents per step")
    parser.add_argument("--scenes", type=int, default=200_000, help="scenes encoded for training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=6.0, help="time budget")
    parser.add_argument("--read-back", type=int, default=200, help="scenes drawn for the first reading (0: none)")
    args, device, start, deadline, record = shapes_train.start_training(parser, argv, ("steps", "batch", "scenes"))

    pipe, record["transformer"] = train(device, args.steps, args.batch, args.seed + 1, deadline, args.scenes)
    if args.read_back:
        for guidance in (GUIDANCE_SCALE, 2 * GUIDANCE_SCALE):
            record[f"read_back_guidance_{guidance:g}"] = scenes_train.read_back(pipe, args.read_back, 1234, device,
                                                                               guidance)
    shapes_train.save_training(pipe, args.output / "scenes-sd3", record, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
