"""TensorRT engines: build from optimized ONNX, cache, load, and run behind the stage interface.

Host-side logic (profiles, cache keys, buffer shapes, binding order, profile checks) lives in plain
classes that need no GPU; `TensorRTEngine` is the part that needs one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from core.artifacts import artifact_bytes, cached_build, content_hash
from core.atomic import atomic_write_bytes
from core.errors import UsageError
from demo.stages import Stage
from demo.trt_flavour import current_cc, import_flavour, version
from models import stage_batch
from models.base import Range, StageModel
from models.source import ModelSource

DEFAULT_MAX_BATCH = 4
# What TensorRT for RTX builds for on a machine with no GPU when no --target-cc is given:
# A100 (8.0), A10 / RTX 30 (8.6), L40 / RTX 40 (8.9).
CPU_DEFAULT_TARGETS = ((8, 0), (8, 6), (8, 9))
# Bump when build settings change what an engine contains.
ENGINE_FORMAT_VERSION = 1

class EngineBuildError(RuntimeError):
    """ONNX that TensorRT cannot parse or build; the message names the stage, node and cause."""


_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
                 "INT64": torch.int64, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


@dataclass(frozen=True)
class ImageProfile:
    """Batch and image-size ranges (min, opt, max) an engine accepts; batch counts images."""

    batch: Range
    height: Range
    width: Range

    @classmethod
    def for_request(cls, source: ModelSource, batch_size: int, height: int, width: int,
                    static_batch: bool, dynamic_shape: bool) -> "ImageProfile":
        batch = (batch_size,) * 3 if static_batch else (1, batch_size, max(batch_size, DEFAULT_MAX_BATCH))
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
                         "use --backend tensorrt-rtx with --target-cc to build on a CPU")


def parse_target_ccs(text: str | None) -> tuple[tuple[int, int], ...]:
    if not text:
        return ()
    try:
        ccs = tuple(tuple(int(part) for part in item.strip().split(".")) for item in text.split(",") if item.strip())
    except ValueError:
        raise UsageError(f"--target-cc takes compute capabilities like 8.0,8.6,8.9; got '{text}'") from None
    if not ccs or any(len(cc) != 2 for cc in ccs):
        raise UsageError(f"--target-cc takes compute capabilities like 8.0,8.6,8.9; got '{text}'")
    return ccs


@dataclass
class EngineIO:
    """What an engine binds, in binding order (inputs in the model's order, then outputs)."""

    stage: str
    inputs: dict[str, dict]  # name -> {"dtype": "HALF", "profile": [min, opt, max]}
    outputs: dict[str, dict]  # name -> {"dtype": ...}

    @property
    def binding_order(self) -> list[str]:
        return [*self.inputs, *self.outputs]

    def torch_dtype(self, name: str) -> torch.dtype:
        meta = self.inputs.get(name) or self.outputs[name]
        return _TORCH_DTYPES[meta["dtype"]]

    def check_input_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Raise a UsageError naming the limits when a shape is outside the engine's profile."""
        for name, meta in self.inputs.items():
            shape = tuple(shapes[name])
            low, _, high = (tuple(s) for s in meta["profile"])
            if len(shape) != len(low) or any(not lo <= s <= hi for s, lo, hi in zip(shape, low, high)):
                raise UsageError(
                    f"{self.stage} engine input '{name}' shape {list(shape)} is outside the engine's profile "
                    f"(min {list(low)}, max {list(high)}); rebuild with matching --batch-size/--height/--width, "
                    "or with --build-dynamic-shape"
                )

    def buffer_specs(self, model: StageModel, batch: int, height: int, width: int) -> list[tuple[str, tuple, torch.dtype]]:
        """(name, shape, dtype) of every binding for one call, in binding order."""
        shapes = {**model.input_shapes(batch, height, width), **model.output_shapes(batch, height, width)}
        self.check_input_shapes(shapes)
        return [(name, tuple(shapes[name]), self.torch_dtype(name)) for name in self.binding_order]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: Path) -> "EngineIO":
        return cls(**json.loads(path.read_text()))


def io_path(engine_path: Path) -> Path:
    return engine_path.with_name(engine_path.name + ".io.json")


def engine_key(model: StageModel, onnx_path: Path, shapes: dict, options: BuildOptions) -> dict:
    return {
        "stage": model.name,
        "onnx": content_hash(onnx_path),
        "shapes": {name: [list(s) for s in rng] for name, rng in shapes.items()},
        "flavour": options.flavour,
        "flavour_version": version(options.flavour),
        "target_cc": [f"{a}.{b}" for a, b in options.resolved_targets()],
        "optimization_level": options.optimization_level,
        "format_version": ENGINE_FORMAT_VERSION,
    }


def progress_monitor(trt, stage: str, log: Callable[[str], None]):
    """A TensorRT progress monitor that logs top-level phases and any phase longer than 5 s."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.started: dict[str, float] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.started[phase_name] = time.perf_counter()
            if parent_phase is None:
                log(f"[build] {stage}: {phase_name} ...")

        def step_complete(self, phase_name, step):
            return True  # keep building

        def phase_finish(self, phase_name):
            elapsed = time.perf_counter() - self.started.pop(phase_name, time.perf_counter())
            if elapsed > 5:
                log(f"[build] {stage}: {phase_name} done in {elapsed:.0f} s")

    return Monitor()


def build_engine_file(path: Path, onnx_path: Path, model: StageModel, shapes: dict, options: BuildOptions,
                      log: Callable[[str], None]) -> None:
    """Parse `onnx_path` as a strongly typed network and write the serialized engine and its I/O to `path`."""
    trt = import_flavour(options.flavour)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        where = "; ".join(f"node '{e.node_name()}' ({e.node_operator()}): {e.desc().splitlines()[0]}"
                          for e in errors[:3])
        raise EngineBuildError(f"{model.name}: ONNX parse of {onnx_path} failed at {where}")
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]
    if [t.name for t in inputs] != list(model.input_names) or [t.name for t in outputs] != list(model.output_names):
        raise EngineBuildError(f"{model.name}: ONNX I/O {[t.name for t in inputs]} -> {[t.name for t in outputs]} "
                           f"does not match the model class {list(model.input_names)} -> {list(model.output_names)}")

    config = builder.create_builder_config()
    config.builder_optimization_level = options.optimization_level
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in shapes.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    if options.flavour == "tensorrt" and options.target_ccs and options.target_ccs != (current_cc(),):
        raise UsageError("tensorrt builds for the GPU it runs on; --target-cc is for --backend tensorrt-rtx")
    if options.flavour == "tensorrt-rtx":
        targets = options.resolved_targets()
        config.num_compute_capabilities = len(targets)
        for index, (major, minor) in enumerate(targets):
            cc = getattr(trt.ComputeCapability, f"SM{major}{minor}", None)
            if cc is None:
                raise UsageError(f"tensorrt-rtx cannot target compute capability {major}.{minor}")
            config.set_compute_capability(cc, index)
    cache = None
    if options.timing_cache is not None:
        blob = options.timing_cache.read_bytes() if options.timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)
    config.progress_monitor = progress_monitor(trt, model.name, log)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"{model.name}: TensorRT could not build the engine (see its log above)")
    path.write_bytes(serialized)
    if cache is not None:
        atomic_write_bytes(options.timing_cache, bytes(cache.serialize()))
    io = EngineIO(
        model.name,
        {t.name: {"dtype": t.dtype.name, "profile": [list(s) for s in shapes[t.name]]} for t in inputs},
        {t.name: {"dtype": t.dtype.name} for t in outputs},
    )
    io_path(path).write_text(io.to_json())


def prepare_engine(model: StageModel, onnx_path: Path, engine_dir: Path, shapes: dict, options: BuildOptions,
                   force: bool = False, log: Callable[[str], None] = print) -> Path:
    """The engine for `model` through the cache: reused when its key and content check out."""
    key = engine_key(model, onnx_path, shapes, options)
    return cached_build(
        engine_dir / f"{model.name}.engine", key,
        lambda p: build_engine_file(p, onnx_path, model, shapes, options, log),
        force, log, verify_content=True,
    )


# ---- runtime (needs a GPU the flavour supports) -----------------------------------------------------

def _check_cuda(result) -> object:
    error, *rest = result
    if int(error) != 0:
        raise RuntimeError(f"CUDA error {error}")
    return rest[0] if len(rest) == 1 else (rest or None)


class StreamExecutor:
    """Runs `enqueue(stream)` on its own cuda-python stream, ordered after everything already queued
    on torch's current stream and before anything queued there afterwards. With `use_cuda_graph`,
    the second call captures the enqueued work in a CUDA graph and every later call replays it."""

    def __init__(self, enqueue: Callable[[int], None], use_cuda_graph: bool):
        from cuda.bindings import runtime as cudart

        self.cudart = cudart
        self.enqueue = enqueue
        self.use_cuda_graph = use_cuda_graph
        self.stream = _check_cuda(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))
        flags = cudart.cudaEventDisableTiming
        self.inputs_ready = _check_cuda(cudart.cudaEventCreateWithFlags(flags))
        self.outputs_ready = _check_cuda(cudart.cudaEventCreateWithFlags(flags))
        self.calls = 0
        self.graph = None

    @property
    def handle(self) -> int:
        return int(self.stream)

    def __call__(self) -> None:
        cudart = self.cudart
        torch_stream = torch.cuda.current_stream().cuda_stream
        _check_cuda(cudart.cudaEventRecord(self.inputs_ready, torch_stream))
        _check_cuda(cudart.cudaStreamWaitEvent(self.stream, self.inputs_ready, 0))
        if self.graph is not None:
            _check_cuda(cudart.cudaGraphLaunch(self.graph, self.stream))
        elif self.use_cuda_graph and self.calls > 0:  # the first call may allocate; capture the second
            mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
            _check_cuda(cudart.cudaStreamBeginCapture(self.stream, mode))
            self.enqueue(self.handle)
            graph = _check_cuda(cudart.cudaStreamEndCapture(self.stream))
            self.graph = _check_cuda(cudart.cudaGraphInstantiate(graph, 0))
            _check_cuda(cudart.cudaGraphLaunch(self.graph, self.stream))
        else:
            self.enqueue(self.handle)
        self.calls += 1
        _check_cuda(cudart.cudaEventRecord(self.outputs_ready, self.stream))
        _check_cuda(cudart.cudaStreamWaitEvent(torch_stream, self.outputs_ready, 0))

    def reset_graph(self) -> None:
        """Buffers moved: the captured addresses are stale."""
        self.graph, self.calls = None, 0


class TensorRTEngine:
    """A deserialized engine with its execution context and torch-allocated I/O buffers."""

    def __init__(self, flavour: str, path: Path, use_cuda_graph: bool):
        trt = import_flavour(flavour)
        self.io = EngineIO.load(io_path(path))
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{path}: TensorRT could not deserialize the engine (see its log above)")
        self.context = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        self.buffers: dict[str, torch.Tensor] = {}
        self.executor = StreamExecutor(self._enqueue, use_cuda_graph)

    @property
    def device_memory_size(self) -> int:
        return self.engine.device_memory_size_v2

    def use_device_memory(self, block: torch.Tensor) -> None:
        """Share one scratch block among engines that never run at the same time."""
        self.context.set_device_memory(block.data_ptr(), block.numel())

    def allocate(self, specs: list[tuple[str, tuple, torch.dtype]]) -> None:
        self.buffers = {}
        for name, shape, dtype in specs:
            self.buffers[name] = torch.empty(shape, dtype=dtype, device="cuda")
            if name in self.io.inputs:
                self.context.set_input_shape(name, shape)
            self.context.set_tensor_address(name, self.buffers[name].data_ptr())
        self.executor.reset_graph()

    def _enqueue(self, stream: int) -> None:
        if not self.context.execute_async_v3(stream):
            raise RuntimeError(f"{self.io.stage}: TensorRT execution failed")

    def run(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in self.io.inputs:
            self.buffers[name].copy_(feed[name])
        self.executor()
        return {name: self.buffers[name] for name in self.io.outputs}


class TensorRTStage(Stage):
    """A stage backed by an engine. Outputs stay valid until this stage runs again."""

    def __init__(self, model: StageModel, engine: TensorRTEngine):
        super().__init__(model)
        self.engine = engine
        self._specs: list | None = None

    def prepare(self, batch, height, width):
        specs = self.engine.io.buffer_specs(self.model, batch, height, width)
        if specs != self._specs:
            self.engine.allocate(specs)
            self._specs = specs

    def __call__(self, feed):
        return self.engine.run(feed)


@dataclass
class EngineSettings:
    """Everything the CLI and scripts/build_engines.py say about ONNX and engines."""

    onnx_dir: Path
    engine_dir: Path
    profile: ImageProfile
    options: BuildOptions
    guided: bool = True
    use_cuda_graph: bool = False
    force_onnx_export: bool = False
    force_onnx_optimize: bool = False
    force_engine_build: bool = False
    stats: dict = field(default_factory=dict)


def prepare_stage_engines(models: list[StageModel], settings: EngineSettings, device: str, dtype: torch.dtype,
                          log: Callable[[str], None] = print) -> dict[str, Path]:
    """export -> optimize -> build for each model; records per-stage sizes and times in settings.stats."""
    engines = {}
    for model in models:
        start = time.perf_counter()
        onnx_path = model.prepare_onnx(settings.onnx_dir, device, dtype, settings.force_onnx_export,
                                       settings.force_onnx_optimize, log)
        onnx_done = time.perf_counter()
        shapes = settings.profile.stage_shapes(model, settings.guided)
        engines[model.name] = prepare_engine(model, onnx_path, settings.engine_dir, shapes, settings.options,
                                             settings.force_engine_build, log)
        settings.stats[model.name] = {
            "onnx_bytes": artifact_bytes(onnx_path),
            "onnx_s": onnx_done - start,
            "engine_s": time.perf_counter() - onnx_done,
            "engine_bytes": engines[model.name].stat().st_size,
        }
    return engines


def create_engine_stages(models: list[StageModel], engines: dict[str, Path], flavour: str,
                         use_cuda_graph: bool) -> dict[str, Stage]:
    loaded = {m.name: TensorRTEngine(flavour, engines[m.name], use_cuda_graph) for m in models}
    shared = torch.empty(max(e.device_memory_size for e in loaded.values()) or 1, dtype=torch.uint8, device="cuda")
    for engine in loaded.values():
        engine.use_device_memory(shared)
    return {m.name: TensorRTStage(m, loaded[m.name]) for m in models}
