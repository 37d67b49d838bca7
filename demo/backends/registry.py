"""The backends by name, and the choice of one for a spec (`auto`: TensorRT where it can run here, else TensorRT for
RTX, else torch)."""

from __future__ import annotations

from core.errors import UsageError, field
from demo.backends import AUTO, BACKENDS, REFERENCE_BACKEND
from demo.backends.base import Backend
from demo.backends.tensorrt.backend import TensorRTBackend
from demo.backends.tensorrt.flavour import FLAVOURS, current_cc
from demo.backends.torch.backend import TorchBackend
from models.families import CONTROLNET, FP8, LORA, Family

REGISTRY: dict[str, Backend] = {backend.name: backend
                                for backend in (TorchBackend(), *(TensorRTBackend(name) for name in FLAVOURS))}
REFERENCE = REGISTRY[REFERENCE_BACKEND]


def backend_named(name: str) -> Backend:
    if name not in REGISTRY:
        raise UsageError(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)}")
    return REGISTRY[name]


def select_backend(requested: str, cc: tuple[int, int] | None = None, runs: bool = True, family: Family | None = None,
                   model: str | None = None, controlled: bool = False, loras: bool = False,
                   fp8: bool = False) -> tuple[Backend, str]:
    """(backend, reason) for a spec's backend on a GPU of compute capability `cc` (None: this machine's, or no GPU);
    with `runs` False, one named only needs to build here, not run. With the model's `family` (and the model's name),
    a backend its family lacks what it needs for (Backend.family_feature: TensorRT's engines; `controlled`, with
    ControlNets, and `loras`, with LoRA files: what those engines take, Family.engines_take), or with `fp8` one
    without FP8 (Backend.why_no_fp8), is refused where named, passed over under auto."""
    cc = cc if cc is not None else current_cc()
    if requested != AUTO:
        backend = backend_named(requested)
        unfit = why_not_for(backend, family, model, controlled, loras, fp8)
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
        reason = why_not_for(backend, family, model, controlled, loras, fp8)
        reason = f"{backend.name}: {reason}" if reason else backend.why_cannot_run(cc)
        if reason is None:
            return backend, f"auto: {backend.name} {backend.version()} runs on this GPU"
        reasons.append(reason)
    return REFERENCE, "auto: " + "; ".join(reasons)


def why_not_for(backend: Backend, family: Family | None, model: str | None, controlled: bool = False,
                loras: bool = False, fp8: bool = False) -> str | None:
    """Why `backend` cannot run a model of `family` (`controlled`: with ControlNets; `loras`: with LoRA files) (None:
    it can, or no family is given): what the backend needs that the family does not declare (its engines not built
    yet, or not taking ControlNets or LoRA yet); with `fp8`, its lack of FP8."""
    if fp8 and backend.why_no_fp8():
        return f"{field('precision')} {FP8}: {backend.why_no_fp8()}"
    if family is None or backend.family_feature is None:
        return None
    if not family.supports(backend.family_feature):
        return f"model '{model}' is of the {family.label} family, whose {backend.family_feature} are not built yet"
    for feature, name, asked in ((CONTROLNET, "controlnets", controlled), (LORA, "loras", loras)):
        if asked and not family.engines_take(feature):
            return (f"{field(name)}: model '{model}' is of the {family.label} family, whose {backend.family_feature} "
                    f"do not take {feature} yet")
    return None
