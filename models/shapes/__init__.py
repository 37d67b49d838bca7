"""The `shapes` built-in: a small text-to-image model trained on procedural scenes, shipped with the package.

scenes.py defines the scenes, their prompts, the renderer and the ControlNet's silhouettes; train.py trains the model
and its outline LoRA from them (scripts/train_shapes.py), train_lcm.py its LCM-LoRA, `shapes-lcm`
(scripts/train_shapes_lcm.py), train_controlnet.py its ControlNet, `shapes-controlnet`
(scripts/train_shapes_controlnet.py); detector.py reads an image back into the attributes its prompt names. The
weights (fp16 safetensors: model/, outline.safetensors, lcm.safetensors, controlnet/) are recorded in weights.sha256
beside train.py: a damaged or changed file is refused rather than loaded. Importing this module is light (no torch).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"  # a diffusers folder: VAE, CLIP text encoder and tokenizer, UNet, scheduler
OUTLINE_LORA = HERE / "outline.safetensors"  # draws outlines instead of filled shapes (diffusers/PEFT keys)
LCM_LORA = HERE / "lcm.safetensors"  # an LCM-LoRA: 4 LCMScheduler steps without guidance (train_lcm.py)
CONTROLNET_DIR = HERE / "controlnet"  # a ControlNetModel: the shape where its control image's silhouette is
HASHES = HERE / "weights.sha256"  # sha256sum's format, paths relative to this folder
# The guidance scale it draws best at (sd-quality, fp32, 30 steps: results/quality-shapes); above it colours drift.
GUIDANCE_SCALE = 3.0
YARDSTICK = "shapes"  # the case set and detector sd-quality judges it by


def shipped_files(hashes: Path = HASHES) -> dict[str, str]:
    """The shipped files' recorded sha256 by path (relative to the folder of `hashes`)."""
    lines = hashes.read_text().splitlines()
    return {path: digest for digest, path in (line.split("  ", 1) for line in lines if line.strip())}


def shipped_damage(folder: Path, hashes: Path) -> str | None:
    """Why the files `hashes` records (paths relative to `folder`) are not the recorded ones (None: they are)."""
    try:
        recorded = shipped_files(hashes)
    except (OSError, ValueError) as error:
        return f"{hashes.name} unreadable ({error})"
    for path, digest in recorded.items():
        file = folder / path
        if not file.is_file():
            return f"{path} is missing"
        if hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            return f"{path} is not the file recorded in {hashes.name}"
    return None


def damage() -> str | None:
    """Why the shipped files are not the recorded ones (None: they are)."""
    return shipped_damage(HERE, HASHES)
