"""The `scenes-sd3` built-in: a small model of SD3's family (MMDiT: SD3.5's joint transformer with RMS-normed Q/K, two
CLIP text encoders, no T5, rectified flow) trained on the `scenes` world (models/scenes/world.py), shipped with the
package: the yardstick's transformer, so that a transformer's fast paths (the adaptive step cache, FP8, our kernels)
are judged as the UNet's are (docs/quality.md).

It draws with `scenes`' VAE (its weights, with SD3's shift factor 0) and is read by `scenes`' detector. train.py trains
it (scripts/train_scenes_sd3.py). The weights (fp16 safetensors, model/) are recorded in weights.sha256: a damaged or
changed file is refused rather than loaded. Importing this module is light (no torch).
"""

from __future__ import annotations

from pathlib import Path

from models.shapes import shipped_damage

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"  # a diffusers folder as StableDiffusion3Pipeline saves it, T5 named null
HASHES = HERE / "weights.sha256"  # sha256sum's format, paths relative to this folder
GUIDANCE_SCALE = 4.0  # the guidance it is judged at (sd-quality's default for it)
YARDSTICK = "scenes"  # the case set and detector sd-quality judges it by


def damage() -> str | None:
    """Why the shipped files are not the recorded ones (None: they are)."""
    return shipped_damage(HERE, HASHES)
