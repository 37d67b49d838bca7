"""The family registry (as vLLM's architecture registry): a model's family is chosen from its own config, from
model_index.json's `_class_name`, or, for a folder without one (or a ControlNet), from its denoiser's config. Adding a
family: a module here declaring its models.families.base.Family, its line in FAMILIES, its stage models (models/) and
its pipelines (demo.pipelines' PIPELINES) — docs/pipeline.md has the checklist."""

from __future__ import annotations

from typing import Callable

from core.errors import UsageError
from models.families.base import (
    ADAPTIVE_CACHE,
    CACHE_FORECAST,
    CLASSIFIER_FREE,
    CONTROLNET,
    DEFAULT_FP8_SCALES,
    EMBEDDED,
    ENGINES,
    FP8,
    FP8_BASE,
    FP8_SCALES,
    GUESS_MODE,
    GUIDANCE_KINDS,
    IMAGE_TO_IMAGE,
    INPAINTING,
    INT8,
    LORA,
    MODES,
    NO_GUIDANCE,
    REFINER,
    STEP_CACHE,
    TEXT_TO_IMAGE,
    Family,
)
from models.families.flux import FLUX
from models.families.sd import SD
from models.families.sd3 import SD3
from models.families.sdxl import SDXL

FAMILIES: tuple[Family, ...] = (SD, SDXL, SD3, FLUX)

__all__ = ["ADAPTIVE_CACHE", "CACHE_FORECAST", "CLASSIFIER_FREE", "CONTROLNET", "DEFAULT_FP8_SCALES", "EMBEDDED",
           "ENGINES", "FAMILIES",
           "FLUX", "FP8", "FP8_BASE", "FP8_SCALES", "GUESS_MODE", "GUIDANCE_KINDS", "IMAGE_TO_IMAGE", "INPAINTING",
           "INT8", "LORA", "MODES",
           "NO_GUIDANCE", "REFINER", "SD", "SD3", "SDXL", "STEP_CACHE", "TEXT_TO_IMAGE", "Family", "family_named",
           "family_of", "family_of_denoiser"]


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(name)


def family_of_denoiser(config: dict) -> Family:
    """The family whose denoiser a UNet or ControlNet config describes."""
    return next(family for family in FAMILIES if family.has_denoiser(config))


# A model folder without model_index.json is a UNet's: its family is read from there (a checkpoint saved by hand).
UNINDEXED_DENOISER = "unet"


def family_of(index: dict, component_config: Callable[[str], dict], model: str) -> Family:
    """The family of a model with this model_index.json (`index`; {} where it has none: then its UNINDEXED_DENOISER's
    config, `component_config(name)`, decides); a UsageError naming the class where no family runs its pipeline."""
    class_name = index.get("_class_name")
    if class_name is None:
        return family_of_denoiser(component_config(UNINDEXED_DENOISER))
    for family in FAMILIES:
        if family.runs_pipeline(class_name):
            return family
    raise UsageError(f"model '{model}': its model_index.json names {class_name}, which no family here runs (families: "
                     f"{', '.join(family.label for family in FAMILIES)})")
