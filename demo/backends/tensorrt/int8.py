"""The INT8 UNet engine's calibration: the UNet's own activations while the torch pipeline renders a set of prompts
(recorded by a function the runtime gives, which renders them), cached like the other artifacts (keyed by the model,
the prompts, the steps, scheduler, guidance and image size).

The engines' INT8 ONNX asks for the calibration only when it must be made (models.quantize.Int8Request), so a run
that finds its INT8 engine cached neither calibrates nor loads the torch modules for it.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Callable

from core.artifacts import cached_build
from core.errors import UsageError, field
from demo.schedulers import check_steps, make_scheduler
from models.quantize import Calibration, Int8Request
from models.source import ModelSource

CALIBRATION_VERSION = 1  # bump when what calibration records changes
# The built-in calibration set: varied subjects, styles and scenes, so that the recorded ranges are not one
# picture's; few, so that a first run's calibration (8 renders of 30 steps) stays short beside an engine build.
DEFAULT_PROMPTS = (
    "a photo of an astronaut riding a horse on mars",
    "a watercolor painting of a lighthouse on a cliff at sunset",
    "portrait of an old fisherman, dramatic lighting, 85mm photograph",
    "a bowl of ramen on a wooden table, top view, studio light",
    "a futuristic city skyline at night with neon signs, digital art",
    "a red fox in a snowy forest, wildlife photography",
    "an isometric illustration of a cozy library with plants",
    "a vintage car parked in front of a diner, 1950s, film grain",
)
# What records a calibration: (model, prompts, steps, scheduler, guidance scale, height, width, progress) -> Calibration
RecordActivations = Callable[[ModelSource, tuple[str, ...], int, str, float, int, int, Callable[[str], None]],
                             Calibration]


def read_calibration_prompts(path: str | None) -> tuple[str, ...]:
    """The prompts of a calibration prompts file (one a line; blank lines and lines starting with # skipped), or
    the built-in set; a UsageError for a file that is missing, a folder, not text, unreadable or holds none."""
    if path is None:
        return DEFAULT_PROMPTS
    named = f"{field('calibration_prompts')} {path}"
    not_text = f"{named}: not a text file (it takes UTF-8 text, a prompt a line)"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{named}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{named}: a folder, not a file of prompts") from None
    except UnicodeDecodeError:
        raise UsageError(not_text) from None
    except OSError as exc:
        raise UsageError(f"{named}: cannot read it: {exc.strerror or exc}") from None
    if "\0" in text:  # binary that happens to decode as UTF-8
        raise UsageError(not_text)
    prompts = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not prompts:
        raise UsageError(f"{named}: no prompts in it (one a line)")
    return prompts


def calibration_key(source: ModelSource, prompts: tuple[str, ...], steps: int, scheduler: str,
                    guidance_scale: float, height: int, width: int) -> dict:
    return {
        "model": source.fingerprint,
        "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
        "prompts": len(prompts),
        "steps": steps,
        "scheduler": scheduler,
        "guidance_scale": guidance_scale,
        "height": height,
        "width": width,
        "calibration_version": CALIBRATION_VERSION,
    }


def int8_request(source: ModelSource, prompts: tuple[str, ...], steps: int, scheduler: str, guidance_scale: float,
                 height: int, width: int, onnx_dir: Path, record: RecordActivations,
                 progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                 log: Callable[[str], None] = lambda *_: None) -> Int8Request:
    """What the INT8 ONNX is made from (its steps checked against its scheduler now); its calibration is read from
    `onnx_dir`, or recorded there first by `record`."""
    check_steps(make_scheduler(scheduler, source), scheduler, steps, "calibration_steps")  # before any export
    key = calibration_key(source, prompts, steps, scheduler, guidance_scale, height, width)
    path = onnx_dir / "unet.calibration.json"

    def calibrate() -> Calibration:
        def write(staging: Path) -> None:
            record(source, prompts, steps, scheduler, guidance_scale, height, width, progress).write(staging)

        cached_build(path, key, write, log=log, verify_content=True)
        return Calibration.read(path)

    return Int8Request(key, calibrate)
