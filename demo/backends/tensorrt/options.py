"""The TensorRT backends' own options: how ONNX and engines are made and found, and what goes into them (a pipeline
spec's `engine`). Light to import: a command parses its flags into them before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UsageError, at_least, field
from core.typed import check_field_types
from plugins.contract import OURS

MAX_OPTIMIZATION_LEVEL = 5


@dataclass(frozen=True)
class EngineOptions:
    """How ONNX and engines are made and found (a pipeline spec's `engine`). Engines are cached in `engine_dir` keyed
    by everything that made them (demo.backends.tensorrt.build.engine_key)."""

    onnx_dir: str = "onnx"
    engine_dir: str = "engine"
    force_onnx_export: bool = False
    force_onnx_optimize: bool = False
    force_engine_build: bool = False
    build_static_batch: bool = False  # engines for exactly the workload's batch
    build_dynamic_shape: bool = False  # engines for any height and width in the model's range
    build_enable_refit: bool = False  # refittable engines: LoRA files refit them in place
    optimization_level: int = 3  # TensorRT's builder optimization level, 0..MAX_OPTIMIZATION_LEVEL
    timing_cache: str | None = None  # a file builds read and update
    plugin_convention: str = OURS  # whose plugin nodes the passes emit (plugins.contract.CONVENTIONS)
    int8: bool = False  # an INT8 UNet engine, calibrated on the pipeline's own activations
    calibration_prompts: str | None = None  # a file of prompts to calibrate on, one a line (None: a built-in set)
    calibration_steps: int = 30
    disable_tactic_sources: str | None = None  # comma-separated TacticSource names, e.g. CUDNN
    enable_tactic_sources: str | None = None
    target_cc: str | None = None  # TensorRT for RTX: compute capabilities to build for, e.g. 8.0,8.6,8.9
    # False: a missing or stale engine is an error, not a build (runs of engines built elsewhere, e.g. by the
    # ablation's build jobs, must not quietly spend minutes building on the GPU they time).
    build_missing: bool = True

    def __post_init__(self):
        check_field_types(self, paths=("onnx_dir", "engine_dir", "timing_cache", "calibration_prompts"))

    def check(self, use_cuda_graph: bool | None = None) -> None:
        """The options' own values, and how they go with `use_cuda_graph` (a spec's): a UsageError naming the field,
        before anything is resolved or loaded."""
        if not 0 <= self.optimization_level <= MAX_OPTIMIZATION_LEVEL:
            raise UsageError(f"{field('optimization_level')} must be 0..{MAX_OPTIMIZATION_LEVEL}, got "
                             f"{self.optimization_level}")
        if use_cuda_graph and self.build_dynamic_shape:
            raise UsageError(f"{field('use_cuda_graph')} needs static shapes: drop {field('build_dynamic_shape')}")
        if self.int8 and self.build_enable_refit:
            raise UsageError(f"{field('int8')} engines cannot be refitted (their weights are smoothed and quantized): "
                             f"drop {field('build_enable_refit')} (and {field('loras')})")
        if self.calibration_prompts and not self.int8:
            raise UsageError(f"{field('calibration_prompts')} is for {field('int8')}")
        if self.int8:
            at_least("calibration_steps", self.calibration_steps, 1)
        both = sorted(set(parse_tactic_sources(self.enable_tactic_sources))
                      & set(parse_tactic_sources(self.disable_tactic_sources)))
        if both:
            raise UsageError(f"tactic source {', '.join(both)} both enabled and disabled: give it to one of "
                             f"{field('enable_tactic_sources')} and {field('disable_tactic_sources')}")


def parse_tactic_sources(text: str | None) -> tuple[str, ...]:
    """A disable_tactic_sources or enable_tactic_sources value (comma-separated TacticSource names) as sorted
    upper-case names."""
    return tuple(sorted({item.strip().upper() for item in (text or "").split(",") if item.strip()}))
