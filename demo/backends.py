"""Backend selection: which implementation runs the stages, and why."""

from __future__ import annotations

import torch

from demo.errors import UsageError
from demo.stages import Stage, TorchStage
from models.base import StageModel

BACKENDS = ("auto", "torch")


def select_backend(requested: str) -> tuple[str, str]:
    """(backend, reason) for a --backend value."""
    if requested not in BACKENDS:
        raise UsageError(f"unknown backend '{requested}'; choose one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch", "requested with --backend torch"
    return "torch", "auto: no TensorRT backend is available in this build"


def create_stages(backend: str, models: list[StageModel], device: torch.device, dtype: torch.dtype) -> dict[str, Stage]:
    assert backend == "torch", backend
    return {m.name: TorchStage(m, device, dtype) for m in models}
