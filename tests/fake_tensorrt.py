"""A stand-in for the `tensorrt` module that runs on a CPU, for testing the engine layer end to end.

It speaks the Python API of TensorRT 8.6 or 10.x (chosen by version) closely enough for demo/backends/tensorrt/
(build.py, runtime.py, refit.py): the builder parses the ONNX file and serializes an "engine" that names it;
the execution context reads its inputs from, and writes its outputs to, the raw addresses it was given,
computing them with ONNX Runtime on that ONNX; and each run scribbles over the device memory it was
handed, as TensorRT's scratch use does. Wrong bindings, freed memory, aliased buffers and unchecked
shapes therefore show up as wrong numbers, as they would on a GPU.

An engine built with BuilderFlag.REFIT is refittable: its Refitter takes weights by ONNX initializer name (as
TensorRT's ONNX parser names them), asks for the weights "fused" with those set (the bias of a Conv, or of an Add
after a MatMul, as TensorRT fuses them), reads the arrays only when refit_cuda_engine runs (so arrays freed before
then are caught), and later runs compute with the new values. Each refit is logged in the engine's `refits`.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import types
import weakref

import numpy as np

DEVICE_MEMORY_BYTES = 1 << 20
SCRATCH_BYTE = 0xAB


class DataType(enum.Enum):
    FLOAT = np.float32
    HALF = np.float16
    INT32 = np.int32
    INT64 = np.int64


_ONNX_TYPES = {1: DataType.FLOAT, 10: DataType.HALF, 6: DataType.INT32, 7: DataType.INT64}


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class Logger:
    WARNING = 2

    def __init__(self, severity=WARNING):
        self.severity = severity


# ---- building --------------------------------------------------------------------------------------

class _Tensor:
    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype


class _Network:
    def __init__(self, flags):
        self.flags = flags
        self.inputs: list[_Tensor] = []
        self.outputs: list[_Tensor] = []
        self.onnx_path = None

    @property
    def num_inputs(self):
        return len(self.inputs)

    @property
    def num_outputs(self):
        return len(self.outputs)

    def get_input(self, i):
        return self.inputs[i]

    def get_output(self, i):
        return self.outputs[i]


class _ParserError:
    def __init__(self, node, op, desc):
        self._node, self._op, self._desc = node, op, desc

    def node_name(self):
        return self._node

    def node_operator(self):
        return self._op

    def desc(self):
        return self._desc


class OnnxParser:
    def __init__(self, network, logger):
        self.network = network
        self.errors: list[_ParserError] = []

    @property
    def num_errors(self):
        return len(self.errors)

    def get_error(self, i):
        return self.errors[i]

    def parse_from_file(self, path):
        import onnx

        model = onnx.load(path, load_external_data=False)
        for node in model.graph.node:
            if not onnx.defs.has(node.op_type, node.domain):  # as TensorRT: no importer, no plugin
                message = f"No importer registered for op: {node.op_type}"
                self.errors.append(_ParserError(node.name, node.op_type, message))
                return False
        initializers = {i.name for i in model.graph.initializer}
        for value in model.graph.input:
            if value.name not in initializers:
                self.network.inputs.append(_Tensor(value.name, _ONNX_TYPES[value.type.tensor_type.elem_type]))
        for value in model.graph.output:
            self.network.outputs.append(_Tensor(value.name, _ONNX_TYPES[value.type.tensor_type.elem_type]))
        self.network.onnx_path = str(path)
        return True


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, low, opt, high):
        self.shapes[name] = [list(low), list(opt), list(high)]


OTHER_DEVICE_CACHE = b"timing cache of another device"


class _TimingCache:
    def __init__(self, blob):
        self.blob = bytes(blob) or b"fake-timing-cache"

    def serialize(self):
        return self.blob


class _Config:
    def __init__(self, api):
        self.api = api
        self.flags = set()
        self.profiles = []
        self.builder_optimization_level = 3
        self.profiling_verbosity = None
        # As TensorRT 8.6 and later: cuBLAS, cuBLASLt and cuDNN off unless enabled
        self.tactic_sources = 1 << int(api.TacticSource.EDGE_MASK_CONVOLUTIONS)
        self.timing_cache = None
        self.progress_monitor = None

    def set_flag(self, flag):
        self.flags.add(flag)

    def get_tactic_sources(self):
        return self.tactic_sources

    def set_tactic_sources(self, mask):
        self.tactic_sources = mask

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)

    def create_timing_cache(self, blob):
        return _TimingCache(blob)

    def set_timing_cache(self, cache, ignore_mismatch):
        """As TensorRT: False, and the cache unused, for one made on another device (here: its blob says so)."""
        if cache.blob.startswith(OTHER_DEVICE_CACHE) and not ignore_mismatch:
            return False
        self.timing_cache = cache
        return True


class Builder:
    api: types.ModuleType  # set per module by make_module

    def __init__(self, logger):
        pass

    def create_network(self, flags):
        return _Network(flags)

    def create_builder_config(self):
        return _Config(self.api)

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        self.api.last_build = {"flags": network.flags, "config_flags": sorted(f.name for f in config.flags),
                               "tactic_sources": config.tactic_sources}
        (profile,) = config.profiles
        # TensorRT promises no order of an engine's tensors (8.6 lists a UNet's outputs otherwise than its ONNX):
        # the stand-in lists them backwards, so code that binds by position fails here too.
        io = [{"name": t.name, "mode": "INPUT", "dtype": t.dtype.name, "profile": profile.shapes[t.name]}
              for t in reversed(network.inputs)]
        io += [{"name": t.name, "mode": "OUTPUT", "dtype": t.dtype.name} for t in reversed(network.outputs)]
        refittable = self.api.BuilderFlag.REFIT in config.flags
        return json.dumps({"fake_engine": 1, "onnx": network.onnx_path, "io": io, "refittable": refittable}).encode()


# ---- running ----------------------------------------------------------------------------------------

def _view(address: int, shape, dtype: DataType) -> np.ndarray:
    count = int(np.prod(shape))
    nbytes = count * np.dtype(dtype.value).itemsize
    buffer = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(buffer, dtype=dtype.value, count=count).reshape(shape)


class _Engine:
    def __init__(self, api, spec):
        self.api = api
        self.spec = spec
        self.io = {t["name"]: t for t in spec["io"]}
        self.names = [t["name"] for t in spec["io"]]
        self.device_memory_size = DEVICE_MEMORY_BYTES
        self.session = None
        self.refittable = spec["refittable"]
        self.weights: dict[str, np.ndarray] = {}  # refitted initializers' values
        self.refits: list[dict] = []  # per refit: the names set, in order, and those asked for besides

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return TensorIOMode[self.io[name]["mode"]]

    def get_tensor_dtype(self, name):
        return DataType[self.io[name]["dtype"]]

    def get_tensor_profile_shape(self, name, profile_index):
        assert profile_index == 0
        return [tuple(s) for s in self.io[name]["profile"]]

    def onnx_nodes(self) -> list[tuple[str, str]]:
        """(name, op type) of each node: the fake engine's layers."""
        import onnx

        graph = onnx.load(self.spec["onnx"], load_external_data=False).graph
        return [(node.name or f"{node.op_type}_{i}", node.op_type) for i, node in enumerate(graph.node)]

    def create_engine_inspector(self):
        return _Inspector(self)

    def run_onnx(self, feeds):
        if self.session is None:
            import onnx
            import onnxruntime

            model = self.spec["onnx"]
            if self.weights:
                model = onnx.load(model)
                for tensor in model.graph.initializer:
                    if tensor.name in self.weights:
                        tensor.CopyFrom(onnx.numpy_helper.from_array(self.weights[tensor.name], tensor.name))
                model = model.SerializeToString()
            self.session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in self.session.get_outputs()], self.session.run(None, feeds)))

    def initializers(self) -> dict[str, tuple[tuple[int, ...], DataType]]:
        """The refittable weights: the ONNX's float initializers, by name, with their shapes and types."""
        import onnx

        graph = onnx.load(self.spec["onnx"], load_external_data=False).graph
        return {t.name: (tuple(t.dims), _ONNX_TYPES[t.data_type]) for t in graph.initializer
                if _ONNX_TYPES.get(t.data_type) in (DataType.FLOAT, DataType.HALF)}

    def fused_weights(self) -> dict[str, set[str]]:
        """Weights TensorRT would fuse into one layer, and so asks for together: a Conv's kernel and bias, a
        MatMul's constant and that of an Add right after it."""
        import onnx

        graph = onnx.load(self.spec["onnx"], load_external_data=False).graph
        constants = {t.name for t in graph.initializer}
        consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node)
        groups: dict[str, set[str]] = {}
        for node in graph.node:
            if node.op_type == "Conv" and len(node.input) == 3 and {node.input[1], node.input[2]} <= constants:
                group = {node.input[1], node.input[2]}
            elif (node.op_type == "MatMul" and node.input[1] in constants
                  and len(consumers.get(node.output[0], [])) == 1):
                (after,) = consumers[node.output[0]]
                biases = [name for name in after.input if name in constants] if after.op_type == "Add" else []
                group = {node.input[1], *biases}
            else:
                continue
            for name in group:
                groups.setdefault(name, set()).update(group - {name})
        return groups



class _Inspector:
    def __init__(self, engine):
        self.engine = engine

    def get_engine_information(self, layer_format):
        """A layer per ONNX node; an input a DequantizeLinear makes is listed as int8, as where TensorRT fuses the
        Q/DQ pair into the layer reading it."""
        import onnx

        assert layer_format == LayerInformationFormat.JSON
        graph = onnx.load(self.engine.spec["onnx"], load_external_data=False).graph
        dequantized = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
        layers = [{"Name": name, "LayerType": op_type,
                   "Inputs": [{"Name": i, "Format/Datatype": "Int8" if i in dequantized else "FP32"}
                              for i in node.input]}
                  for (name, op_type), node in zip(self.engine.onnx_nodes(), graph.node)]
        return json.dumps({"Layers": layers})


class Weights:
    """Where an array's values are, as TensorRT's Weights holds them (no copy, no reference that keeps it)."""

    def __init__(self, array: np.ndarray):
        assert array.flags.c_contiguous
        self.dtype = DataType(array.dtype.type)
        self.address, self.count = array.ctypes.data, array.size
        self._alive = weakref.ref(array)

    def values(self) -> np.ndarray:
        assert self._alive() is not None, "the array behind a Weights was freed before the refit read it"
        return _view(self.address, (self.count,), self.dtype).copy()


class Refitter:
    def __init__(self, engine, logger):
        assert engine.refittable, "Refitter of an engine built without BuilderFlag.REFIT"
        self.engine = engine
        self.refittable = engine.initializers()
        self.fused = engine.fused_weights()
        self.named: dict[str, Weights] = {}
        self.asked: set[str] = set()  # what get_missing_weights said

    def get_all_weights(self):
        return list(self.refittable)

    def set_named_weights(self, name, weights):
        if name not in self.refittable:
            return False
        shape, dtype = self.refittable[name]
        if weights.count != int(np.prod(shape)) or weights.dtype != dtype:
            return False
        self.named[name] = weights
        return True

    def get_missing_weights(self):
        missing = sorted({other for name in self.named for other in self.fused.get(name, ())} - set(self.named))
        self.asked.update(missing)
        return missing

    def refit_cuda_engine(self):
        if self.get_missing_weights():
            return False
        for name, weights in self.named.items():
            self.engine.weights[name] = weights.values().reshape(self.refittable[name][0])
        self.engine.session = None  # later runs compute with the new values
        self.engine.refits.append({"set": list(self.named), "missing": sorted(self.asked)})
        return True


class LayerInformationFormat(enum.Enum):
    ONELINE = 0
    JSON = 1


class IProfiler:
    def report_layer_time(self, layer_name, ms):
        raise NotImplementedError


def fake_layer_ms(index: int) -> float:
    """What the fake profiler reports for the index-th layer on every run."""
    return 0.25 + index / 64


class _Context:
    def __init__(self, engine):
        self.engine = engine
        self.shapes = {}
        self.addresses = {}
        self.scratch = None  # (address, size)
        self._output_shapes = None
        self.runs = 0
        self.profiler = None

    def set_input_shape(self, name, shape):
        low, _, high = self.engine.io[name]["profile"]
        if len(shape) != len(low) or any(not lo <= s <= hi for s, lo, hi in zip(shape, low, high)):
            return False
        self.shapes[name] = tuple(shape)
        self._output_shapes = None
        return True

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def _inputs(self, from_memory: bool):
        feeds = {}
        for name, meta in self.engine.io.items():
            if meta["mode"] == "INPUT":
                dtype = DataType[meta["dtype"]]
                feeds[name] = (_view(self.addresses[name], self.shapes[name], dtype).copy() if from_memory
                               else np.zeros(self.shapes[name], dtype=dtype.value))
        return feeds

    def get_tensor_shape(self, name):
        if self.engine.io[name]["mode"] == "INPUT":
            return self.shapes.get(name, (-1,))
        if self._output_shapes is None:
            self._output_shapes = {n: v.shape for n, v in self.engine.run_onnx(self._inputs(False)).items()}
        return self._output_shapes[name]

    def execute_async_v3(self, stream):
        if self.scratch is None:
            return False
        outputs = self.engine.run_onnx(self._inputs(True))
        ctypes.memset(self.scratch[0], SCRATCH_BYTE, self.scratch[1])
        for name, value in outputs.items():
            target = _view(self.addresses[name], value.shape, self.engine.get_tensor_dtype(name))
            target[...] = value
        self.runs += 1
        if self.profiler is not None:
            for index, (name, _) in enumerate(self.engine.onnx_nodes()):
                self.profiler.report_layer_time(name, fake_layer_ms(index))
        return True


class _Engine8(_Engine):
    """TensorRT 8.6: the context gets device memory through a property."""

    def create_execution_context_without_device_memory(self):
        return _Context8(self)


class _Context8(_Context):
    def _set_device_memory(self, address):
        self.scratch = (address, self.engine.device_memory_size)

    device_memory = property(None, _set_device_memory)


class _Engine10(_Engine):
    """TensorRT 10.1+: user-managed device memory with an explicit size."""

    @property
    def device_memory_size_v2(self):
        return self.device_memory_size

    def create_execution_context(self, strategy):
        assert strategy.name == "USER_MANAGED"
        return _Context10(self)


class _Context10(_Context):
    def set_device_memory(self, address, size):
        assert size >= self.engine.device_memory_size
        self.scratch = (address, size)


class Runtime:
    engine_class = _Engine

    def __init__(self, logger):
        pass

    def deserialize_cuda_engine(self, blob):
        try:
            spec = json.loads(bytes(blob))
        except ValueError:
            return None
        if not isinstance(spec, dict) or spec.get("fake_engine") != 1:
            return None
        return self.engine_class(None, spec)


def install(monkeypatch, version: str) -> types.ModuleType:
    """Make a stand-in of this version the `tensorrt` module for the test, building "for this GPU", and choosing it
    to run stages (on the CPU: demo.runtime.loader.load_pipeline(spec, "cpu")), as on a compute capability 9.0 one;
    returns the module."""
    import sys

    import torch._dynamo  # noqa: F401 (imported first: it looks up the tensorrt module's spec, which a stand-in lacks)

    module = make_module(version)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr("demo.backends.tensorrt.build.current_cc", lambda: (9, 0))
    monkeypatch.setattr("demo.backends.registry.current_cc", lambda: (9, 0))
    return module


def make_module(version: str) -> types.ModuleType:
    """A `tensorrt` module of this version: 8.x has the older memory and network API, 10.x the newer."""
    module = types.ModuleType("tensorrt")
    module.__version__ = version
    newer = int(version.split(".")[0]) >= 10
    module.last_build = None
    module.Logger, module.DataType, module.TensorIOMode, module.OnnxParser = Logger, DataType, TensorIOMode, OnnxParser
    module.IProfiler, module.LayerInformationFormat = IProfiler, LayerInformationFormat
    module.float32, module.float16, module.int32 = DataType.FLOAT, DataType.HALF, DataType.INT32
    module.TacticSource = enum.IntEnum("TacticSource", ["CUBLAS", "CUBLAS_LT", "CUDNN", "EDGE_MASK_CONVOLUTIONS"],
                                       start=0)
    module.BuilderFlag = enum.Enum("BuilderFlag", ["FP16", "INT8", "REFIT"])
    module.Weights, module.Refitter = Weights, Refitter
    module.ProfilingVerbosity = enum.Enum("ProfilingVerbosity", ["LAYER_NAMES_ONLY", "DETAILED"])
    flags = ["EXPLICIT_BATCH"] + (["STRONGLY_TYPED"] if newer else [])
    module.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", flags, start=0)
    module.Builder = type("Builder", (Builder,), {"api": module})
    module.Runtime = type("Runtime", (Runtime,), {"engine_class": _Engine10 if newer else _Engine8})
    if newer:
        module.ExecutionContextAllocationStrategy = enum.Enum("ExecutionContextAllocationStrategy",
                                                              ["STATIC", "ON_PROFILE_CHANGE", "USER_MANAGED"])
    return module


@contextlib.contextmanager
def stand_in_pipeline(folder, engine_options: dict | None = None, version: str = "10.8.0", **spec_fields):
    """A pipeline loaded on the CPU with engines the stand-in (of this TensorRT version's API) builds and runs: fp32,
    no plugins, static batch, builder level 0, its ONNX and engines under `folder`; `engine_options` (EngineOptions'
    fields) and `spec_fields` (PipelineSpec's) besides."""
    import pytest

    from demo.backends.tensorrt.options import EngineOptions
    from demo.runtime.loader import load_pipeline
    from demo.runtime.spec import PipelineSpec

    with pytest.MonkeyPatch.context() as patch:
        install(patch, version)
        options = EngineOptions(onnx_dir=str(folder / "onnx"), engine_dir=str(folder / "engine"),
                                build_static_batch=True, optimization_level=0, **(engine_options or {}))
        spec = PipelineSpec(**{"precision": "fp32", "plugins": "none", **spec_fields}, backend="tensorrt",
                            engine=options)
        with load_pipeline(spec, "cpu", progress=lambda *_: None) as pipeline:
            yield pipeline
