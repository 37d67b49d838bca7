"""The backends by name, and the choice of one for a spec (`auto`: TensorRT where it can run here, else TensorRT for
RTX, else torch)."""

from __future__ import annotations

from core.errors import UsageError, field
from demo.backends import AUTO, BACKENDS, REFERENCE_BACKEND
from demo.backends.base import Backend
from demo.backends.tensorrt.backend import TensorRTBackend
from demo.backends.tensorrt.flavour import FLAVOURS, current_cc
from demo.backends.torch.backend import TorchBackend
from models.families import Family

REGISTRY: dict[str, Backend] = {backend.name: backend
                                for backend in (TorchBackend(), *(TensorRTBackend(name) for name in FLAVOURS))}
REFERENCE = REGISTRY[REFERENCE_BACKEND]


def backend_named(name: str) -> Backend:
    if name not in REGISTRY:
        raise UsageError(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)}")
    return REGISTRY[name]


def select_backend(requested: str, cc: tuple[int, int] | None = None, runs: bool = True, family: Family | None = None,
                   model: str | None = None, controlled: bool = False, loras: bool = False) -> tuple[Backend, str]:
    """(backend, reason) for a spec's backend on a GPU of compute capability `cc` (None: this machine's, or no GPU);
    with `runs` False, one named only needs to build here, not run. With the model's `family` (and the model's name),
    a backend its family lacks what it needs for (Backend.family_feature: TensorRT's engines; `controlled`, with
    ControlNets: Backend.controlnet_feature, their engines; with `loras`, the spec giving LoRA files,
    Backend.lora_feature: their refit) is refused where named, passed over under auto."""
    cc = cc if cc is not None else current_cc()
    if requested != AUTO:
        backend = backend_named(requested)
        unfit = why_not_for(backend, family, model, controlled, loras)
        if unfit:
            raise UsageError(f"{field('backend')} {backend.name}: {unfit}; use {field('backend')} {REFERENCE.name}")
        reason = backend.why_cannot_run(cc) if runs else backend.why_cannot_build()
        if reason:
            raise UsageError(reason)
        return backend, " ".join(filter(None, ("requested:", backend.name, backend.version())))
    reasons = []
    for backend in REGISTRY.values():
        if backend is REFERENCE:  # the fallback
            continue
        reason = why_not_for(backend, family, model, controlled, loras)
        reason = f"{backend.name}: {reason}" if reason else backend.why_cannot_run(cc)
        if reason is None:
            return backend, f"auto: {backend.name} {backend.version()} runs on this GPU"
        reasons.append(reason)
    return REFERENCE, "auto: " + "; ".join(reasons)


def why_not_for(backend: Backend, family: Family | None, model: str | None, controlled: bool = False,
                loras: bool = False) -> str | None:
    """Why `backend` cannot run a model of `family` (`controlled`: with ControlNets; `loras`: with LoRA files) (None:
    it can, or no family is given): what the backend needs that the family does not declare (its engines, or its
    ControlNets', not built yet; their LoRA refit)."""
    if family is None:
        return None
    needed = (backend.family_feature, backend.controlnet_feature if controlled else None)
    missing = next((feature for feature in needed if feature is not None and not family.supports(feature)), None)
    if missing is not None:
        return f"model '{model}' is of the {family.label} family, whose {missing} are not built yet"
    if loras and backend.lora_feature is not None and not family.supports(backend.lora_feature):
        return (f"{field('loras')} on model '{model}' of the {family.label} family: its {backend.name} engines take "
                f"no LoRA (refitting its {family.denoiser}'s engine is not built; the torch backend fuses LoRA files "
                "in)")
    return None
