"""The torch backend object."""

from __future__ import annotations

from dataclasses import replace

import torch

from core.errors import UsageError, field
from demo.backends import TORCH
from demo.backends.base import Backend, Capabilities, Description
from demo.backends.torch.fp8 import check_fp8_device, fp8_settings
from demo.backends.torch.options import GRAPHING_COMPILE_MODES, TorchOptions
from demo.backends.torch.planted import fault_options, planted_settings
from demo.backends.torch.settings import TorchSettings, resolve_torch_settings
from demo.backends.torch.stage import TorchStage


def accel_options(settings: TorchSettings) -> tuple[str, ...]:
    """The settings other than plugins, as reports list them."""
    options = [name for name, on in (("channels-last", settings.channels_last), ("CUDA graphs", settings.cuda_graph))
               if on]
    options += [f"compile {settings.compile}"] if settings.compile != "none" else []
    return tuple(options + ([f"FP8 {settings.fp8_scales} scales"] if settings.fp8 is not None else []))


# GPUs from this compute capability on (Ampere) have bf16 kernels, as torch.cuda.is_bf16_supported(including_emulation=
# False) tells for the current device alone
BF16_CAPABILITY = (8, 0)


def check_bf16_gpu(device: torch.device) -> None:
    """A UsageError where the GPU has no bf16 kernels for a VAE asked to run in bf16."""
    capability = torch.cuda.get_device_capability(device)
    if capability < BF16_CAPABILITY:
        raise UsageError(f"{field('vae_precision')} bf16: this GPU (compute capability "
                         f"{capability[0]}.{capability[1]}) has no bf16 kernels (Ampere and newer have); use "
                         f"{field('vae_precision')} fp32")


class TorchBackend(Backend):
    name = TORCH
    capabilities = Capabilities(artifacts=False, refit=False, cuda_graphs=True, layer_timings=False, cpu=True)
    options_type = TorchOptions

    def why_cannot_run(self, cc):
        return None

    def why_serial(self, settings):
        # torch.compile's graphing modes replay every compiled stage from one cudagraph tree: one memory pool whose
        # graphs reuse each other's memory on the assumption that they replay one after the other, on one stream.
        graphing = sorted({each.compile for each in settings if each.compile in GRAPHING_COMPILE_MODES})
        if graphing:
            return (f"torch.compile {graphing[0]}'s CUDA graph trees share one memory pool and replay one graph "
                    "after the other")
        return None

    def why_no_fp8(self):
        return None

    def default_dtype(self, device, family):
        if device.type != "cuda":
            return torch.float32  # CPU kernels are slow or missing in fp16 and bf16
        if family.gpu_precision == "bf16" and torch.cuda.get_device_capability(device) >= BF16_CAPABILITY:
            return torch.bfloat16
        return torch.float16

    def settings(self, source, options: TorchOptions, plugins, use_cuda_graph, workload, device, dtype,
                 record_activations=None, fp8=False):
        if source.vae_precision == "bf16" and device.type == "cuda":
            check_bf16_gpu(device)
        if fp8:  # before the defaults: their plugins, on a GPU without FP8, are not what is wrong
            check_fp8_device(device)
        settings, source_text = resolve_torch_settings(plugins, options.channels_last, use_cuda_graph, options.compile,
                                                       device, family=source.family.tuned_key)
        # test-only faults, from the environment alone
        settings, source_text = planted_settings(settings, source_text, plugins)
        if fp8:
            settings, source_text = fp8_settings(settings, source_text, plugins, source, workload, record_activations,
                                                 options.fp8_scaling)
        return settings, source_text

    def create_stages(self, models, settings_of, device, dtype, log, progress):
        stages = {}
        # precision fp8: calibrated (or its calibration read) before any stage of this pipeline takes memory
        fp8 = next((settings.fp8.calibrate() for settings in map(settings_of, models) if settings.fp8 is not None),
                   None)
        for model in models:
            settings = settings_of(model)
            upcast = model.stage_dtype(dtype)
            # SDXL's VAE in fp32 in an fp16 pipeline, an SD3 model in bf16: our kernels take fp16
            if settings.plugins and (upcast != dtype or upcast == torch.bfloat16):
                progress(f"[plugins] {model.name}: none (it runs in {str(upcast).removeprefix('torch.')}, our kernels "
                         "in float16)")
                settings = replace(settings, plugins=())
            whole = stages[model.part_of] if model.part_of else None
            stage = stages[model.name] = TorchStage(model, device, upcast, settings, whole, fp8)
            if stage.fp8 is not None:
                progress(stage.fp8.line(stage.name))
            if stage.substitution is not None and whole is None:
                progress(stage.substitution.line(stage.name))
                for family, reasons in stage.substitution.skipped.items():
                    for reason in reasons:
                        log(f"[plugins] {stage.name}: {family} skipped at {reason}")
        return stages

    def describe(self, settings: TorchSettings) -> Description:
        return Description(settings.plugins, accel_options(settings) + fault_options(settings))

    def stats(self, stages, settings_of):
        prepared = [(stage.settings, stage.prepare_seconds) for stage in stages.values()]
        return {"substitution": {name: stage.substitution.as_dict() for name, stage in stages.items()
                                 if stage.substitution is not None and not stage.model.part_of},
                "compile_s": (sum(seconds["first_calls"] for _, seconds in prepared)
                              if any(settings.compile != "none" for settings, _ in prepared) else None),
                "capture_s": (sum(seconds["capture"] for _, seconds in prepared)
                              if any(settings.cuda_graph for settings, _ in prepared) else None)}
