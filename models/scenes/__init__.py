"""The `scenes` built-in: a small text-to-image model of SD 1.x's UNet family trained on scenes of one to four
objects (fill patterns, thin outlines, objects down to 12 pixels, two-tone backgrounds), shipped with the package:
the yardstick that sees what a fast path loses (docs/quality.md).

world.py defines the scenes, their prompts and the renderer; train.py trains the model (scripts/train_scenes.py);
detector.py reads an image back into the attributes its prompt names, and the objects' masks, colours and pattern
frequencies that sd-quality's fidelity figures compare. The weights (fp16 safetensors, model/) are recorded in
weights.sha256: a damaged or changed file is refused rather than loaded. Importing this module is light (no torch).
"""

from __future__ import annotations

from pathlib import Path

from models.shapes import shipped_damage

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"  # a diffusers folder: VAE, CLIP text encoder and tokenizer, UNet, scheduler
HASHES = HERE / "weights.sha256"  # sha256sum's format, paths relative to this folder
GUIDANCE_SCALE = 3.0  # the guidance it is judged at (sd-quality's default for it)
YARDSTICK = "scenes"  # the case set and detector sd-quality judges it by


def damage() -> str | None:
    """Why the shipped files are not the recorded ones (None: they are)."""
    return shipped_damage(HERE, HASHES)
