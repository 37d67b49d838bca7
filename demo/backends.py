"""Backend selection (which implementation runs the stages, and why) and stage creation."""

from __future__ import annotations

import torch

from core.errors import UsageError
from demo.stages import Stage, TorchStage
from demo.trt_flavour import FLAVOURS, current_cc, version, why_cannot_run
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


def create_stages(backend: str, models: list[StageModel], device: torch.device, dtype: torch.dtype,
                  engine_settings=None, log=print) -> dict[str, Stage]:
    if backend == "torch":
        return {m.name: TorchStage(m, device, dtype) for m in models}
    from demo.engine import create_engine_stages, prepare_stage_engines

    engines = prepare_stage_engines(models, engine_settings, "cuda", torch.float16, log)
    return create_engine_stages(models, engines, backend, engine_settings.use_cuda_graph)
