"""The one place that knows TensorRT's flavours and versions.

Two flavours share one Python API: `tensorrt` (TensorRT 8.6 through 11.x) runs on every GPU from T4 to
Hopper and builds for the GPU it runs on; `tensorrt_rtx` (TensorRT for RTX, `pip install tensorrt-rtx-cu13`)
runs on Turing, Ampere, Ada and Blackwell but not Hopper (compute capability 9.0), and can build on a
machine with no GPU for target compute capabilities named up front.

Versions differ in a few calls. `TensorRTAPI` decides each by feature (what the imported module has),
never by comparing version numbers at the call sites:
- strongly typed networks (10.0+): fp16 ONNX gives an fp16 engine; before that, fp16 ONNX needs
  `BuilderFlag.FP16` on an explicit-batch network;
- user-managed device memory (10.1+: `create_execution_context(USER_MANAGED)`, `device_memory_size_v2`,
  `set_device_memory(ptr, size)`); before that, `create_execution_context_without_device_memory()`,
  `device_memory_size` and `context.device_memory = ptr`;
- build progress monitors (10.0+); before that the builder is silent and we report elapsed time ourselves;
- target compute capabilities (TensorRT for RTX);
- bf16 (10.0+, strongly typed): a VAE in bf16 (--vae-precision bf16) builds there only.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import ModuleType

from core.errors import UsageError, field


@dataclass(frozen=True)
class Flavour:
    name: str  # a spec's backend
    module_name: str
    install: str  # how to install it
    min_version: tuple[int, ...] = ()  # older releases lack the name-based I/O API the runtime uses
    unsupported_cc: tuple[tuple[int, int], ...] = ()  # GPUs whose runtime it refuses
    min_cc: tuple[int, int] = (7, 5)


FLAVOURS = {
    "tensorrt": Flavour(
        "tensorrt", "tensorrt",
        "pip install tensorrt, from NVIDIA's own package index (8.6 or newer)",
        min_version=(8, 6)),
    "tensorrt-rtx": Flavour(
        "tensorrt-rtx", "tensorrt_rtx", "pip install tensorrt-rtx-cu13",
        unsupported_cc=((9, 0),)),
}


def flavour(name: str) -> Flavour:
    if name not in FLAVOURS:
        raise UsageError(f"unknown TensorRT flavour '{name}'; choose one of {', '.join(FLAVOURS)}")
    return FLAVOURS[name]


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def import_flavour(name: str) -> ModuleType:
    """The flavour's module, or a UsageError naming the package to install or the version needed."""
    spec = flavour(name)
    try:
        module = importlib.import_module(spec.module_name)
    except ImportError as exc:
        raise UsageError(f"{name} is not installed ({exc.msg}); install it with: {spec.install}") from exc
    if parse_version(module.__version__) < spec.min_version:
        wanted = ".".join(map(str, spec.min_version))
        raise UsageError(f"{name} {module.__version__} is too old: this toolkit needs {wanted} or newer "
                         f"({spec.install})")
    return module


def current_cc() -> tuple[int, int] | None:
    import torch  # loaded where a GPU is asked about: the flavours' names stay light to import

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def why_cannot_run(name: str, cc: tuple[int, int] | None) -> str | None:
    """Why engines of this flavour cannot execute here (None when they can)."""
    spec = flavour(name)
    try:
        import_flavour(name)
    except UsageError as exc:
        return str(exc)
    if cc is None:
        return f"{name} needs a CUDA GPU to run engines, and none is visible"
    if cc in spec.unsupported_cc or cc < spec.min_cc:
        other = f"{field('backend')} {'tensorrt' if name != 'tensorrt' else 'tensorrt-rtx'}"
        return (f"{name} cannot run on this GPU (compute capability {cc[0]}.{cc[1]}); "
                f"use {other} or {field('backend')} torch")
    return None


def version(name: str) -> str:
    return import_flavour(name).__version__


class TensorRTAPI:
    """An imported flavour with its version differences resolved once, by feature."""

    def __init__(self, name: str):
        self.name = name
        self.trt = import_flavour(name)
        self.version = self.trt.__version__
        trt = self.trt
        self.strongly_typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
        self.user_managed_memory = hasattr(trt, "ExecutionContextAllocationStrategy")
        self.progress_monitor = hasattr(trt, "IProgressMonitor")
        self.compute_capability_targets = hasattr(trt, "ComputeCapability")
        # bf16 engines come from strongly typed networks of bf16 ONNX (10.0+); 8.6 has no bf16 at all
        self.bfloat16 = self.strongly_typed and hasattr(trt.DataType, "BF16")

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"

    def logger(self):
        return self.trt.Logger(self.trt.Logger.WARNING)

    # ---- building ----------------------------------------------------------------------------
    def create_network(self, builder):
        flags = self.trt.NetworkDefinitionCreationFlag
        if self.strongly_typed:
            return builder.create_network(1 << int(flags.STRONGLY_TYPED))
        return builder.create_network(1 << int(flags.EXPLICIT_BATCH))

    def set_precision(self, config, half: bool, int8: bool = False) -> None:
        """Without strong typing the builder runs fp32 unless told fp16 is allowed, and runs Q/DQ layers in int8
        only when told int8 is."""
        if self.strongly_typed:
            return
        if half:
            config.set_flag(self.trt.BuilderFlag.FP16)
        if int8:
            config.set_flag(self.trt.BuilderFlag.INT8)

    def check_tactic_sources(self, names: tuple[str, ...]) -> None:
        """A UsageError naming the tactic sources this TensorRT does not have (checked before any export)."""
        sources = self.trt.TacticSource
        unknown = [n for n in names if not hasattr(sources, n)]
        if unknown:
            known = ", ".join(n for n in dir(sources) if n.isupper())
            raise UsageError(f"{self.label} has no tactic source {', '.join(unknown)} (it has: {known})")

    def set_tactic_sources(self, config, enabled: tuple[str, ...], disabled: tuple[str, ...]) -> None:
        """The builder's tactic sources: its defaults, with `enabled` added and `disabled` taken out."""
        self.check_tactic_sources((*enabled, *disabled))
        sources = self.trt.TacticSource
        mask = config.get_tactic_sources()
        for name in enabled:
            mask |= 1 << int(getattr(sources, name))
        for name in disabled:
            mask &= ~(1 << int(getattr(sources, name)))
        config.set_tactic_sources(mask)

    # ---- running -----------------------------------------------------------------------------
    def create_context(self, engine):
        """An execution context that uses device memory we hand it (shared between engines)."""
        if self.user_managed_memory:
            return engine.create_execution_context(self.trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        return engine.create_execution_context_without_device_memory()

    def device_memory_size(self, engine) -> int:
        if self.user_managed_memory:
            return engine.device_memory_size_v2
        return engine.device_memory_size

    def set_device_memory(self, context, pointer: int, size: int) -> None:
        if self.user_managed_memory:
            context.set_device_memory(pointer, size)
        else:
            context.device_memory = pointer
