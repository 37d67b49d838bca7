"""The torch backend's precision fp8 (models.fp8: the UNet's Linear GEMMs in FP8 e4m3, the rest in fp16): what the
spec is refused for, before anything is loaded, and the calibration its activation scales come from.

The calibration is the INT8 engines' (demo.backends.tensorrt.int8): the UNet's Linear inputs recorded while the torch
pipeline renders the built-in prompts at the workload's size with the model's own scheduler and guidance, cached by
what made it, in the folder and with the steps INT8 engines take by default (EngineOptions), so one calibration
serves both where they match; a run that finds it cached renders nothing for it."""

from __future__ import annotations

from dataclasses import replace

import torch

from core.errors import UsageError, field
from demo.backends import AUTO
from demo.backends.base import Workload
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.tensorrt.settings import int8_settings
from demo.backends.torch.options import TorchSettings
from demo.backends.torch.planted import INT8_NAIVE
from models.families import FP8, FP8_BASE
from models.source import ModelSource

FP8_CAPABILITY = (8, 9)  # Ada and Hopper on: FP8 tensor cores, what torch._scaled_mm needs on a GPU


def check_fp8_device(device: torch.device) -> None:
    """A UsageError where `device` has no FP8 GEMMs (the CPU: torch runs _scaled_mm there, but to test the math)."""
    needs = f"a GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (Ada, Hopper)"
    if device.type != "cuda":
        raise UsageError(f"{field('precision')} {FP8} runs the UNet's GEMMs on FP8 tensor cores: it needs {needs}, "
                         f"and this run is on the {device.type.upper()}; use {field('precision')} {FP8_BASE} or fp32")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise UsageError(f"{field('precision')} {FP8}: this GPU ({torch.cuda.get_device_name(device)}, compute "
                         f"capability {capability[0]}.{capability[1]}) has no FP8 tensor cores; it needs {needs}; use "
                         f"{field('precision')} {FP8_BASE}")


def fp8_settings(settings: TorchSettings, source_text: str, plugins: str, source: ModelSource, workload: Workload,
                 record_activations, scales: str) -> tuple[TorchSettings, str]:
    """`settings` (and where they came from) with the UNet in FP8 scaled as `scales` says (models.fp8), calibrated by
    `record_activations` (the device checked first: check_fp8_device; the calibration chooses the layers in every
    way of scaling, and gives the static scales); a UsageError for what does not combine with it. Our kernels read
    the Linear weights themselves (a packed QKV, GEGLU's and proj_out's matmuls) and would bypass the FP8 layers:
    plugins chosen by default are left out (with a note), plugins asked for are refused, as is the planted
    int8-naive fault (it quantizes the same layers)."""
    if INT8_NAIVE in getattr(settings, "planted_faults", ()):
        raise UsageError(f"{field('precision')} {FP8} does not combine with the planted fault {INT8_NAIVE} (both "
                         "quantize the UNet's Linear layers)")
    if settings.plugins and plugins != AUTO:
        raise UsageError(f"{field('precision')} {FP8} does not combine with plugins {','.join(settings.plugins)} "
                         f"(they read the Linear weights FP8 replaces); use {field('plugins')} none")
    if settings.plugins:
        source_text += f"; its plugins left out ({FP8})"
    calibration = int8_settings(EngineOptions(int8=True), source, workload, record_activations)
    settings = replace(settings, plugins=(), fp8=calibration, fp8_scales=scales)
    return settings, source_text
