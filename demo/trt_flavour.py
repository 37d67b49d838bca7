"""The one place that knows TensorRT comes in two flavours with the same Python API.

`tensorrt` (TensorRT 10/11, from NVIDIA's package index) runs on every GPU from T4 to Hopper and
builds for the GPU it runs on. `tensorrt_rtx` (TensorRT for RTX, `pip install tensorrt-rtx-cu13`)
runs on Turing, Ampere, Ada and Blackwell GPUs but not on Hopper (compute capability 9.0), and can
build on a machine with no GPU for target compute capabilities named up front.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from demo.errors import UsageError


@dataclass(frozen=True)
class Flavour:
    name: str  # --backend value
    module_name: str
    install: str  # how to install it
    unsupported_cc: tuple[tuple[int, int], ...] = ()  # GPUs whose runtime it refuses
    min_cc: tuple[int, int] = (7, 5)


FLAVOURS = {
    "tensorrt": Flavour(
        "tensorrt", "tensorrt",
        "pip install tensorrt, from NVIDIA's own package index"),
    "tensorrt-rtx": Flavour(
        "tensorrt-rtx", "tensorrt_rtx", "pip install tensorrt-rtx-cu13",
        unsupported_cc=((9, 0),)),
}


def flavour(name: str) -> Flavour:
    if name not in FLAVOURS:
        raise UsageError(f"unknown TensorRT flavour '{name}'; choose one of {', '.join(FLAVOURS)}")
    return FLAVOURS[name]


def import_flavour(name: str) -> ModuleType:
    """The flavour's module, or a UsageError naming the package to install."""
    spec = flavour(name)
    try:
        return importlib.import_module(spec.module_name)
    except ImportError as exc:
        raise UsageError(f"{name} is not installed ({exc.msg}); install it with: {spec.install}") from exc


def installed(name: str) -> bool:
    try:
        import_flavour(name)
        return True
    except UsageError:
        return False


def current_cc() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def why_cannot_run(name: str, cc: tuple[int, int] | None) -> str | None:
    """Why engines of this flavour cannot execute here (None when they can)."""
    spec = flavour(name)
    if not installed(name):
        return f"{name} is not installed (install it with: {spec.install})"
    if cc is None:
        return f"{name} needs a CUDA GPU to run engines, and none is visible"
    if cc in spec.unsupported_cc or cc < spec.min_cc:
        other = "--backend tensorrt" if name != "tensorrt" else "--backend tensorrt-rtx"
        return (f"{name} cannot run on this GPU (compute capability {cc[0]}.{cc[1]}); "
                f"use {other} or --backend torch")
    return None


def version(name: str) -> str:
    return import_flavour(name).__version__
