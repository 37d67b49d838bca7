"""Per-stage model classes sharing one interface (models.base.StageModel), registered by name (models.stages), with
the built-in models, the ONNX export, the optimizer and its passes, LoRA, INT8 and refit.

Importing the package is light (torch loads with models.base): the stage names and the check of them are here, and
the registry's names resolve on first use, so that a command answers --help and usage errors without torch.
"""

import importlib

from core.errors import UsageError

# The stages, by name: a model class each (models.stages.STAGE_MODELS), in this order.
CLIP, CLIP2, T5, UNET, TRANSFORMER, FLUX_TRANSFORMER, VAE, VAE_ENCODER = (
    "clip", "clip2", "t5", "unet", "transformer", "flux_transformer", "vae", "vae_encoder")
STAGE_NAMES = (CLIP, CLIP2, T5, UNET, TRANSFORMER, FLUX_TRANSFORMER, VAE, VAE_ENCODER)
UNET_SHALLOW = "unet_shallow"  # the step cache's second UNet stage, made with the UNet's (models.stages.stage_models)
CONTROLNET = "controlnet"  # ControlNet stages: controlnet0, controlnet1, ... (models.controlnet)
CONTROL_IMAGE = "_image"  # each one's conditioning image embedding, a stage run once per image: controlnet0_image ...
SHALLOW = "_shallow"  # under the step cache, each one's shallow pass (the residuals a shallow UNet pass reads)


def controlnet_stage(index: int) -> str:
    """The name of a pipeline's `index`-th ControlNet stage."""
    return f"{CONTROLNET}{index}"


def control_image_stage(index: int) -> str:
    """The name of the stage embedding the `index`-th ControlNet's conditioning image."""
    return controlnet_stage(index) + CONTROL_IMAGE


def is_controlnet_stage(name: str) -> bool:
    """A ControlNet's per-step stage (not its conditioning image's)."""
    return name.startswith(CONTROLNET) and name[len(CONTROLNET):].isdigit()


def shallow_controlnet_stage(index: int) -> str:
    """The name of the `index`-th ControlNet's shallow pass under the step cache."""
    return controlnet_stage(index) + SHALLOW


def is_control_image_stage(name: str) -> bool:
    return name.endswith(CONTROL_IMAGE) and is_controlnet_stage(name.removesuffix(CONTROL_IMAGE))


def is_shallow_controlnet_stage(name: str) -> bool:
    return name.endswith(SHALLOW) and is_controlnet_stage(name.removesuffix(SHALLOW))

# name -> the module defining it, imported on first use
_LAZY = {**{name: "models.stages" for name in (
    "STAGE_MODELS", "GUIDED_STAGES", "SINGLE_IMAGE_STAGES",
    "text_to_image_stages", "image_to_image_stages", "stage_batch", "check_model_stages", "stage_models")},
         "StageModel": "models.base", "CLIPModel": "models.clip", "CLIP2Model": "models.clip",
         "T5Model": "models.t5", "UNetModel": "models.unet", "SD3TransformerModel": "models.transformer",
         "FluxTransformerModel": "models.transformer",
         "VAEDecoderModel": "models.vae", "VAEEncoderModel": "models.vae"}


def check_stage_names(names) -> None:
    """A UsageError for stage names that are none of STAGE_NAMES (or for an empty list of them)."""
    unknown = [name for name in names if name not in STAGE_NAMES]
    if unknown or not names:
        raise UsageError(f"unknown stage(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(STAGE_NAMES)}")


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'models' has no attribute '{name}'")
    return getattr(importlib.import_module(_LAZY[name]), name)
