"""INT8 explicit quantization of a stage's optimized ONNX (TensorRT's Q/DQ form), from calibrated activations.

    with ActivationRecorder(unet_component) as recorder:   # calibration: the pipeline's own runs
        ...run the pipeline on the calibration prompts...
    calibration = recorder.calibration()                  # per Linear/Conv2d: |x| largest, per input channel too
    report = quantize_graph(graph, provenance, calibration)  # after the plugin passes, on the optimized graph

What is quantized: every Conv, MatMul and Gemm whose weight the export's provenance traces to calibrated Linear or
Conv2d modules (so the fMHA pass's packed QKV is one layer of three modules), except where int8 cannot pay or
would cost too much accuracy: layers seeing fewer than MIN_ROWS activation rows per image (the time embedding and
each resnet's time projection: one row), layers reading a graph input (the cross-attention keys and values, straight
off the text encoder's outliers, which no LayerNorm here can smooth) and layers with fewer than MIN_CHANNELS channels
in or out (the latents' first and last convolutions). Attention itself and the normalizations stay in our fp16 plugins.

How: activations per tensor, weights per output channel, symmetric int8 (scale = largest |value| / 127).
TensorRT 8.6 fuses the pattern DQ -> Conv/MatMul <- DQ into an int8 kernel; its Q takes fp32 there, and ONNX opset
17 has no fp16 Q/DQ, so a quantized layer computes in fp32 in the graph: Cast (fp16 -> fp32) -> Q -> DQ -> layer
<- DQ <- Q <- fp32 weight, then Cast back to fp16. TensorRT builds the layer in int8 with FP16 + INT8 allowed
(BuilderFlag.INT8 where the network is not strongly typed).

SmoothQuant (Xiao et al., 2023): where a quantized linear layer's input is a LayerNorm's output consumed by
quantized linear layers only, the activations' per-channel outliers move into the weights: with
s_j = a_j^alpha / w_j^(1 - alpha) (a_j the channel's largest |x|, w_j its weight row's largest |w|), the
LayerNorm's gamma and beta are divided by s and the weight rows multiplied by it, which leaves the function
unchanged (smooth_layer_norms alone, checked by the tests) and flattens the activations per-tensor int8 sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs
import torch

from models.provenance import Provenance
from plugins.contract import CONTRACT

QUANTIZE_VERSION = 1  # bump when what the pass writes changes: optimized INT8 ONNX and engines are rebuilt
# An INT8 stage's artifacts: <stage>.int8.opt.onnx and <stage>.int8.engine, beside the fp16 ones, and beside that
# ONNX what quantize_graph did.
INT8_INFIX, INT8_REPORT_SUFFIX = ".int8", ".int8.json"
INT8_MAX = 127
MIN_ROWS = 16  # activation rows per image below which a layer is a vector product: int8 cannot pay for its Q/DQ
MIN_CHANNELS = 16
DEFAULT_ALPHA = 0.5
_SMOOTH_LIMITS = (1e-2, 1e2)  # s is kept in this range: weights of a dead channel must not blow up
# Ops whose output is a LayerNorm with constant gamma (input 1) and beta (input 2): ONNX's own, and the plugin
# nodes of either convention.
LAYER_NORM_OPS = frozenset({"LayerNormalization", *(c.op("LayerNorm") for c in CONTRACT.values())})
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")


# ---- calibration -----------------------------------------------------------------------------------------


@dataclass
class LayerStats:
    """What calibration saw at one Linear or Conv2d module's input, over all its calls."""

    amax: float  # largest |x|
    channel_amax: np.ndarray  # largest |x| per input channel
    rows: int  # activation rows per image and call: tokens (Linear) or input pixels (Conv2d); the largest seen

    def merged(self, other: LayerStats) -> LayerStats:
        return LayerStats(max(self.amax, other.amax), np.maximum(self.channel_amax, other.channel_amax),
                          max(self.rows, other.rows))


@dataclass
class Calibration:
    """Module name (as the component names it) -> its input statistics."""

    layers: dict[str, LayerStats] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        data = {name: {"amax": s.amax, "rows": s.rows, "channel_amax": s.channel_amax.tolist()}
                for name, s in self.layers.items()}
        path.write_text(json.dumps(data))

    @classmethod
    def read(cls, path: Path) -> Calibration:
        data = json.loads(path.read_text())
        return cls({name: LayerStats(float(s["amax"]), np.asarray(s["channel_amax"], np.float32), int(s["rows"]))
                    for name, s in data.items()})


class ActivationRecorder:
    """Records the input statistics of every Linear and Conv2d of `component` while the block runs."""

    def __init__(self, component: torch.nn.Module):
        self.component = component
        self.stats: dict[str, LayerStats] = {}
        self._handles = []

    def _hook(self, name: str, channel_dim: int):
        def record(module, args):
            x = args[0].detach()
            magnitude = x.abs().float()
            dims = [d for d in range(x.dim()) if d != channel_dim % x.dim()]
            channels = magnitude.amax(dim=dims).cpu().numpy()
            rows = x.numel() // (x.shape[0] * x.shape[channel_dim]) if x.dim() > 1 else 1
            seen = LayerStats(float(channels.max()), channels, int(rows))
            self.stats[name] = self.stats[name].merged(seen) if name in self.stats else seen

        return record

    def __enter__(self) -> ActivationRecorder:
        for name, module in self.component.named_modules():
            if isinstance(module, torch.nn.Linear):
                self._handles.append(module.register_forward_pre_hook(self._hook(name, -1)))
            elif isinstance(module, torch.nn.Conv2d):
                self._handles.append(module.register_forward_pre_hook(self._hook(name, 1)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def calibration(self) -> Calibration:
        return Calibration(dict(self.stats))


@dataclass(frozen=True)
class Int8Request:
    """What an INT8 optimized ONNX is made from: `key`, what makes the calibration (model, prompts, steps, ...;
    part of the ONNX's and its engine's cache keys), and `calibrate`, which provides it (the demo layer runs the
    pipeline, or reads its cached result, only when the ONNX must be made)."""

    key: dict
    calibrate: Callable[[], Calibration]
    alpha: float = DEFAULT_ALPHA

    def onnx_key(self) -> dict:
        return {**self.key, "alpha": self.alpha, "quantize_version": QUANTIZE_VERSION}


def int8_report_path(optimized_onnx: Path) -> Path:
    return optimized_onnx.with_name(optimized_onnx.name + INT8_REPORT_SUFFIX)


def write_int8_report(optimized_onnx: Path, report: dict) -> None:
    int8_report_path(optimized_onnx).write_text(json.dumps(report, indent=1))


def read_int8_report(optimized_onnx: Path) -> dict:
    return json.loads(int8_report_path(optimized_onnx).read_text())


# ---- the graph pass --------------------------------------------------------------------------------------


@dataclass
class _Layer:
    """One node to quantize: a Conv, or a MatMul / Gemm whose constant weight is [K in, N out] (a Gemm's with transB:
    [N, K]); the modules its weight holds, and what calibration saw at their input."""

    node: gs.Node
    modules: tuple[str, ...]
    stats: LayerStats

    @property
    def weight(self) -> gs.Constant:
        return self.node.inputs[1]

    @property
    def transposed(self) -> bool:
        return self.node.op == "Gemm" and bool(self.node.attrs.get("transB", 0))

    @property
    def output_axis(self) -> int:
        """The weight's output-channel axis, as Q/DQ's `axis`."""
        return 0 if self.node.op == "Conv" or self.transposed else 1

    def by_input_channel(self, weight: np.ndarray) -> np.ndarray:
        """A linear layer's weight as [K, N], input channels first (a view, to scale or read by input channel)."""
        return weight.T if self.transposed else weight


def _modules_of(provenance: Provenance, weight_name: str) -> tuple[str, ...]:
    return tuple(part.parameter.removesuffix(".weight") for part in provenance.records.get(weight_name, ()))


def _skip_reason(node: gs.Node, modules: tuple[str, ...], calibration: Calibration, inputs: set[str]) -> str | None:
    if node.inputs[0].name in inputs:
        return f"reads the graph input {node.inputs[0].name} (outliers no LayerNorm can smooth)"
    if not modules:
        return "no provenance for its weight"
    missing = [m for m in modules if m not in calibration.layers]
    if missing:
        return f"{missing[0]} was not calibrated"
    weight = node.inputs[1].values
    if node.op == "Conv":
        if node.attrs.get("group", 1) != 1:
            return "grouped convolution"
        channels_in, channels_out = weight.shape[1], weight.shape[0]
    elif node.op == "Gemm" and node.attrs.get("transA", 0):
        return "Gemm with a transposed activation"
    else:
        channels_in, channels_out = weight.shape[::-1] if node.attrs.get("transB", 0) else weight.shape
    if min(channels_in, channels_out) < MIN_CHANNELS:
        return f"{min(channels_in, channels_out)} channels (< {MIN_CHANNELS})"
    rows = max(calibration.layers[m].rows for m in modules)
    if rows < MIN_ROWS:
        return f"{rows} activation rows per image (< {MIN_ROWS})"
    return None


def quantizable_layers(graph: gs.Graph, provenance: Provenance, calibration: Calibration
                       ) -> tuple[list[_Layer], dict[str, list[str]]]:
    """The layers to quantize, and the others by why not (reason -> node names)."""
    layers, skipped = [], {}
    inputs = {tensor.name for tensor in graph.inputs}
    for node in graph.nodes:
        if node.op not in QUANTIZED_OPS or len(node.inputs) < 2 or not isinstance(node.inputs[1], gs.Constant):
            continue
        if node.op == "MatMul" and node.inputs[1].values.ndim != 2:
            continue
        modules = _modules_of(provenance, node.inputs[1].name)
        reason = _skip_reason(node, modules, calibration, inputs)
        if reason:
            skipped.setdefault(reason, []).append(node.name)
            continue
        stats = calibration.layers[modules[0]]
        for module in modules[1:]:
            stats = stats.merged(calibration.layers[module])
        layers.append(_Layer(node, modules, stats))
    return layers, skipped


def _replace_constant(node: gs.Node, index: int, values: np.ndarray) -> None:
    """Gives `node` its own constant for input `index` (the old one may be shared)."""
    old = node.inputs[index]
    node.inputs[index] = gs.Constant(f"{old.name}_q{node.name}", np.ascontiguousarray(values))


def smooth_layer_norms(graph: gs.Graph, layers: list[_Layer], alpha: float = DEFAULT_ALPHA) -> int:
    """SmoothQuant, folded into the LayerNorms that feed only quantized linear layers; updates the layers'
    statistics to the smoothed activations. Returns how many LayerNorms were smoothed."""
    by_input: dict[str, list[_Layer]] = {}
    for layer in layers:
        if layer.node.op in ("MatMul", "Gemm"):
            by_input.setdefault(layer.node.inputs[0].name, []).append(layer)
    smoothed = 0
    for group in by_input.values():
        x = group[0].node.inputs[0]
        readers = [node for node in x.outputs if node.op != "Shape"]  # a Shape reads no values: scaling is moot
        if len(x.inputs) != 1 or x.inputs[0].op not in LAYER_NORM_OPS or len(readers) != len(group):
            continue
        norm = x.inputs[0]
        if len(norm.inputs) < 3 or not all(isinstance(t, gs.Constant) for t in norm.inputs[1:3]):
            continue
        a = np.max([layer.stats.channel_amax for layer in group], axis=0).astype(np.float64)
        w = np.max([np.abs(layer.by_input_channel(layer.weight.values.astype(np.float64))).max(axis=1)
                    for layer in group], axis=0)
        s = np.where((a > 0) & (w > 0), a ** alpha / np.maximum(w, 1e-12) ** (1 - alpha), 1.0)
        s = np.clip(s, *_SMOOTH_LIMITS)
        for index in (1, 2):
            values = norm.inputs[index].values
            _replace_constant(norm, index, (values.astype(np.float64) / s).astype(values.dtype))
        for layer in group:
            values = layer.weight.values
            scaled = layer.by_input_channel(values.astype(np.float64)) * s[:, None]
            _replace_constant(layer.node, 1, layer.by_input_channel(scaled).astype(values.dtype))  # its own inverse
            channels = layer.stats.channel_amax / s
            layer.stats = LayerStats(float(channels.max()), channels.astype(np.float32), layer.stats.rows)
        smoothed += 1
    return smoothed


def _qdq(graph: gs.Graph, tensor: gs.Tensor, scale: np.ndarray, axis: int | None, name: str) -> gs.Variable:
    """tensor (fp32) -> QuantizeLinear -> DequantizeLinear, symmetric int8; returns the dequantized fp32 tensor."""
    scale = np.asarray(scale, np.float32)
    zero = gs.Constant(f"{name}/zero", np.zeros(scale.shape, np.int8))
    scale_constant = gs.Constant(f"{name}/scale", scale)
    attrs = {} if axis is None else {"axis": axis}
    quantized = gs.Variable(f"{name}/int8", dtype=np.int8, shape=tensor.shape)
    dequantized = gs.Variable(f"{name}/dq", dtype=np.float32, shape=tensor.shape)
    graph.nodes.append(gs.Node("QuantizeLinear", f"{name}/Q", attrs, [tensor, scale_constant, zero], [quantized]))
    graph.nodes.append(gs.Node("DequantizeLinear", f"{name}/DQ", attrs, [quantized, scale_constant, zero],
                               [dequantized]))
    return dequantized


def _cast(graph: gs.Graph, tensor: gs.Tensor, dtype, name: str) -> gs.Variable:
    out = gs.Variable(name, dtype=dtype, shape=tensor.shape)
    to = {np.dtype(np.float32): 1, np.dtype(np.float16): 10}[np.dtype(dtype)]
    graph.nodes.append(gs.Node("Cast", f"{name}/Cast", {"to": to}, [tensor], [out]))
    return out


def insert_qdq(graph: gs.Graph, layers: list[_Layer]) -> None:
    """Q/DQ on each layer's activation (per tensor, shared by the layers reading one tensor) and weight (per
    output channel); a layer of an fp16 graph computes in fp32 between Casts (the module docstring says why)."""
    # The graph's precision is its weights' (a plugin's output tensor may carry no dtype).
    half = {layer.node.name: layer.weight.values.dtype == np.float16 for layer in layers}
    activations: dict[str, tuple[gs.Variable, float, bool]] = {}
    for layer in layers:
        x = layer.node.inputs[0]
        amax = max(layer.stats.amax, activations[x.name][1]) if x.name in activations else layer.stats.amax
        activations[x.name] = (x, amax, half[layer.node.name])
    dequantized = {}
    for name, (x, amax, x_half) in activations.items():
        source = _cast(graph, x, np.float32, f"{name}/act/fp32") if x_half else x
        dequantized[name] = _qdq(graph, source, np.float32(max(amax, 1e-8) / INT8_MAX), None, f"{name}/act")
    for layer in layers:
        node = layer.node
        weight = node.inputs[1].values.astype(np.float32)
        reduce = tuple(d for d in range(weight.ndim) if d != layer.output_axis)
        scale = np.maximum(np.abs(weight).max(axis=reduce), 1e-8) / INT8_MAX
        node.inputs[0] = dequantized[node.inputs[0].name]
        node.inputs[1] = _qdq(graph, gs.Constant(f"{node.name}/weight", weight), scale, layer.output_axis,
                              f"{node.name}/w")
        for index in range(2, len(node.inputs)):  # Conv and Gemm biases compute with the layer in fp32
            bias = node.inputs[index]
            if isinstance(bias, gs.Constant):
                node.inputs[index] = gs.Constant(f"{bias.name}_fp32{node.name}", bias.values.astype(np.float32))
        if half[node.name]:
            out = node.outputs[0]
            wide = gs.Variable(f"{out.name}/int8-layer", dtype=np.float32, shape=out.shape)
            node.outputs[0] = wide
            graph.nodes.append(gs.Node("Cast", f"{out.name}/Cast", {"to": 10}, [wide], [out]))


def quantize_graph(graph: gs.Graph, provenance: Provenance, calibration: Calibration,
                   alpha: float = DEFAULT_ALPHA) -> dict:
    """Smooths and quantizes `graph` in place (then cleaned and sorted); returns what it did: the layers quantized
    per op type, the LayerNorms smoothed, and the layers left in fp16 by reason."""
    layers, skipped = quantizable_layers(graph, provenance, calibration)
    smoothed = smooth_layer_norms(graph, layers, alpha) if alpha > 0 else 0
    insert_qdq(graph, layers)
    graph.cleanup().toposort()
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.node.op] = counts.get(layer.node.op, 0) + 1
    return {"version": QUANTIZE_VERSION, "alpha": alpha, "quantized": counts, "layer_norms_smoothed": smoothed,
            "modules": sorted(m for layer in layers for m in layer.modules),
            "skipped": {reason: len(nodes) for reason, nodes in skipped.items()}}


def describe(report: dict) -> str:
    """One line of what quantize_graph did."""
    quantized = ", ".join(f"{count} {op}" for op, count in sorted(report["quantized"].items())) or "nothing"
    kept = sum(report["skipped"].values())
    return (f"int8: {quantized} quantized, {report['layer_norms_smoothed']} LayerNorms smoothed "
            f"(alpha {report['alpha']}), {kept} layers kept in fp16")
