"""TensorRT engines: profiles, build options, the engine cache, and building from optimized ONNX.

Everything here runs without a GPU (TensorRT for RTX builds on a CPU); running engines is
demo/engine_runtime.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch

from core import interrupts
from core.artifacts import artifact_bytes, cached_build, read_manifest
from core.atomic import atomic_write_bytes
from core.errors import RunFailure, UsageError, field
from demo.backends.tensorrt.flavour import TensorRTAPI, current_cc
from models.base import Range, StageModel
from models.quantize import INT8_INFIX, Int8Request
from models.source import VAE_PRECISIONS, ModelSource
from models.stages import stage_batch
from plugins.contract import OURS
from plugins.trt_plugins import load_plugin_library

DEFAULT_MAX_BATCH = 4
# What TensorRT for RTX builds for on a machine with no GPU when no target compute capability is given:
# A100 (8.0), A10 / RTX 30 (8.6), L40 / RTX 40 (8.9).
CPU_DEFAULT_TARGETS = ((8, 0), (8, 6), (8, 9))
# Bump when build settings change what an engine contains.
ENGINE_FORMAT_VERSION = 2
# How often a build that reports no progress of its own (TensorRT 8.6) says it is still working.
HEARTBEAT_S = 30.0
# Beside a refittable engine: the files (names, sizes, SHA-256) of the optimized ONNX it was built from (built_from).
BUILT_FROM_SUFFIX = ".onnx.json"


class EngineBuildError(RunFailure):
    """ONNX that TensorRT cannot parse or build; the message names the stage, node and cause."""

    heading = "engine build failed"


@dataclass(frozen=True)
class ImageProfile:
    """Batch and image-size ranges (min, opt, max) an engine accepts; batch counts images."""

    batch: Range
    height: Range
    width: Range

    @classmethod
    def for_request(cls, source: ModelSource, batch_size: int, height: int, width: int,
                    static_batch: bool, dynamic_shape: bool, max_batch: int = 1) -> "ImageProfile":
        """Engines tuned for `batch_size` (the profile's optimum) that take 1 to at least `max_batch` and
        DEFAULT_MAX_BATCH, or exactly `batch_size` with `static_batch`."""
        batch = (batch_size,) * 3 if static_batch else (1, batch_size, max(batch_size, max_batch, DEFAULT_MAX_BATCH))
        if dynamic_shape:
            low, high = source.image_size_range
            return cls(batch, (low, height, high), (low, width, high))
        return cls(batch, (height,) * 3, (width,) * 3)

    def stage_shapes(self, model: StageModel, guided: bool) -> dict[str, tuple[tuple[int, ...], ...]]:
        return model.shape_profile(tuple(stage_batch(model.name, b, guided) for b in self.batch),
                                   self.height, self.width)

    @property
    def static(self) -> bool:
        return len({*self.batch}) == len({*self.height}) == len({*self.width}) == 1


@dataclass(frozen=True)
class BuildOptions:
    flavour: str
    optimization_level: int = 3
    timing_cache: Path | None = None
    target_ccs: tuple[tuple[int, int], ...] = ()  # empty: the GPU of this machine
    # TacticSource names the builder must not use, e.g. CUDNN where cuDNN is absent or a stub; and those it may use
    # besides its defaults, e.g. CUBLAS_LT, whose GEMMs TensorRT 8.6 otherwise does not time.
    disabled_tactic_sources: tuple[str, ...] = ()
    enabled_tactic_sources: tuple[str, ...] = ()
    refit: bool = False  # weights refittable in place (BuilderFlag.REFIT): LoRA without rebuilds (refit.py)

    def resolved_targets(self) -> tuple[tuple[int, int], ...]:
        """Named targets, else this machine's GPU, else (TensorRT for RTX on a CPU) CPU_DEFAULT_TARGETS."""
        if self.target_ccs:
            return self.target_ccs
        cc = current_cc()
        if cc is not None:
            return (cc,)
        if self.flavour == "tensorrt-rtx":
            return CPU_DEFAULT_TARGETS
        raise UsageError(f"{self.flavour} builds for the GPU it runs on, and there is none here; "
                         f"use {field('backend')} tensorrt-rtx with {field('target_cc')} to build on a CPU")


def parse_target_ccs(text: str | None) -> tuple[tuple[int, int], ...]:
    if not text:
        return ()
    try:
        ccs = tuple(tuple(int(part) for part in item.strip().split(".")) for item in text.split(",") if item.strip())
    except ValueError:
        raise UsageError(f"{field('target_cc')} takes compute capabilities like 8.0,8.6,8.9; got '{text}'") from None
    if not ccs or any(len(cc) != 2 for cc in ccs):
        raise UsageError(f"{field('target_cc')} takes compute capabilities like 8.0,8.6,8.9; got '{text}'")
    return ccs


def engine_key(model: StageModel, onnx_key: dict, shapes: dict, options: BuildOptions, api: TensorRTAPI) -> dict:
    """What makes an engine: the ONNX it comes from (by what made that, so a cached engine is found
    without exporting again), the profile, TensorRT and the build settings. The torch version that
    exported the ONNX is left out: engines built where another torch exported serve just as well."""
    return {
        "stage": model.name,
        "onnx": {k: v for k, v in onnx_key.items() if k != "torch"},
        "shapes": {name: [list(s) for s in rng] for name, rng in shapes.items()},
        "flavour": options.flavour,
        "flavour_version": api.version,
        "target_cc": [f"{a}.{b}" for a, b in options.resolved_targets()],
        "optimization_level": options.optimization_level,
        "disabled_tactic_sources": list(options.disabled_tactic_sources),
        # Only where some are: the engines cached before this setting existed keep their keys.
        **({"enabled_tactic_sources": list(options.enabled_tactic_sources)} if options.enabled_tactic_sources else {}),
        "refit": options.refit,
        "format_version": ENGINE_FORMAT_VERSION,
    }


def reusable_key(artifact: Path, key: dict, options: BuildOptions) -> dict:
    """The key of an engine already built for several GPUs, this one among them (TensorRT for RTX
    builds on a CPU for 8.0, 8.6 and 8.9), when it matches in everything else; else `key`."""
    if options.target_ccs or options.flavour != "tensorrt-rtx":
        return key
    manifest = read_manifest(artifact)  # None, or a manifest whose key is a dict
    if manifest is None:
        return key
    recorded = manifest["key"]
    targets = recorded.get("target_cc")
    if isinstance(targets, list) and {**recorded, "target_cc": key["target_cc"]} == key \
            and set(key["target_cc"]) <= set(targets):
        return recorded
    return key


class BuildProgress:
    """Says what a build is doing, with elapsed times, whatever TensorRT reports itself.

    TensorRT 10+ reports its phases through a progress monitor; 8.6 builds silently for minutes, so a
    heartbeat line every HEARTBEAT_S keeps a long first build from looking hung.
    """

    def __init__(self, api: TensorRTAPI, stage: str, progress: Callable[[str], None], heartbeat_s: float = HEARTBEAT_S):
        self.api, self.stage, self.progress, self.heartbeat_s = api, stage, progress, heartbeat_s
        self.start = time.perf_counter()
        self._done = threading.Event()

    def elapsed(self) -> str:
        return f"{time.perf_counter() - self.start:.0f} s"

    def __enter__(self):
        self.progress(f"[build] {self.stage}: building the engine with {self.api.label} ...")
        threading.Thread(target=self._beat, daemon=True).start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(self.heartbeat_s):
            self.progress(f"[build] {self.stage}: still building ({self.elapsed()})")

    def __exit__(self, *exc):
        self._done.set()
        if exc[0] is None:
            self.progress(f"[build] {self.stage}: engine built in {self.elapsed()}")

    def monitor(self):
        """A TensorRT progress monitor reporting top-level phases and any phase longer than 5 s."""
        trt, progress, stage = self.api.trt, self.progress, self.stage

        class Monitor(trt.IProgressMonitor):
            def __init__(self):
                trt.IProgressMonitor.__init__(self)
                self.started: dict[str, float] = {}

            def phase_start(self, phase_name, parent_phase, num_steps):
                self.started[phase_name] = time.perf_counter()
                if parent_phase is None:
                    progress(f"[build] {stage}: {phase_name} ...")

            def step_complete(self, phase_name, step):
                return interrupts.received() is None  # False cancels the build

            def phase_finish(self, phase_name):
                elapsed = time.perf_counter() - self.started.pop(phase_name, time.perf_counter())
                if elapsed > 5:
                    progress(f"[build] {stage}: {phase_name} done in {elapsed:.0f} s")

        return Monitor()


def register_plugins(api: TensorRTAPI, convention: str) -> None:
    """Put the creators of a plugin convention into TensorRT's registry: our library, or TensorRT's own."""
    if convention == OURS:
        load_plugin_library(api.trt)
    elif not api.trt.init_libnvinfer_plugins(api.logger(), ""):
        raise UsageError(f"{api.label} could not register its own plugins (libnvinfer_plugin)")


def build_targets(options: BuildOptions, api: TensorRTAPI) -> list:
    """The flavour's compute-capability targets for these options (empty where TensorRT builds only for
    the GPU it runs on), or a UsageError for a target it cannot build for. Checked before any export."""
    if not api.compute_capability_targets:
        if options.target_ccs and options.target_ccs != (current_cc(),):
            raise UsageError(f"{options.flavour} builds for the GPU it runs on; {field('target_cc')} is for "
                             f"{field('backend')} tensorrt-rtx")
        return []
    targets = []
    for major, minor in options.resolved_targets():
        cc = getattr(api.trt.ComputeCapability, f"SM{major}{minor}", None)
        if cc is None:
            raise UsageError(f"{options.flavour} cannot target compute capability {major}.{minor}")
        targets.append(cc)
    return targets


def build_engine_file(path: Path, onnx_path: Path, model: StageModel, shapes: dict, options: BuildOptions,
                      progress: Callable[[str], None], plugin_convention: str | None = None,
                      int8: bool = False) -> None:
    """Parse `onnx_path` and write the serialized engine to `path`.

    fp16 I/O means an fp16 engine: strongly typed where TensorRT has it, else with the FP16 flag; `int8` (Q/DQ in
    the ONNX, models.quantize) adds the INT8 flag there.
    `plugin_convention`: the ONNX holds plugin nodes of that convention, whose creators must be in
    TensorRT's registry before parsing (the parser maps those nodes to them). A refittable engine (options.refit)
    records beside it which ONNX it was built from (built_from); its weights keep the ONNX initializers' names."""
    api = TensorRTAPI(options.flavour)
    trt = api.trt
    if plugin_convention:
        register_plugins(api, plugin_convention)
    logger = api.logger()
    builder = trt.Builder(logger)
    network = api.create_network(builder)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        where = "; ".join(f"node '{e.node_name()}' ({e.node_operator()}): {e.desc().splitlines()[0]}"
                          for e in errors[:3])
        raise EngineBuildError(f"{model.name}: ONNX parse of {onnx_path} failed at {where}")
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]
    if [t.name for t in inputs] != list(model.input_names) or [t.name for t in outputs] != list(model.output_names):
        raise EngineBuildError(f"{model.name}: ONNX I/O {[t.name for t in inputs]} -> {[t.name for t in outputs]} does "
                               f"not match the model class {list(model.input_names)} -> {list(model.output_names)}")

    config = builder.create_builder_config()
    config.builder_optimization_level = options.optimization_level
    api.set_precision(config, half=any(t.dtype == trt.float16 for t in inputs + outputs), int8=int8)
    api.set_tactic_sources(config, options.enabled_tactic_sources, options.disabled_tactic_sources)
    if options.refit:
        config.set_flag(trt.BuilderFlag.REFIT)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # layer types for the engine inspector
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in shapes.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    targets = build_targets(options, api)
    if targets:
        config.num_compute_capabilities = len(targets)
        for index, cc in enumerate(targets):
            config.set_compute_capability(cc, index)
    cache = None
    if options.timing_cache is not None:
        blob = options.timing_cache.read_bytes() if options.timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        if not config.set_timing_cache(cache, ignore_mismatch=False):  # made on another GPU or TensorRT version
            progress(f"[build] {model.name}: timing cache {options.timing_cache} is from another GPU or TensorRT "
                     "version: not used, and left as it is")
            cache = None

    with BuildProgress(api, model.name, progress) as build:
        if api.progress_monitor:
            config.progress_monitor = build.monitor()
        serialized = builder.build_serialized_network(network, config)
    if interrupts.received() is not None:  # the build saw the signal as a failure of its monitor
        raise interrupts.Interrupted(interrupts.received())
    if serialized is None:
        raise EngineBuildError(f"{model.name}: TensorRT could not build the engine (see its log above)")
    path.write_bytes(serialized)
    if options.refit:  # its refits read base weights from this very ONNX (refit.py)
        manifest = read_manifest(onnx_path)
        if manifest is None:
            raise EngineBuildError(f"{model.name}: {onnx_path} is no cached artifact, which a refittable engine needs")
        built_from_path(path).write_text(json.dumps(manifest["files"]))
    if cache is not None:
        atomic_write_bytes(options.timing_cache, bytes(cache.serialize()))


def built_from_path(engine: Path) -> Path:
    return engine.with_name(engine.name + BUILT_FROM_SUFFIX)


def built_from(engine: Path) -> dict:
    """The files of the optimized ONNX a refittable engine was built from, as its manifest lists them."""
    return json.loads(built_from_path(engine).read_text())


def prepare_engine(model: StageModel, onnx_key: dict, make_onnx: Callable[[], ContextManager[Path]], engine_dir: Path,
                   shapes: dict, options: BuildOptions, force: bool = False, log: Callable[[str], None] = print,
                   progress: Callable[[str], None] = print, build_missing: bool = True) -> Path:
    """The engine for `model` through the cache: reused when its key and content check out; otherwise
    `make_onnx()` provides the optimized ONNX (exporting only then), locked while the engine is built from it
    (or, with build_missing False, an ArtifactError says why there is none to reuse)."""
    api = TensorRTAPI(options.flavour)
    int8 = "int8" in onnx_key
    # beside the fp16 one, as its ONNX is
    artifact = engine_dir / f"{model.artifact_name}{INT8_INFIX if int8 else ''}.engine"
    key = reusable_key(artifact, engine_key(model, onnx_key, shapes, options, api), options)

    def build(path: Path) -> None:
        with make_onnx() as onnx_path:
            convention = onnx_key["plugin_convention"] if onnx_key["plugins"] else None
            build_engine_file(path, onnx_path, model, shapes, options, progress, convention, int8)

    return cached_build(artifact, key, build, force, log, verify_content=True, build_missing=build_missing,
                        progress=progress)


@dataclass
class EngineSettings:
    """What a stage's engine is built from and for, and how it runs (from EngineOptions, for a workload:
    demo.backends.tensorrt.options.engine_settings)."""

    onnx_dir: Path
    engine_dir: Path
    profile: ImageProfile
    options: BuildOptions
    guided: bool = True
    use_cuda_graph: bool = False
    force_onnx_export: bool = False
    force_onnx_optimize: bool = False
    force_engine_build: bool = False
    plugins: tuple[str, ...] = ()  # models.plugin_set keys whose passes put plugins into the graphs
    plugin_convention: str = OURS  # ours, or TensorRT's own plugins (plugins.contract.CONVENTIONS)
    int8: Int8Request | None = None  # the engines of stages that take int8 are quantized (models.quantize)
    # False: a missing or stale engine is an error, not a build (runs of engines built elsewhere, e.g.
    # by the ablation's build jobs, must not quietly spend minutes building on the GPU they time).
    build_missing: bool = True
    bfloat16: bool = False  # the flavour builds bf16 engines (TensorRTAPI.bfloat16): the families' bf16 stages take it
    stats: dict = dataclasses.field(default_factory=dict)


def engine_dtype(model: StageModel, settings: EngineSettings, dtype: torch.dtype) -> torch.dtype:
    """What the engine of `model` is built and runs in, for a pipeline in `dtype`: the stage's own precision, except
    where an fp16 pipeline's stage is one its family builds in bf16 (Family.bf16_engines): bf16 where the flavour
    builds it, else the family's fallback for it (T5's fp32). The pipeline hands it its inputs in its own precision,
    converted as the engine's buffers take them (Engine.run), and casts what it reads back."""
    stage_dtype = model.stage_dtype(dtype)
    fallback = model.source.family.bf16_engines.get(model.name)
    if stage_dtype != torch.float16 or fallback is None:
        return stage_dtype
    return torch.bfloat16 if settings.bfloat16 else getattr(torch, VAE_PRECISIONS[fallback])


def stage_plugins(settings: EngineSettings, stage_dtype: torch.dtype) -> tuple[str, ...]:
    """The plugins in the engine of a stage that runs in `stage_dtype`: our plugins' kernels take fp16 only
    (plugins/trt/plugin_adapter.h), so a stage that runs in fp32 (SDXL's VAE where its config says force_upcast) is
    built from TensorRT's own layers."""
    return settings.plugins if stage_dtype == torch.float16 else ()


def stage_int8(settings: EngineSettings, model: StageModel) -> Int8Request | None:
    """The INT8 request for the engine of `model`: the settings' where the stage takes int8, else None."""
    return settings.int8 if model.takes_int8 else None


def stage_onnx(model: StageModel, settings: EngineSettings, device: str | torch.device, dtype: torch.dtype,
               log: Callable[[str], None] = print) -> ContextManager[Path]:
    """The optimized ONNX the engine of `model` is built from, for a pipeline in `dtype`, through the artifact cache
    (made where missing or stale, or forced by the settings), locked until the block ends."""
    stage_dtype = engine_dtype(model, settings, dtype)
    return model.optimized_onnx(settings.onnx_dir, device, stage_dtype, settings.force_onnx_export,
                                settings.force_onnx_optimize, log, stage_plugins(settings, stage_dtype),
                                settings.plugin_convention, stage_int8(settings, model))


SettingsOf = Callable[[StageModel], EngineSettings]


def settings_for(settings: EngineSettings | SettingsOf) -> SettingsOf:
    """Each model's engine settings: one set for every stage, or a function of the model."""
    return settings if callable(settings) else (lambda _: settings)


def prepare_stage_engines(models: list[StageModel], settings: EngineSettings | SettingsOf,
                          device: str | torch.device, dtype: torch.dtype, log: Callable[[str], None] = print,
                          progress: Callable[[str], None] = print) -> dict[str, Path]:
    """The engine of each model, with its settings (`settings`, or `settings(model)`), exporting and optimizing ONNX
    only where an engine must be built.

    Records per stage in its settings' stats: ONNX size and time (None when the cached engine needed
    none), engine build time and size. `progress` gets what a long first run is doing, `log` the rest.
    """
    settings_of = settings_for(settings)
    engines = {}
    for model in models:
        settings = settings_of(model)
        stat: dict = {"onnx_bytes": None, "onnx_s": None}

        model_dtype = engine_dtype(model, settings, dtype)
        plugins = stage_plugins(settings, model_dtype)
        if plugins != settings.plugins:
            progress(f"[plugins] {model.name}: none (it runs in {str(model_dtype).removeprefix('torch.')}, our "
                     "TensorRT plugins in float16)")

        @contextlib.contextmanager
        def make_onnx(model=model, stat=stat, settings=settings, model_dtype=model_dtype) -> Iterator[Path]:
            start = time.perf_counter()
            progress(f"[build] {model.name}: exporting and optimizing ONNX ({model_dtype}) ...")
            with stage_onnx(model, settings, device, dtype, log) as path:
                stat.update(onnx_bytes=artifact_bytes(path), onnx_s=time.perf_counter() - start)
                yield path

        start = time.perf_counter()
        shapes = settings.profile.stage_shapes(model, settings.guided)
        onnx_key = model.optimized_onnx_key(model_dtype, plugins, settings.plugin_convention,
                                            stage_int8(settings, model))
        engines[model.name] = prepare_engine(model, onnx_key, make_onnx, settings.engine_dir, shapes, settings.options,
                                             settings.force_engine_build, log, progress, settings.build_missing)
        stat["engine_s"] = time.perf_counter() - start - (stat["onnx_s"] or 0.0)
        stat["engine_bytes"] = engines[model.name].stat().st_size
        settings.stats[model.name] = stat
    return engines
