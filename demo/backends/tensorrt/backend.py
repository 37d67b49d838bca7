"""The TensorRT backend object, one per flavour."""

from __future__ import annotations

from dataclasses import replace

import torch

from core.errors import UsageError
from demo.backends import INT8_UNET
from demo.backends.base import Backend, Capabilities, Description
from demo.backends.tensorrt.build import EngineSettings, prepare_stage_engines, stage_onnx
from demo.backends.tensorrt.flavour import FLAVOURS, TensorRTAPI, import_flavour, version, why_cannot_run
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.tensorrt.refit import ENGINES_NEED_REFIT
from demo.backends.tensorrt.runtime import create_engine_stages
from demo.backends.tensorrt.settings import check_engine_request, engine_settings
from models.families import ENGINES


class TensorRTBackend(Backend):
    capabilities = Capabilities(artifacts=True, refit=True, cuda_graphs=True, layer_timings=True, cpu=False)
    options_type = EngineOptions
    family_feature = ENGINES

    def __init__(self, flavour: str):
        self.name = FLAVOURS[flavour].name

    def why_cannot_run(self, cc):
        return why_cannot_run(self.name, cc)

    def why_cannot_build(self):
        try:
            import_flavour(self.name)
        except UsageError as exc:
            return str(exc)
        return None

    def version(self):
        return version(self.name)

    def why_serial(self, settings):
        return f"{self.name}'s engines share one working-memory block (create_engine_stages)"

    def why_no_fp8(self):
        try:
            named = f"{self.name} {self.version()}"
        except UsageError:  # not installed here: refused all the same
            named = self.name
        return (f"{named} engines have no FP8 here (the ONNX export writes no FP8 Q/DQ; the engines' quantization is "
                "the INT8 UNet)")

    def default_dtype(self, device, family):
        # fp16 even where engines are built on a CPU: engines built there for a GPU are the ones that GPU looks for
        return torch.float16

    def settings(self, source, options: EngineOptions, plugins, use_cuda_graph, workload, device, dtype,
                 record_activations=None, fp8=False):  # fp8 never comes here: why_no_fp8 refuses it first
        return (engine_settings(options, source, self.name, workload, plugins, use_cuda_graph, record_activations),
                "")

    def prepare(self, models, settings_of, device, dtype, log, progress):
        prepare_stage_engines(models, settings_of, device, dtype, log, progress)
        return {model.name: settings_of(model).stats[model.name] for model in models}

    def create_stages(self, models, settings_of, device, dtype, log, progress):
        engines = prepare_stage_engines(models, settings_of, device, dtype, log, progress)

        def onnx(model):  # what a refit reads base weights from: never exported again for it
            unforced = replace(settings_of(model), force_onnx_export=False, force_onnx_optimize=False)
            return stage_onnx(model, unforced, device, dtype, log)

        return create_engine_stages(models, engines, TensorRTAPI(self.name), dtype, settings_of, device, log, onnx)

    def check_loras(self, options: EngineOptions):
        if not options.build_enable_refit:
            raise UsageError(ENGINES_NEED_REFIT)

    def check_request(self, settings: EngineSettings, source, request):
        check_engine_request(settings, source, request)

    def describe(self, settings: EngineSettings) -> Description:
        options = [name for name, on in (("CUDA graphs", settings.use_cuda_graph),
                                         (INT8_UNET, settings.int8 is not None)) if on]
        return Description(settings.plugins, tuple(options))

    def stats(self, stages, settings_of):
        built = {name: settings_of(stage.model).stats.get(name) for name, stage in stages.items()}
        built = {name: stat for name, stat in built.items() if stat is not None}
        rebuilt = any(stat["onnx_bytes"] is not None for stat in built.values())
        return {"build_s": (sum((stat["onnx_s"] or 0.0) + stat["engine_s"] for stat in built.values())
                            if rebuilt else None),
                "engines_reused": not rebuilt,
                "engine_bytes": sum(stat["engine_bytes"] for stat in built.values()),
                "engine_device_memory_bytes": max(stage.engine.device_memory_size for stage in stages.values())}
