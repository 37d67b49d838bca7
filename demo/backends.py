"""Backend selection (which implementation runs the stages, and why), the one place that decides
device and precision, and stage creation."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from core.errors import UsageError
from demo.stages import Stage, TorchStage
from demo.torch_accel import FALLBACK, TorchSettings
from demo.trt_flavour import FLAVOURS, TensorRTAPI, current_cc, version, why_cannot_run
from models.base import StageModel

BACKENDS = ("auto", "torch", *FLAVOURS)


def select_backend(requested: str, cc: tuple[int, int] | None = None) -> tuple[str, str]:
    """(backend, reason) for a --backend value on a GPU of compute capability `cc` (None: no GPU)."""
    if requested not in BACKENDS:
        raise UsageError(f"unknown backend '{requested}'; choose one of {', '.join(BACKENDS)}")
    cc = cc if cc is not None else current_cc()
    if requested == "torch":
        return "torch", "requested with --backend torch"
    if requested in FLAVOURS:
        reason = why_cannot_run(requested, cc)
        if reason:
            raise UsageError(reason)
        return requested, f"requested with --backend {requested} ({version(requested)})"
    reasons = []
    for name in FLAVOURS:  # TensorRT first: it runs on every GPU the toolkit supports
        reason = why_cannot_run(name, cc)
        if reason is None:
            return name, f"auto: {name} {version(name)} runs on this GPU"
        reasons.append(reason)
    return "torch", "auto: " + "; ".join(reasons)


def device_and_dtype(backend: str, precision: str = "auto") -> tuple[torch.device, torch.dtype]:
    """Where stages run (or, for engines, where ONNX is exported) and in which precision.

    Engines are fp16 by default even when built on a CPU, so that engines built there for a GPU are
    the ones that GPU looks for. The torch backend runs fp16 on a GPU and fp32 on a CPU (CPU kernels
    are slow or missing in fp16)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if precision == "auto":
        precision = "fp16" if backend != "torch" or device.type == "cuda" else "fp32"
    if precision not in ("fp16", "fp32"):
        raise UsageError(f"precision must be auto, fp16 or fp32, got '{precision}'")
    return device, torch.float16 if precision == "fp16" else torch.float32


def _stage_settings(model: StageModel, settings: TorchSettings, dtype: torch.dtype,
                    progress: Callable[[str], None]) -> TorchSettings:
    """A stage's torch settings: a stage upcast beyond the pipeline's precision (SDXL's VAE) keeps its own modules,
    since our kernels take the pipeline's fp16."""
    upcast = model.stage_dtype(dtype)
    if not settings.plugins or upcast == dtype:
        return settings
    progress(f"[plugins] {model.name}: none (it runs in {str(upcast).removeprefix('torch.')}, our kernels in "
             f"{str(dtype).removeprefix('torch.')})")
    return replace(settings, plugins=())


def create_stages(backend: str, models: list[StageModel], device: torch.device, dtype: torch.dtype,
                  engine_settings=None, log: Callable[[str], None] = print,
                  progress: Callable[[str], None] = print, torch_settings: TorchSettings | None = None
                  ) -> dict[str, Stage]:
    """The pipeline's stages: the modules themselves (torch, as `torch_settings` say; default: unchanged)
    or engines (built or found as `engine_settings` say)."""
    if backend == "torch":
        settings = torch_settings or FALLBACK
        stages = {m.name: TorchStage(m, device, m.stage_dtype(dtype), _stage_settings(m, settings, dtype, progress))
                  for m in models}
        for stage in stages.values():
            if stage.substitution is not None:
                progress(stage.substitution.line(stage.name))
                for family, reasons in stage.substitution.skipped.items():
                    for reason in reasons:
                        log(f"[plugins] {stage.name}: {family} skipped at {reason}")
        return stages
    from demo.engine import prepare_stage_engines, stage_onnx
    from demo.engine_runtime import create_engine_stages

    engines = prepare_stage_engines(models, engine_settings, device, dtype, log, progress)
    unforced = replace(engine_settings, force_onnx_export=False, force_onnx_optimize=False)  # refits never re-export
    return create_engine_stages(models, engines, TensorRTAPI(backend), dtype, engine_settings.use_cuda_graph,
                                device, log, engine_settings.plugins, engine_settings.plugin_convention,
                                onnx=lambda model: stage_onnx(model, unforced, device, dtype, log))
