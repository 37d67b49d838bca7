"""Running TensorRT engines behind the stage interface.

`Engine` owns everything about one deserialized engine: its execution context, what it binds (read
from the engine itself and checked against the model class), its I/O buffers, the device memory it
works in, and its stream and CUDA graph; and refit, for a refittable engine (weights set in place by name, refit.py).
`create_engine_stages` loads the pipeline's engines with one shared device-memory block (the stages run one after
another) that lives as long as they do.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Callable, ContextManager, Mapping

import numpy as np
import torch

from core.errors import RunFailure, UsageError, field
from demo.backends.base import LoraApplier, Stage
from demo.backends.tensorrt.build import EngineSettings, SettingsOf, engine_dtype, register_plugins, settings_for
from demo.backends.tensorrt.flavour import TensorRTAPI
from demo.backends.tensorrt.refit import RefittedLoras
from models.base import StageModel
from plugins.contract import PLUGIN_OP_KEYS

# Layer kinds besides the plugin keys (Engine.layer_kinds): format conversions; the copies TensorRT makes of tensors
# into a concatenation it cannot have them written into in place (Reformat layers too, named "<tensor> copy": the
# UNet's skip connections, work the torch path does in torch.cat); TensorRT's layers reading int8 (quantized
# convolutions and matrix products fused into int8 kernels); and the rest of what TensorRT made.
REFORMAT, CONCAT_COPY, INT8, GENERATED = "reformat", "concat copy", "TensorRT int8", "TensorRT"
TENSORRT_KINDS = (REFORMAT, CONCAT_COPY, INT8, GENERATED)


def time_by_kind(layer_ms: dict[str, float], kinds: dict[str, str]) -> dict[str, float]:
    """Per-layer milliseconds summed per layer kind. A name the inspector does not list is a piece of a
    layer TensorRT generated (plugin layers are never fused, so they are always listed by name)."""
    totals: Counter = Counter()
    for name, ms in layer_ms.items():
        totals[kinds.get(name, GENERATED)] += ms
    return dict(totals)


def plugin_counts(kinds: dict[str, str]) -> Counter:
    """Plugin layers per plugin key, from Engine.layer_kinds."""
    return Counter(kind for kind in kinds.values() if kind not in TENSORRT_KINDS)


def layer_kind(layer: dict) -> str:
    """What one layer of the engine inspector's JSON is: a plugin key ("fMHA", ...; "other" for a plugin not ours),
    CONCAT_COPY or REFORMAT for TensorRT's Reformat layers, INT8 for its layers that read int8 (by the data types
    listed for their inputs), GENERATED for the rest of what TensorRT made. The ONNX passes name each plugin node
    '<tensor>/<plugin op>', and the parser keeps the name."""
    name, layer_type = layer.get("Name", ""), layer.get("LayerType")
    if layer_type == "PluginV2":
        found = re.search(r"/(\w+)$", name)
        return PLUGIN_OP_KEYS.get(found.group(1), "other") if found else "other"
    if layer_type == "Reformat":
        return CONCAT_COPY if name.endswith(" copy") else REFORMAT
    reads_int8 = any("int8" in str(t.get("Format/Datatype", "")).lower()
                     for t in layer.get("Inputs", []) if isinstance(t, dict))
    return INT8 if reads_int8 else GENERATED


class EngineMismatchError(RunFailure):
    """An engine that does not bind what its model class says (wrong file, stale build, other model)."""


def _check_cuda(result) -> object:
    error, *rest = result
    if int(error) != 0:
        raise RuntimeError(f"CUDA error {error}")
    return rest[0] if len(rest) == 1 else (rest or None)


class Engine:
    """One TensorRT engine: deserialized, bound to buffers it owns, run on its own stream.

    On a CUDA device work runs on a private stream ordered after everything already queued on torch's
    current stream and before anything queued there afterwards. With `use_cuda_graph`, `prepare`
    runs the engine once and captures the next enqueue in a CUDA graph that every `run` replays, so
    capture happens while getting ready, never inside a timed run.
    """

    def __init__(self, api: TensorRTAPI, path: Path, stage: str, device: torch.device, use_cuda_graph: bool):
        self.api = api
        self.path = path
        self.stage = stage
        self.device = torch.device(device)
        self.use_cuda_graph = use_cuda_graph
        self._runtime = api.trt.Runtime(api.logger())
        self.engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise EngineMismatchError(f"{stage}: {api.label} could not deserialize {path} (see its log above); "
                                      f"rebuild it with {field('force_engine_build')}")
        modes = api.trt.TensorIOMode
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == modes.INPUT]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == modes.OUTPUT]
        self.context = api.create_context(self.engine)
        self.device_memory: torch.Tensor | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.bound_shapes: dict[str, tuple[int, ...]] | None = None
        self._stream = self._inputs_ready = self._outputs_ready = None
        self._graph = self._graph_exec = None
        if self.device.type == "cuda":
            from cuda.bindings import runtime as cudart

            self._cudart = cudart
            self._stream = _check_cuda(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))
            self._inputs_ready = _check_cuda(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))
            self._outputs_ready = _check_cuda(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))

    # ---- what the engine binds -------------------------------------------------------------------
    def torch_dtype(self, name: str) -> torch.dtype:
        dtype = self.engine.get_tensor_dtype(name)
        try:
            return _TORCH_DTYPES[dtype.name]
        except KeyError:
            raise EngineMismatchError(f"{self.stage}: tensor '{name}' has type {dtype.name}, "
                                      "which the runtime does not bind") from None

    def check_model(self, model: StageModel, dtype: torch.dtype) -> None:
        """The engine must bind the model class's inputs and outputs, in the precision asked for. Tensors are bound
        by name: TensorRT lists them in an order of its own (8.6 put a UNet's two outputs in another order than the
        ONNX's)."""
        if (sorted(self.input_names) != sorted(model.input_names)
                or sorted(self.output_names) != sorted(model.output_names)):
            raise EngineMismatchError(
                f"{self.stage}: the engine binds {self.input_names} -> {self.output_names}, the model class "
                f"{list(model.input_names)} -> {list(model.output_names)}; rebuild with {field('force_engine_build')}")
        wanted = {**model.input_dtypes(dtype), **{n: dtype for n in model.output_names}}
        wrong = [f"{n} is {self.torch_dtype(n)}, expected {t}" for n, t in wanted.items() if self.torch_dtype(n) != t]
        if wrong:
            raise EngineMismatchError(f"{self.stage}: engine tensor types differ from the model class "
                                      f"({'; '.join(wrong)}); rebuild with {field('force_engine_build')}")

    def layer_kinds(self) -> dict[str, str]:
        """Layer name -> what it is (layer_kind), from TensorRT's engine inspector (engines are built with detailed
        profiling verbosity, so layer types are listed)."""
        return {layer.get("Name", ""): layer_kind(layer) for layer in self._inspected_layers()}

    def _inspected_layers(self) -> list[dict]:
        """The layers TensorRT's engine inspector lists (detailed, as engines are built)."""
        inspector = self.engine.create_engine_inspector()
        # strict=False: TensorRT 8.6 writes raw control characters into some of the JSON's strings.
        info = json.loads(inspector.get_engine_information(self.api.trt.LayerInformationFormat.JSON), strict=False)
        return [layer for layer in info.get("Layers", []) if isinstance(layer, dict)]

    def int8_layers(self) -> int:
        """How many layers (format conversions aside) read int8: the Q/DQ-wrapped convolutions and matrix products
        TensorRT fused into int8 kernels."""
        return sum(1 for kind in self.layer_kinds().values() if kind == INT8)

    def plugin_layers(self) -> Counter:
        """Plugin layers in the built engine, per plugin key."""
        return plugin_counts(self.layer_kinds())

    def layer_times(self, runs: int) -> dict[str, float]:
        """Milliseconds per run of each layer, from TensorRT's per-layer profiler over `runs` runs of the
        bound inputs. They go through a second execution context that carries the profiler (in the same
        device memory), so the engine's own context, and the CUDA graph captured from it, stay as they were."""
        if self.bound_shapes is None:
            raise RuntimeError(f"{self.stage}: layer_times before prepare")
        trt = self.api.trt
        totals: Counter = Counter()

        class Profiler(trt.IProfiler):
            def __init__(self):
                trt.IProfiler.__init__(self)

            def report_layer_time(self, layer_name, ms):
                totals[layer_name] += ms

        context = self.api.create_context(self.engine)
        self.api.set_device_memory(context, self.device_memory.data_ptr(),
                                   self.device_memory.numel() * self.device_memory.element_size())
        for name in self.input_names:
            context.set_input_shape(name, tuple(self.buffers[name].shape))
        for name, buffer in self.buffers.items():
            context.set_tensor_address(name, buffer.data_ptr())
        profiler = context.profiler = Profiler()  # held here: TensorRT keeps only a pointer to it
        stream = 0 if self._stream is None else int(self._stream)
        if self._stream is not None:
            torch.cuda.synchronize(self.device)
        for _ in range(runs):
            if not context.execute_async_v3(stream):
                raise RuntimeError(f"{self.stage}: TensorRT execution failed while profiling (see its log above)")
        if self._stream is not None:
            _check_cuda(self._cudart.cudaStreamSynchronize(self._stream))
        del context, profiler  # the context first: it points at the profiler
        return {name: ms / runs for name, ms in totals.items()}

    def profile(self, name: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(name, 0))

    # ---- refit -------------------------------------------------------------------------------------
    @property
    def refittable(self) -> bool:
        return bool(self.engine.refittable)

    def refit(self, weights: Mapping[str, np.ndarray], more: Callable[[list[str]], Mapping[str, np.ndarray]]) -> None:
        """Set the engine's named weights (its ONNX initializers' names, which TensorRT's parser gives them) to these
        values in place, and any others TensorRT asks for besides (`more(names)` gives those, all at once: weights it
        fused with the ones set, which it must fuse again). Work queued on the engine's stream is waited for first. A
        CUDA graph captured over the engine is captured again: TensorRT does not promise that a refit leaves the
        weights where the graph's kernels read them."""
        trt = self.api.trt
        if self._stream is not None:
            _check_cuda(self._cudart.cudaStreamSynchronize(self._stream))
        refitter = trt.Refitter(self.engine, self.api.logger())
        held = []  # TensorRT reads the arrays when refit_cuda_engine runs, not when they are set: they live until then

        def put(name: str, values: np.ndarray) -> None:
            held.append(np.ascontiguousarray(values))
            if not refitter.set_named_weights(name, trt.Weights(held[-1])):
                raise EngineMismatchError(f"{self.stage}: the engine has no refittable weights '{name}' of "
                                          f"{held[-1].size} {held[-1].dtype} values; rebuild it with "
                                          f"{field('force_engine_build')}")

        for name, values in weights.items():
            put(name, values)
        missing = list(refitter.get_missing_weights())
        try:
            found = more(missing) if missing else {}
        except KeyError as exc:
            raise EngineMismatchError(f"{self.stage}: TensorRT asks for weights {exc} to refit, which are no "
                                      "initializer of the ONNX the engine was built from") from None
        for name in missing:
            put(name, found[name])
        if not refitter.refit_cuda_engine():
            raise EngineMismatchError(f"{self.stage}: TensorRT could not refit the engine (see its log above)")
        if self._graph_exec is not None:
            self._destroy_graph()
            self._launch()
            self._capture_graph()

    # ---- memory ------------------------------------------------------------------------------------
    @property
    def device_memory_size(self) -> int:
        return self.api.device_memory_size(self.engine)

    def use_device_memory(self, block: torch.Tensor) -> None:
        """Work in `block` (shared with engines that never run at the same time); kept alive here."""
        if block.numel() * block.element_size() < self.device_memory_size:
            raise ValueError(f"{self.stage}: device memory block of {block.numel()} bytes, "
                             f"the engine needs {self.device_memory_size}")
        self.device_memory = block
        self.api.set_device_memory(self.context, block.data_ptr(), block.numel() * block.element_size())

    # ---- binding -----------------------------------------------------------------------------------
    def prepare(self, input_shapes: dict[str, tuple[int, ...]], output_shapes: dict[str, tuple[int, ...]]) -> None:
        """Allocate and bind buffers for these shapes; outputs must come out as `output_shapes` say."""
        shapes = {**input_shapes, **output_shapes}
        if shapes == self.bound_shapes:
            return
        if self.device_memory is None:
            raise RuntimeError(f"{self.stage}: no device memory bound (use_device_memory) before prepare")
        self._destroy_graph()
        self.buffers, self.bound_shapes = {}, None
        for name in sorted(self.input_names, key=list(input_shapes).index):  # the caller's order: stable messages
            shape = tuple(input_shapes[name])
            low, _, high = self.profile(name)
            if len(shape) != len(low) or any(not lo <= s <= hi for s, lo, hi in zip(shape, low, high)):
                raise UsageError(
                    f"{self.stage} engine input '{name}' shape {list(shape)} is outside the engine's profile "
                    f"(min {list(low)}, max {list(high)}); rebuild with matching {field('batch_size')}/"
                    f"{field('height')}/{field('width')}, or with {field('build_dynamic_shape')}")
            # Inputs start as zeros: `prepare` may run the engine before the first real feed.
            self.buffers[name] = torch.zeros(shape, dtype=self.torch_dtype(name), device=self.device)
            if not self.context.set_input_shape(name, shape):
                raise EngineMismatchError(f"{self.stage}: TensorRT refused shape {list(shape)} for input '{name}'")
            self.context.set_tensor_address(name, self.buffers[name].data_ptr())
        for name in self.output_names:
            actual = tuple(self.context.get_tensor_shape(name))
            if actual != tuple(output_shapes[name]):
                raise EngineMismatchError(f"{self.stage}: output '{name}' comes out {list(actual)}, the model class "
                                          f"expects {list(output_shapes[name])}; rebuild with "
                                          f"{field('force_engine_build')}")
            self.buffers[name] = torch.empty(actual, dtype=self.torch_dtype(name), device=self.device)
            self.context.set_tensor_address(name, self.buffers[name].data_ptr())
        self.bound_shapes = shapes
        if self.use_cuda_graph:
            self._launch()  # first enqueue: TensorRT may allocate or initialize lazily, not capturable
            self._capture_graph()

    # ---- running -----------------------------------------------------------------------------------
    def run(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Outputs are fresh tensors: a later run never changes what an earlier one returned."""
        if self.bound_shapes is None:
            raise RuntimeError(f"{self.stage}: run before prepare")
        for name in self.input_names:
            self.buffers[name].copy_(feed[name])
        self._launch()
        return {name: self.buffers[name].clone() for name in self.output_names}

    def _enqueue(self, stream: int) -> None:
        if not self.context.execute_async_v3(stream):
            raise RuntimeError(f"{self.stage}: TensorRT execution failed (see its log above)")

    def _launch(self) -> None:
        if self._stream is None:  # a host device (only the tests' stand-in TensorRT runs there)
            self._enqueue(0)
            return
        cudart = self._cudart
        torch_stream = torch.cuda.current_stream(self.device).cuda_stream
        _check_cuda(cudart.cudaEventRecord(self._inputs_ready, torch_stream))
        _check_cuda(cudart.cudaStreamWaitEvent(self._stream, self._inputs_ready, 0))
        if self._graph_exec is not None:
            _check_cuda(cudart.cudaGraphLaunch(self._graph_exec, self._stream))
        else:
            self._enqueue(int(self._stream))
        _check_cuda(cudart.cudaEventRecord(self._outputs_ready, self._stream))
        _check_cuda(cudart.cudaStreamWaitEvent(torch_stream, self._outputs_ready, 0))

    def _capture_graph(self) -> None:
        if self._stream is None:
            return
        cudart = self._cudart
        torch.cuda.synchronize(self.device)
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        _check_cuda(cudart.cudaStreamBeginCapture(self._stream, mode))
        try:
            self._enqueue(int(self._stream))
        finally:  # end the capture even when enqueue fails, or the stream stays unusable
            graph = _check_cuda(cudart.cudaStreamEndCapture(self._stream))
        self._graph = graph
        self._graph_exec = _check_cuda(cudart.cudaGraphInstantiate(graph, 0))

    @property
    def has_graph(self) -> bool:
        return self._graph_exec is not None

    def _destroy_graph(self) -> None:
        if self._graph_exec is not None:
            _check_cuda(self._cudart.cudaGraphExecDestroy(self._graph_exec))
        if self._graph is not None:
            _check_cuda(self._cudart.cudaGraphDestroy(self._graph))
        self._graph = self._graph_exec = None

    def close(self) -> None:
        """Release the graph, events, stream, context and engine (idempotent)."""
        if self._stream is not None:
            _check_cuda(self._cudart.cudaStreamSynchronize(self._stream))
            self._destroy_graph()
            for event in (self._inputs_ready, self._outputs_ready):
                _check_cuda(self._cudart.cudaEventDestroy(event))
            _check_cuda(self._cudart.cudaStreamDestroy(self._stream))
            self._stream = self._inputs_ready = self._outputs_ready = None
        self.buffers, self.bound_shapes = {}, None
        self.context = self.engine = None
        self.device_memory = None

    def __del__(self):
        if getattr(self, "_stream", None) is not None:
            try:
                self.close()
            except Exception:  # interpreter shutdown: CUDA may already be gone
                pass


_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
                 "INT64": torch.int64, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


class EngineStage(Stage):
    """A pipeline stage backed by an Engine; `onnx` gives the optimized ONNX it was built from (through the artifact
    cache, locked while in use), which refits read base weights from."""

    def __init__(self, model: StageModel, engine: Engine, onnx: Callable[[], ContextManager[Path]] | None = None):
        super().__init__(model)
        self.engine = engine
        self.onnx = onnx

    @property
    def refittable(self) -> bool:
        return self.onnx is not None and self.engine.refittable

    def refit(self, named_weights: Mapping[str, np.ndarray],
              more: Callable[[list[str]], Mapping[str, np.ndarray]]) -> None:
        """Engine.refit."""
        self.engine.refit(named_weights, more)

    def prepare(self, batch, height, width):
        self.engine.prepare(self.model.input_shapes(batch, height, width),
                            self.model.output_shapes(batch, height, width))

    def __call__(self, feed):
        return self.engine.run(feed)

    def close(self) -> None:
        self.engine.close()

    @classmethod
    def lora_applier(cls, stages: list[EngineStage]) -> LoraApplier:
        return RefittedLoras(stages)


def create_engine_stages(models: list[StageModel], engines: dict[str, Path], api: TensorRTAPI, dtype: torch.dtype,
                         settings: EngineSettings | SettingsOf, device: torch.device | str = "cuda",
                         log: Callable[[str], None] = print,
                         onnx: Callable[[StageModel], ContextManager[Path]] | None = None) -> dict[str, EngineStage]:
    """Load each model's engine (with its settings: `settings`, or `settings(model)`), check it against its model
    class, and share one device-memory block. Engines with plugins in them need their creators in TensorRT's registry
    first. `onnx(model)` gives the optimized ONNX a model's engine was built from (build.stage_onnx), for refits; None:
    the stages cannot refit."""
    settings_of = settings_for(settings)
    for convention in sorted({settings_of(m).plugin_convention for m in models if settings_of(m).plugins}):
        register_plugins(api, convention)
    loaded = {}
    for model in models:
        engine = Engine(api, engines[model.name], model.name, torch.device(device), settings_of(model).use_cuda_graph)
        engine.check_model(model, engine_dtype(model, settings_of(model), dtype))
        loaded[model.name] = engine
    size = max(e.device_memory_size for e in loaded.values())
    block = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    for engine in loaded.values():
        engine.use_device_memory(block)
    log(f"[engine] {', '.join(loaded)} loaded ({api.label}); shared device memory {size / 2**20:.1f} MiB")
    return {m.name: EngineStage(m, loaded[m.name], None if onnx is None else functools.partial(onnx, m))
            for m in models}
