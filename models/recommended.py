"""What a model or a LoRA says it runs best with: a distilled model's few steps, its guidance scale, its scheduler.
A request that leaves those out gets them (demo.request) before the toolkit's own defaults.

Where it is said:
- a LoRA file's safetensors metadata under RECOMMENDED_METADATA, a JSON object of any of `denoising_steps`,
  `guidance_scale` and `scheduler` (what our trainers write: the shipped `shapes-lcm` has it);
- a LoRA file's name, as Hyper-SD and SDXL-Lightning name theirs for their step counts ("Hyper-SDXL-8steps-lora",
  "sdxl_lightning_4step_lora"): the steps;
- a model's model_index.json `_class_name`, where diffusers' pipeline of that name defaults to a distilled model's
  settings (the family says: models.families.base.Family.recommended), and a shipped model's own guidance scale.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping, Sequence

from core.errors import UsageError

RECOMMENDED_METADATA = "demo_diffusion.recommended"
# A step count in a file name: a number of 1..99 right before "step" or "steps", after a separator or the start.
STEPS_IN_NAME = re.compile(r"(?:^|[^0-9a-z])([1-9][0-9]?)[-_ ]?steps?(?![a-z])", re.IGNORECASE)


@dataclass(frozen=True)
class Recommended:
    """Settings a model or LoRA recommends (None: it says nothing of that one), and who says so (`by`, as a note
    names them)."""

    denoising_steps: int | None = None
    guidance_scale: float | None = None
    scheduler: str | None = None  # a scheduler name (demo.schedulers.scheduler_named takes it)
    by: str = ""

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name in SETTINGS)


SETTINGS = tuple(item.name for item in fields(Recommended) if item.name != "by")


def first_saying(recommendations: Sequence[Recommended], setting: str) -> Recommended | None:
    """The first of `recommendations` that says `setting` (one of SETTINGS; None: none does)."""
    return next((said for said in recommendations if getattr(said, setting) is not None), None)


def in_lora_file(path: Path, metadata: Mapping[str, str], name: str) -> Recommended:
    """What a LoRA file (called `name` in notes) recommends: its metadata's settings, else the step count its file
    name (or, for a folder's pytorch_lora_weights.safetensors, its folder's name) gives; a UsageError where the
    metadata holds something else than the settings, in their types and ranges."""
    said = Recommended(by=f"LoRA {name}")
    if RECOMMENDED_METADATA in metadata:
        said = replace(said, **_settings(path, metadata[RECOMMENDED_METADATA]))
    named = STEPS_IN_NAME.search(path.stem) or STEPS_IN_NAME.search(path.parent.name)
    if named and said.denoising_steps is None:
        said = replace(said, denoising_steps=int(named.group(1)))
    return said if said else Recommended()


def _settings(path: Path, text: str) -> dict:
    def refuse(why: str):
        raise UsageError(f"LoRA {path}: its {RECOMMENDED_METADATA} metadata {why}")

    try:
        given = json.loads(text)
    except ValueError:
        refuse("is not JSON")
    if not isinstance(given, dict):
        refuse("is not a JSON object")
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        refuse(f"names {', '.join(unknown)}; it may give {', '.join(SETTINGS)}")
    steps, scale, scheduler = (given.get(name) for name in SETTINGS)
    if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        refuse(f"gives denoising_steps {steps!r}, not a whole number of 1 or more")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale >= 0):
        refuse(f"gives guidance_scale {scale!r}, not a finite number of 0 or more")
    if scheduler is not None and not isinstance(scheduler, str):
        refuse(f"gives scheduler {scheduler!r}, not a name")
    return {name: value for name, value in zip(SETTINGS, (steps, None if scale is None else float(scale), scheduler))
            if value is not None}


def metadata_of(recommended: Recommended) -> dict[str, str]:
    """The safetensors metadata that says `recommended` (what a trainer writes beside its LoRA's tensors)."""
    settings = {name: getattr(recommended, name) for name in SETTINGS if getattr(recommended, name) is not None}
    return {RECOMMENDED_METADATA: json.dumps(settings)}
