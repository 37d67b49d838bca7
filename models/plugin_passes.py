"""Plugin passes: the six patterns our CUDA plugins replace, what each match must satisfy, and its replacement.

Each pass is a list of declarative patterns (models.patterns) and one rewrite. The rewrite reads
everything from the graph (head count and head size from the weights and the reshape constants,
epsilon and attention scale from the nodes), checks that the kernels can take the match, and only
then replaces it by a node of the plugin-node contract (plugins.contract: op types `SDP*`, domain
`sdplugins`, attributes `plugin_version` and `plugin_namespace`, which TensorRT's ONNX parser maps to
our plugin creators). A match the kernels cannot take stays as it is and is reported as skipped with
its reason. Constants keep the graph's precision, so fp32 and fp16 exports both work. Every constant a rewrite
makes out of the graph's records where its values come from (models.provenance): the fused Q/K/V and K/V
projections which parameters sit where, a constant copied from another (a bias, a norm's scale) the other's record.

The same passes can emit TensorRT's own Stable Diffusion plugins instead (convention "tensorrt":
fMHA_V2, fMHCA, GroupNorm, LayerNorm, SplitGeLU, SeqLen2Spatial of libnvinfer_plugin, TensorRT 8.5/8.6,
in the conventions of NVIDIA's demoDiffusion 8.5), each where those plugins can take the match, so the
two can be measured against each other kernel for kernel.

Also here: the pass report stored beside each optimized ONNX artifact.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from models.patterns import (
    DimOf,
    Match,
    Op,
    Pattern,
    constant_values,
    find_matches,
    replace_match,
    scalar_value,
    shape_elements,
)
from models.provenance import Provenance
from plugins.contract import (  # noqa: F401  (CONVENTIONS, PLUGIN_OP_KEYS: also imported from here)
    CONVENTIONS,
    HEAD_SIZE_MULTIPLE,
    LAYOUT_NCHW,
    LAYOUT_NHWC,
    MAX_HEAD_SIZE,
    OURS,
    PLUGIN_KEYS,
    PLUGIN_OP_KEYS,
    TENSORRT,
    TENSORRT_FMHA_HEAD_SIZES,
    TENSORRT_FMHCA_MAX_KEYS,
    TENSORRT_GROUP_NORM_DEFAULT_TILE,
    TENSORRT_GROUP_NORM_GROUPS,
    TENSORRT_GROUP_NORM_TILES,
    TENSORRT_SPLIT_GELU_WIDTHS,
    Convention,
)
from plugins.contract import convention as plugin_convention

REPORT_SUFFIX = ".passes.json"


class Skip(Exception):
    """A match the kernels cannot take; the message says why."""


# ---- the pass report -------------------------------------------------------------------------------

@dataclass
class PassResult:
    replaced: int = 0
    skipped_reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"replaced": self.replaced, "skipped": len(self.skipped_reasons),
                "skipped_reasons": list(self.skipped_reasons)}


def empty_report() -> dict[str, dict]:
    return {key: PassResult().as_dict() for key in PLUGIN_KEYS}


def pass_report_path(optimized_onnx: Path) -> Path:
    return optimized_onnx.with_name(optimized_onnx.name + REPORT_SUFFIX)


def write_pass_report(optimized_onnx: Path, report: dict[str, dict]) -> None:
    pass_report_path(optimized_onnx).write_text(json.dumps(report, indent=1))


def read_pass_report(optimized_onnx: Path) -> dict[str, dict]:
    """{"<plugin key>": {"replaced": N, "skipped": M, "skipped_reasons": [...]}} for all six keys."""
    return json.loads(pass_report_path(optimized_onnx).read_text())


def format_report_line(stage: str, report: dict[str, dict]) -> str:
    counts = ", ".join(f"{key} {report[key]['replaced']}" + (f" (skipped {report[key]['skipped']})"
                                                              if report[key]["skipped"] else "")
                       for key in PLUGIN_KEYS)
    return f"[plugins] {stage}: {counts}"


# ---- passes ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PluginPass:
    """Patterns (tried in order) and the rewrite that checks a match and replaces it, or raises Skip."""

    key: str
    patterns: tuple[Pattern, ...]
    rewrite: Callable[[gs.Graph, Match, str, Provenance | None], None]

    def apply(self, graph: gs.Graph, convention: str = OURS, provenance: Provenance | None = None) -> PassResult:
        """Rewrite every match the kernels can take; the constants made are recorded in `provenance`."""
        contract = plugin_convention(convention)  # ValueError for an unknown one
        result = PassResult()
        skipped_nodes: set[int] = set()  # a skipped match is not reported again by a later, smaller variant
        for pattern in self.patterns:
            for match in find_matches(graph, pattern):
                nodes = {id(n) for n in match.removable_nodes()}
                if nodes & skipped_nodes:
                    continue
                try:
                    if not contract.has(self.key):  # the transformer keys: TensorRT's bundled plugins lack them
                        raise Skip(f"TensorRT 8.6 has no {self.key} plugin")
                    self.rewrite(graph, match, convention, provenance)
                except Skip as skip:
                    result.skipped_reasons.append(f"{match.root.name}: {skip}")
                    skipped_nodes |= nodes
                else:
                    result.replaced += 1
        return result


class _Builder:
    """New nodes and tensors for one replacement, named after the tensor the match produces; where the new
    constants' values come from goes into `provenance`."""

    def __init__(self, match: Match, dtype, convention: str, provenance: Provenance | None):
        self.base = match.output.name
        self.dtype = dtype
        self.convention = convention
        self.contract: Convention = plugin_convention(convention)
        self.provenance = provenance
        self.nodes: list[gs.Node] = []

    def tensor(self, suffix: str, shape=None) -> gs.Variable:
        return gs.Variable(f"{self.base}/{suffix}", dtype=self.dtype, shape=shape)

    def constant(self, suffix: str, values: np.ndarray, source: gs.Tensor | None = None) -> gs.Constant:
        """A new constant; made from the constant `source`, it takes its provenance where its values are exactly
        the source's (reshaped, not cast or repeated)."""
        constant = gs.Constant(f"{self.base}/{suffix}", np.ascontiguousarray(values))
        original = constant_values(source)
        if self.provenance is not None and original is not None and original.dtype == values.dtype \
                and np.array_equal(original.reshape(-1), values.reshape(-1)):
            self.provenance.copy(constant.name, source.name)
        return constant

    def stacked(self, suffix: str, values: np.ndarray, sources: list[gs.Tensor | None], view: tuple[int, ...],
                axis: int) -> gs.Constant:
        """A new constant that holds `sources` side by side: the i-th at index i of `axis` of `view`."""
        constant = gs.Constant(f"{self.base}/{suffix}", np.ascontiguousarray(values))
        if self.provenance is not None:
            self.provenance.stack(constant.name, [None if s is None else s.name for s in sources], view, axis)
        return constant

    def node(self, op: str, suffix: str, inputs: list[gs.Tensor], output: gs.Tensor, **attrs) -> gs.Tensor:
        self.nodes.append(gs.Node(op=op, name=f"{self.base}/{suffix}", inputs=inputs, outputs=[output], attrs=attrs))
        return output

    def plugin(self, key: str, inputs: list[gs.Tensor], output: gs.Tensor, **fields) -> None:
        """The node of plugin `key` in the convention's op type, domain, version and namespace
        (plugins.contract); `fields` must be the contract's fields of that plugin."""
        contract, op = self.contract, self.contract.op(key)
        if tuple(fields) != contract.fields[key]:
            raise ValueError(f"{op} takes the fields {contract.fields[key]}, not {tuple(fields)}")
        attrs = {**fields, "plugin_version": contract.version, "plugin_namespace": contract.namespace}
        self.nodes.append(gs.Node(op=op, name=f"{self.base}/{op}", inputs=inputs, outputs=[output],
                                  domain=contract.domain, attrs=attrs))


def _dtype(tensor: gs.Tensor, fallback: np.ndarray):
    return tensor.dtype if tensor.dtype is not None else fallback.dtype


def _rank(tensor: gs.Tensor) -> int | None:
    return None if tensor.shape is None else len(tensor.shape)


def _dim(tensor: gs.Tensor, axis: int):
    """A dimension from shape inference: an int, a symbolic name, or None."""
    return None if tensor.shape is None else tensor.shape[axis]


# ---- attention -------------------------------------------------------------------------------------

def _attention_ops(query_source: str, key_value_source: str) -> dict[str, Op]:
    ops: dict[str, Op] = {}
    for p, source, perm in (("q", query_source, (0, 2, 1, 3)), ("k", key_value_source, (0, 2, 3, 1)),
                            ("v", key_value_source, (0, 2, 1, 3))):
        ops[f"{p}_proj"] = Op("MatMul", (source, f"w{p}"))
        ops[f"{p}_bias"] = Op("Add", (f"{p}_proj", f"b{p}"), optional=f"{p}_proj")
        ops[f"{p}_heads"] = Op("Reshape", (f"{p}_bias", f"{p}_shape"))
        ops[f"{p}_t"] = Op("Transpose", (f"{p}_heads",), attrs={"perm": perm})
    # SDPA exports scale q and k by sqrt(scale) each; other exports scale the scores once.
    ops["q_scaled"] = Op("Mul", ("q_t", "q_scale"), optional="q_t")
    ops["k_scaled"] = Op("Mul", ("k_t", "k_scale"), optional="k_t")
    ops["scores"] = Op("MatMul", ("q_scaled", "k_scaled"))
    ops["scores_scaled"] = Op(("Mul", "Div"), ("scores", "score_scale"), optional="scores")
    ops["probs"] = Op("Softmax", ("scores_scaled",), where=lambda n: n.attrs.get("axis", -1) in (-1, 3))
    ops["weighted"] = Op("MatMul", ("probs", "v_t"))
    ops["output"] = Op("Transpose", ("weighted",), attrs={"perm": (0, 2, 1, 3)})
    return ops


_ATTENTION_CONSTANTS = frozenset({"wq", "wk", "wv", "bq", "bk", "bv", "q_scale", "k_scale", "score_scale"})

SELF_ATTENTION = Pattern("self-attention", _attention_ops("x", "x"), "output", _ATTENTION_CONSTANTS)
CROSS_ATTENTION = Pattern("cross-attention", _attention_ops("x", "context"), "output", _ATTENTION_CONSTANTS,
                          where=lambda m: m.tensor("x") is not m.tensor("context"))


def _attention_heads(match: Match) -> tuple[int, int]:
    """(heads, head size), read from each projection's weight and its reshape to [B, S, H, D]."""
    found = set()
    for p in "qkv":
        columns = constant_values(match.tensor(f"w{p}")).shape[-1]
        elements = shape_elements(match.tensor(f"{p}_shape"))
        if elements is None or len(elements) != 4:
            raise Skip(f"the {p} reshape is not to [B, S, heads, head size]")
        heads, size = elements[2], elements[3]
        if heads == -1 and isinstance(size, int) and size > 0:
            heads = columns // size
        if size == -1 and isinstance(heads, int) and heads > 0:
            size = columns // heads
        if not (isinstance(heads, int) and isinstance(size, int) and heads > 0 and size > 0):
            raise Skip(f"the head count of the {p} reshape is not a constant")
        if heads * size != columns:
            raise Skip(f"the {p} reshape ({heads} heads x {size}) does not split its {columns} projection columns")
        found.add((heads, size))
    if len(found) != 1:
        raise Skip(f"q, k and v disagree on heads and head size: {sorted(found)}")
    return found.pop()


def _check_head_size(size: int, convention: str, cross: bool) -> None:
    """Ours take any multiple of 8 up to 256, and so (padding it to 64, 128 or 256) does TensorRT's
    fMHCA; TensorRT's fMHA_V2 has kernels for a few head sizes only."""
    if convention == TENSORRT and not cross:
        if size not in TENSORRT_FMHA_HEAD_SIZES:
            raise Skip(f"TensorRT's fMHA_V2 has no kernel for head size {size}")
    elif size % HEAD_SIZE_MULTIPLE or size > MAX_HEAD_SIZE:
        raise Skip(f"head size {size} is not a multiple of {HEAD_SIZE_MULTIPLE} up to {MAX_HEAD_SIZE}")


def _check_tensorrt_scale(scale: float, size: int) -> None:
    if not math.isclose(scale * math.sqrt(size), 1.0, rel_tol=1e-3):
        raise Skip(f"TensorRT's attention plugins scale by 1/sqrt({size}), this attention by {scale:.6g}")


def _attention_scale(match: Match) -> float:
    """The softmax scale the graph applies, as the product of its scalar factors."""
    scale = 1.0
    for op_name, var in (("q_scaled", "q_scale"), ("k_scaled", "k_scale"), ("scores_scaled", "score_scale")):
        node = match.node(op_name)
        if node is None:
            continue
        value = scalar_value(match.tensor(var))
        if value is None:
            raise Skip(f"the attention scale ({op_name}) is not a scalar")
        scale *= 1.0 / value if node.op == "Div" else value
    return scale


def _projection(match: Match, p: str, heads: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Weight [C, H, D] and bias [H, D] (zeros when the projection has none) of projection p."""
    weight = constant_values(match.tensor(f"w{p}"))
    if weight.ndim != 2:
        raise Skip(f"the {p} projection weight is not a matrix")
    bias = constant_values(match.tensor(f"b{p}")) if match.node(f"{p}_bias") is not None else None
    if bias is not None and bias.size != heads * size:
        raise Skip(f"the {p} bias is not one value per projection column")
    bias = np.zeros(heads * size, weight.dtype) if bias is None else bias.astype(weight.dtype)
    return weight.reshape(-1, heads, size), bias.reshape(heads, size)


def _has_bias(match: Match, projections: str) -> bool:
    return any(match.node(f"{p}_bias") is not None for p in projections)


def _sources(match: Match, projections: str) -> tuple[list[gs.Tensor], list[gs.Tensor | None]]:
    """The weight and bias constants of these projections (None for a projection without a bias)."""
    return ([match.tensor(f"w{p}") for p in projections],
            [match.tensor(f"b{p}") if match.node(f"{p}_bias") is not None else None for p in projections])


def _fused_projection(b: _Builder, name: str, source: gs.Tensor, weights, biases, with_bias: bool,
                      shape: list[int], sources: tuple[list[gs.Tensor], list[gs.Tensor | None]]) -> gs.Tensor:
    """source @ [W_0 | W_1 | ...] with the columns interleaved per head, reshaped to `shape` (0 copies B and S).

    weights are [C, H, D] and biases [H, D]; with n of them the output is [B, S, H, n, D] in memory. `sources`
    (_sources) are the constants they come from: the fused weight, seen as [C, H, n, D], holds the i-th at index i of
    its third axis, the bias, seen as [H, n, D], at index i of its second.
    """
    (channels, heads, size), count = weights[0].shape, len(weights)
    columns = heads * count * size
    fused = np.stack(weights, axis=2).reshape(channels, columns)
    flat_shape = None if source.shape is None else [*source.shape[:2], columns]
    weight = b.stacked(f"{name}/weight", fused, sources[0], (channels, heads, count, size), 2)
    out = b.node("MatMul", f"{name}/MatMul", [source, weight], b.tensor(f"{name}/flat", flat_shape))
    if with_bias:
        bias = np.stack(biases, axis=1).reshape(columns)
        out = b.node("Add", f"{name}/Add", [out, b.stacked(f"{name}/bias", bias, sources[1], (heads, count, size), 1)],
                     b.tensor(f"{name}/biased", flat_shape))
    out_shape = None if source.shape is None else [*source.shape[:2], *shape[2:]]
    return b.node("Reshape", f"{name}/Reshape", [out, b.constant(f"{name}/shape", np.array(shape, dtype=np.int64))],
                  b.tensor(f"{name}/heads", out_shape))


def _require_sequence(tensor: gs.Tensor, what: str) -> None:
    if _rank(tensor) != 3:
        raise Skip(f"{what} is not [B, S, C]")


def _rewrite_self_attention(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x = match.tensor("x")
    _require_sequence(x, "the attention input")
    heads, size = _attention_heads(match)
    _check_head_size(size, convention, cross=False)
    scale = _attention_scale(match)
    if convention == TENSORRT:
        _check_tensorrt_scale(scale, size)
    projections = [_projection(match, p, heads, size) for p in "qkv"]
    b = _Builder(match, _dtype(x, projections[0][0]), convention, provenance)
    qkv = _fused_projection(b, "qkv", x, [w for w, _ in projections], [bias for _, bias in projections],
                            _has_bias(match, "qkv"), [0, 0, heads, 3, size], _sources(match, "qkv"))
    if convention == OURS:
        b.plugin("fMHA", [qkv], match.output, scale=scale)
    else:
        b.plugin("fMHA", [qkv], match.output)
    replace_match(graph, match, b.nodes)


def _rewrite_cross_attention(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x, context = match.tensor("x"), match.tensor("context")
    _require_sequence(x, "the attention input")
    _require_sequence(context, "the attention context")
    heads, size = _attention_heads(match)
    _check_head_size(size, convention, cross=True)
    scale = _attention_scale(match)
    if convention == TENSORRT:
        keys = _dim(context, 1)
        if not isinstance(keys, int) or keys > TENSORRT_FMHCA_MAX_KEYS:
            raise Skip(f"TensorRT's fMHCA takes up to {TENSORRT_FMHCA_MAX_KEYS} keys, this context has {keys}")
        _check_tensorrt_scale(scale, size)
    (wq, bq), (wk, bk), (wv, bv) = (_projection(match, p, heads, size) for p in "qkv")
    b = _Builder(match, _dtype(x, wq), convention, provenance)
    q = _fused_projection(b, "q", x, [wq], [bq], _has_bias(match, "q"), [0, 0, heads, size], _sources(match, "q"))
    kv = _fused_projection(b, "kv", context, [wk, wv], [bk, bv], _has_bias(match, "kv"), [0, 0, heads, 2, size],
                           _sources(match, "kv"))
    if convention == OURS:
        b.plugin("fMHCA", [q, kv], match.output, scale=scale)
    else:
        b.plugin("fMHCA", [q, kv], match.output)
    replace_match(graph, match, b.nodes)


# Attention over Q, K and V made elsewhere: SD3's joint attention (image and text tokens joined), MMDiT-X's attn2 and
# Flux's attentions normalize (and rotate) Q and K after the projections, so SELF_ATTENTION's fused projection cannot
# stand in. Heads first: [B, H, S, D] tensors, SDPA's export transposing K itself (SD3's, a Concat before it); sequence
# first: [B, S, H, D] tensors transposed for SDPA (Flux's, the two transposes of K folded into one).
def _attention_core(q: str, k: str, v: str, transposes: dict[str, Op]) -> dict[str, Op]:
    return {
        **transposes,
        "q_scaled": Op("Mul", (q, "q_scale"), optional=q),
        "k_scaled": Op("Mul", (k, "k_scale"), optional=k),
        "scores": Op("MatMul", ("q_scaled", "k_scaled")),
        "scores_scaled": Op(("Mul", "Div"), ("scores", "score_scale"), optional="scores"),
        "probs": Op("Softmax", ("scores_scaled",), where=lambda n: n.attrs.get("axis", -1) in (-1, 3)),
        "weighted": Op("MatMul", ("probs", v)),
        "output": Op("Transpose", ("weighted",), attrs={"perm": (0, 2, 1, 3)}),
    }


def _one_shape(match: Match) -> bool:
    """Q, K and V of one known shape: self-attention (cross-attention's keys are another sequence)."""
    q, k, v = (match.tensor(name) for name in "qkv")
    return q.shape is not None and _rank(q) == 4 and q.shape == k.shape == v.shape


_SCALES = frozenset({"q_scale", "k_scale", "score_scale"})
HEADS_FIRST_ATTENTION = Pattern("heads-first-attention", _attention_core("q", "k_t", "v", {
    "k_t": Op("Transpose", ("k",), attrs={"perm": (0, 1, 3, 2)})}), "output", _SCALES, where=_one_shape)
SEQUENCE_FIRST_ATTENTION = Pattern("sequence-first-attention", _attention_core("q_t", "k_t", "v_t", {
    "q_t": Op("Transpose", ("q",), attrs={"perm": (0, 2, 1, 3)}),
    "k_t": Op("Transpose", ("k",), attrs={"perm": (0, 2, 3, 1)}),
    "v_t": Op("Transpose", ("v",), attrs={"perm": (0, 2, 1, 3)})}), "output", _SCALES, where=_one_shape)


def _rewrite_stacked_attention(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    """Q, K and V stacked into fMHA's [B, S, H, 3, D]: heads first, one Concat of the three and one Transpose;
    sequence first, one Concat."""
    q, k, v = (match.tensor(name) for name in "qkv")
    heads_first = match.pattern is HEADS_FIRST_ATTENTION
    batch, heads, length, size = (q.shape[i] for i in ((0, 1, 2, 3) if heads_first else (0, 2, 1, 3)))
    if not (isinstance(heads, int) and isinstance(size, int)):
        raise Skip("the head count and head size are not known")
    _check_head_size(size, convention, cross=False)
    scale = _attention_scale(match)
    if convention == TENSORRT:
        _check_tensorrt_scale(scale, size)
    b = _Builder(match, q.dtype, convention, provenance)
    axis = 0 if heads_first else 3
    axes = b.constant("axes", np.array([axis], dtype=np.int64))
    parts = [b.node("Unsqueeze", f"Unsqueeze_{p}", [t, axes],
                    b.tensor(f"{p}_stacked", [*t.shape[:axis], 1, *t.shape[axis:]])) for p, t in zip("qkv", (q, k, v))]
    qkv_shape = [batch, length, heads, 3, size]
    if heads_first:
        stacked = b.node("Concat", "Concat", parts, b.tensor("stacked", [3, *q.shape]), axis=0)
        qkv = b.node("Transpose", "Transpose", [stacked], b.tensor("qkv", qkv_shape), perm=[1, 3, 2, 0, 4])
    else:
        qkv = b.node("Concat", "Concat", parts, b.tensor("qkv", qkv_shape), axis=3)
    if convention == OURS:
        b.plugin("fMHA", [qkv], match.output, scale=scale)
    else:
        b.plugin("fMHA", [qkv], match.output)
    replace_match(graph, match, b.nodes)


def _rewrite_attention(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    rewrite = _rewrite_self_attention if match.pattern is SELF_ATTENTION else _rewrite_stacked_attention
    rewrite(graph, match, convention, provenance)


# ---- GroupNorm (+SiLU) -----------------------------------------------------------------------------

def _with_silu(ops: dict[str, Op], last: str) -> dict[str, Op]:
    return {**ops, "sigmoid": Op("Sigmoid", (last,)), "silu": Op("Mul", (last, "sigmoid"))}


_GROUP_NORM_EXPORTED = {
    "grouped": Op("Reshape", ("x", "group_shape")),
    "normalized": Op("InstanceNormalization", ("grouped", "instance_scale", "instance_bias")),
    "x_shape": Op("Shape", ("x",), where=lambda n: not {"start", "end"} & set(n.attrs), shared=True),
    "restored": Op("Reshape", ("normalized", "x_shape")),
    "scaled": Op("Mul", ("restored", "gamma")),
    "shifted": Op("Add", ("scaled", "beta")),
}
_GROUP_NORM_NATIVE = {"shifted": Op("GroupNormalization", ("x", "gamma", "beta"))}
_GROUP_NORM_CONSTANTS = frozenset({"group_shape", "instance_scale", "instance_bias", "gamma", "beta"})

GROUP_NORM_PATTERNS = (
    Pattern("group-norm+silu", _with_silu(_GROUP_NORM_EXPORTED, "shifted"), "silu", _GROUP_NORM_CONSTANTS),
    Pattern("group-norm-native+silu", _with_silu(_GROUP_NORM_NATIVE, "shifted"), "silu", _GROUP_NORM_CONSTANTS),
    Pattern("group-norm", _GROUP_NORM_EXPORTED, "shifted", _GROUP_NORM_CONSTANTS),
    Pattern("group-norm-native", _GROUP_NORM_NATIVE, "shifted", _GROUP_NORM_CONSTANTS),
)


def _per_channel(values: np.ndarray, channels: int, rank: int, what: str) -> np.ndarray:
    """An affine constant broadcast over [B, C, ...] of `rank` ([C, 1, 1] for NCHW) as [C]."""
    shape = list(values.shape)
    while len(shape) > rank - 1 and shape[0] == 1:
        shape.pop(0)
    if shape != [channels] + [1] * (rank - 2):
        raise Skip(f"the {what} {list(values.shape)} is not one value per channel")
    return values.reshape(channels)


def _group_norm_parameters(graph: gs.Graph, match: Match, channels: int, rank: int):
    """(groups, epsilon, gamma [C], beta [C]) of either form."""
    gamma, beta = constant_values(match.tensor("gamma")), constant_values(match.tensor("beta"))
    node = match.node("normalized") or match.node("shifted")
    epsilon = float(node.attrs.get("epsilon", 1e-5))
    if node.op == "GroupNormalization":
        groups = int(node.attrs["num_groups"])
        if groups < 1 or channels % groups:
            raise Skip(f"{groups} groups do not divide {channels} channels")
        # Opset 18 gives scale and bias per group; opset 21 per channel.
        per_group = graph.opset < 21
        expected = groups if per_group else channels
        if gamma.size != expected or beta.size != expected:
            raise Skip(f"scale and bias have {gamma.size} and {beta.size} values, expected {expected}")
        if per_group:
            gamma, beta = (np.repeat(v.reshape(-1), channels // groups) for v in (gamma, beta))
        return groups, epsilon, gamma.reshape(channels), beta.reshape(channels)
    group_shape = constant_values(match.tensor("group_shape")).reshape(-1).tolist()
    if len(group_shape) != 3 or group_shape[0] < 0 or group_shape[2] != -1:
        raise Skip(f"the grouping reshape {group_shape} is not [B, groups, -1]")
    groups = int(group_shape[1])
    if groups < 1 or channels % groups:
        raise Skip(f"{groups} groups do not divide {channels} channels")
    instance_scale = constant_values(match.tensor("instance_scale"))
    instance_bias = constant_values(match.tensor("instance_bias"))
    if not (np.all(instance_scale == 1) and np.all(instance_bias == 0)):
        raise Skip("the InstanceNormalization has an affine of its own")
    return (groups, epsilon, _per_channel(gamma, channels, rank, "scale"),
            _per_channel(beta, channels, rank, "shift"))


def _check_tensorrt_group_norm(x: gs.Tensor, channels: int, groups: int) -> None:
    if x.dtype != np.float16:
        raise Skip("TensorRT's GroupNorm takes fp16 only")
    if groups != TENSORRT_GROUP_NORM_GROUPS:
        raise Skip(f"TensorRT's GroupNorm has {TENSORRT_GROUP_NORM_GROUPS} groups, this one {groups}")
    per_block = TENSORRT_GROUP_NORM_TILES.get(channels, TENSORRT_GROUP_NORM_DEFAULT_TILE)
    if channels % per_block or per_block % (channels // groups):
        raise Skip(f"TensorRT's GroupNorm kernels do not tile {channels} channels")


def _rewrite_group_norm(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x = match.tensor("x")
    rank, channels = _rank(x), _dim(x, 1) if _rank(x) else None
    if rank not in (3, 4):
        raise Skip(f"the input is rank {rank}, not [B, C, H, W] or [B, C, HW]")
    if not isinstance(channels, int):
        raise Skip("the channel count is not known")
    groups, epsilon, gamma, beta = _group_norm_parameters(graph, match, channels, rank)
    silu = int(match.node("silu") is not None)
    if convention == TENSORRT:
        _check_tensorrt_group_norm(x, channels, groups)
    b = _Builder(match, _dtype(x, gamma), convention, provenance)
    # TensorRT's GroupNorm reads gamma and beta as float32.
    affine_dtype = b.dtype if convention == OURS else np.float32
    gamma_c, beta_c = (b.constant(name, v.astype(affine_dtype), match.tensor(name))
                       for name, v in (("gamma", gamma), ("beta", beta)))

    def group_norm(source: gs.Tensor, output: gs.Tensor) -> None:
        if convention == OURS:
            b.plugin("GroupNorm", [source, gamma_c, beta_c], output, num_groups=groups, epsilon=epsilon, silu=silu)
        else:
            b.plugin("GroupNorm", [source, gamma_c, beta_c], output, epsilon=epsilon, bSwish=silu)

    if rank == 4:
        group_norm(x, match.output)
    else:  # [B, C, HW] (the VAE's attention) runs as [B, C, HW, 1]
        axes = b.constant("axes", np.array([3]))
        shape4 = [*x.shape, 1]
        x4 = b.node("Unsqueeze", "Unsqueeze", [x, axes], b.tensor("x4", shape4))
        y4 = b.tensor("y4", shape4)
        group_norm(x4, y4)
        b.node("Squeeze", "Squeeze", [y4, axes], match.output)
    replace_match(graph, match, b.nodes)


# ---- LayerNorm -------------------------------------------------------------------------------------

def _reduces_last_axis(node: gs.Node) -> bool:
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:  # opset 18 moved axes to an input
        axes = constant_values(node.inputs[1])
    if axes is None or node.attrs.get("keepdims", 1) != 1:
        return False
    axes = np.asarray(axes).reshape(-1).tolist()
    rank = _rank(node.inputs[0])
    return axes == [-1] or (rank is not None and axes == [rank - 1])


def _close(tensor: gs.Tensor | None, value: float) -> bool:
    actual = scalar_value(tensor)
    return actual is not None and math.isclose(actual, value, rel_tol=1e-3)


_LAYER_NORM_DECOMPOSED = {
    "mean": Op("ReduceMean", ("x",), where=_reduces_last_axis, exact_inputs=False),
    "centered": Op("Sub", ("x", "mean")),
    "squared": Op("Pow", ("centered", "two")),
    "variance": Op("ReduceMean", ("squared",), where=_reduces_last_axis, exact_inputs=False),
    "variance_eps": Op("Add", ("variance", "epsilon")),
    "std": Op("Sqrt", ("variance_eps",)),
    "normalized": Op("Div", ("centered", "std")),
    "scaled": Op("Mul", ("normalized", "gamma")),
    "output": Op("Add", ("scaled", "beta")),
}

LAYER_NORM_PATTERNS = (
    Pattern("layer-norm", {"output": Op("LayerNormalization", ("x", "gamma", "beta"))}, "output",
            frozenset({"gamma", "beta"})),
    Pattern("layer-norm-no-bias", {"output": Op("LayerNormalization", ("x", "gamma"))}, "output",
            frozenset({"gamma"})),
    Pattern("layer-norm-decomposed", _LAYER_NORM_DECOMPOSED, "output", frozenset({"two", "epsilon", "gamma", "beta"}),
            where=lambda m: _close(m.tensor("two"), 2.0)),
)


def _rewrite_layer_norm(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x = match.tensor("x")
    node = match.root
    if node.op == "LayerNormalization":
        axis, rank = node.attrs.get("axis", -1), _rank(x)
        if axis != -1 and (rank is None or axis != rank - 1):
            raise Skip(f"it normalizes from axis {axis}, not over the last dimension only")
        epsilon = float(node.attrs.get("epsilon", 1e-5))
    else:
        epsilon = scalar_value(match.tensor("epsilon"))
        if epsilon is None:
            raise Skip("epsilon is not a scalar")
    gamma = constant_values(match.tensor("gamma"))
    beta = constant_values(match.tensor("beta")) if match.tensor("beta") is not None else np.zeros_like(gamma)
    width = _dim(x, -1) if _rank(x) else None
    if not isinstance(width, int):
        raise Skip("the normalized width is not known")
    if gamma.size != width or beta.size != width:
        raise Skip(f"scale and shift have {gamma.size} and {beta.size} values for a width of {width}")
    b = _Builder(match, _dtype(x, gamma), convention, provenance)
    inputs = [x, b.constant("gamma", gamma.reshape(width).astype(b.dtype), match.tensor("gamma")),
              b.constant("beta", beta.reshape(width).astype(b.dtype), match.tensor("beta"))]
    if convention == OURS:
        b.plugin("LayerNorm", inputs, match.output, epsilon=epsilon)
    else:
        b.plugin("LayerNorm", inputs, match.output, epsilon=epsilon, axis=-1)
    replace_match(graph, match, b.nodes)


# ---- SplitGeLU (GEGLU) -----------------------------------------------------------------------------

def _gelu_erf(gate: str) -> dict[str, Op]:
    """gate * (erf(gate / sqrt 2) + 1) * 0.5, as torch exports F.gelu."""
    return {
        "gate_scaled": Op(("Div", "Mul"), (gate, "erf_scale")),
        "erf": Op("Erf", ("gate_scaled",)),
        "erf_plus_one": Op("Add", ("erf", "one")),
        "gate_times": Op("Mul", (gate, "erf_plus_one")),
        "gelu": Op("Mul", ("gate_times", "half")),
    }


def _gelu_native(gate: str) -> dict[str, Op]:
    return {"gelu": Op("Gelu", (gate,), where=lambda n: n.attrs.get("approximate", "none") == "none")}


def _is_erf_gelu(match: Match) -> bool:
    if match.node("erf") is None:
        return True  # the native Gelu
    divides = match.node("gate_scaled").op == "Div"
    return (_close(match.tensor("erf_scale"), math.sqrt(2) if divides else 1 / math.sqrt(2))
            and _close(match.tensor("one"), 1.0) and _close(match.tensor("half"), 0.5))


def _geglu_pattern(name: str, halves: dict[str, Op], value: str, gate: str, gelu) -> Pattern:
    """(x + bias) split in halves along the last axis: value * gelu(gate)."""
    ops = {"biased": Op("Add", ("x", "bias"), optional="x"), **halves, **gelu(gate),
           "output": Op("Mul", (value, "gelu"))}
    return Pattern(name, ops, "output", frozenset({"bias", "erf_scale", "one", "half"}), where=_is_erf_gelu)


_SLICES = {"value": Op("Slice", ("biased",), exact_inputs=False), "gate": Op("Slice", ("biased",), exact_inputs=False)}
_SPLIT = {"halves": Op("Split", ("biased",), exact_inputs=False)}

SPLIT_GELU_PATTERNS = (
    _geglu_pattern("geglu-slice", _SLICES, "value", "gate", _gelu_erf),
    _geglu_pattern("geglu-split", _SPLIT, "halves:0", "halves:1", _gelu_erf),
    _geglu_pattern("geglu-slice-gelu", _SLICES, "value", "gate", _gelu_native),
    _geglu_pattern("geglu-split-gelu", _SPLIT, "halves:0", "halves:1", _gelu_native),
)


def _slice_range(node: gs.Node, width: int, rank: int) -> tuple[int, int] | None:
    """[start, end) of a Slice along the last axis with step 1, else None."""
    starts, ends = constant_values(node.inputs[1]), constant_values(node.inputs[2])
    axes = constant_values(node.inputs[3]) if len(node.inputs) > 3 else np.array([0])
    steps = constant_values(node.inputs[4]) if len(node.inputs) > 4 else np.array([1])
    if any(v is None or v.size != 1 for v in (starts, ends, axes, steps)):
        return None
    if int(axes[0]) not in (-1, rank - 1) or int(steps[0]) != 1:
        return None
    start, end = (int(v[0]) + width if int(v[0]) < 0 else int(v[0]) for v in (starts, ends))
    return min(start, width), min(end, width)


def _split_halves(node: gs.Node, width: int, rank: int) -> bool:
    if node.attrs.get("axis", 0) not in (-1, rank - 1) or len(node.outputs) != 2:
        return False
    sizes = constant_values(node.inputs[1]) if len(node.inputs) > 1 else None
    return sizes is None or sizes.reshape(-1).tolist() == [width // 2, width // 2]


def _rewrite_split_gelu(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x, bias = match.tensor("x"), constant_values(match.tensor("bias"))
    rank, width = _rank(x), _dim(x, -1) if _rank(x) else None
    if not isinstance(width, int) or width % 2:
        raise Skip(f"the last dimension ({width}) is not a known even width")
    half = width // 2
    if match.node("halves") is not None:
        if not _split_halves(match.node("halves"), width, rank):
            raise Skip("the Split does not cut the last dimension into two halves")
    elif (_slice_range(match.node("value"), width, rank), _slice_range(match.node("gate"), width, rank)) != \
            ((0, half), (half, width)):
        raise Skip("the slices are not value = first half, gate = second half of the last dimension")
    if bias is not None and bias.size != width:
        raise Skip(f"the bias has {bias.size} values for a width of {width}")
    if convention == TENSORRT and (rank != 3 or half not in TENSORRT_SPLIT_GELU_WIDTHS):
        raise Skip(f"TensorRT's SplitGeLU takes [B, S, 2N] with N in {TENSORRT_SPLIT_GELU_WIDTHS}, not N = {half}")
    b = _Builder(match, x.dtype or (bias.dtype if bias is not None else np.float32), convention, provenance)
    source = match.tensor("bias")
    if convention == OURS:
        bias = np.zeros(width, b.dtype) if bias is None else bias.reshape(width).astype(b.dtype)
        b.plugin("SplitGeLU", [x, b.constant("bias", bias, source)], match.output)
    else:  # TensorRT's SplitGeLU takes the biased input
        biased = x if bias is None else b.node("Add", "Add", [x, b.constant("bias", bias.reshape(width), source)],
                                               b.tensor("biased", x.shape))
        b.plugin("SplitGeLU", [biased], match.output)
    replace_match(graph, match, b.nodes)


# ---- Seq2Spatial -----------------------------------------------------------------------------------

_TO_NCHW = {"perm": (0, 3, 1, 2)}
SEQ2SPATIAL_PATTERNS = (
    # Linear proj_out (SD 2.x): proj_out bias, to NCHW, then the block's NCHW residual.
    Pattern("seq2spatial-nchw-residual", {
        "biased": Op("Add", ("x", "bias")),
        "spatial": Op("Reshape", ("biased", "spatial_shape")),
        "transposed": Op("Transpose", ("spatial",), attrs=_TO_NCHW),
        "output": Op("Add", ("transposed", "residual")),
    }, "output", frozenset({"bias"})),
    # Convolutional proj_out (SD 1.x): the last feed-forward's bias and the sequence residual, then to NCHW.
    Pattern("seq2spatial-sequence-residual", {
        "biased": Op("Add", ("x", "bias")),
        "summed": Op("Add", ("biased", "residual")),
        "spatial": Op("Reshape", ("summed", "spatial_shape")),
        "output": Op("Transpose", ("spatial",), attrs=_TO_NCHW),
    }, "output", frozenset({"bias"})),
)


def _spatial_source(match: Match, channels: int) -> gs.Tensor | None:
    """The [B, C', H, W] tensor whose H and W the reshape to [B, H, W, C] reads, if it reads them from one."""
    elements = shape_elements(match.tensor("spatial_shape"))
    if elements is None or len(elements) != 4 or elements[3] not in (channels, -1):
        return None
    h, w = elements[1], elements[2]
    if isinstance(h, DimOf) and isinstance(w, DimOf) and h.tensor is w.tensor and (h.axis, w.axis) == (2, 3) \
            and _rank(h.tensor) == 4:
        return h.tensor
    return None


def _rewrite_seq2spatial(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x, residual, bias = match.tensor("x"), match.tensor("residual"), constant_values(match.tensor("bias"))
    channels = bias.size
    if _rank(x) != 3 or (isinstance(_dim(x, 2), int) and _dim(x, 2) != channels):
        raise Skip(f"the input is not [B, HW, C] with C = {channels} bias values")
    b = _Builder(match, _dtype(x, bias), convention, provenance)
    bias_c = b.constant("bias", bias.reshape(channels).astype(b.dtype), match.tensor("bias"))
    if match.node("summed") is not None:  # the residual is a sequence
        if _rank(residual) != 3:
            raise Skip("the residual is not [B, HW, C]")
        spatial = _spatial_source(match, channels)
        if spatial is None:
            raise Skip("H and W of the reshape to [B, H, W, C] are not read from a [B, C, H, W] tensor")
        if convention == OURS:
            b.plugin("Seq2Spatial", [x, bias_c, residual, spatial], match.output, residual_layout=LAYOUT_NHWC)
        else:
            _tensorrt_seq2spatial(b, [x, bias_c, residual], spatial, channels, match.output)
    else:
        if convention == TENSORRT:
            raise Skip("TensorRT's SeqLen2Spatial adds a sequence residual only, this one is NCHW")
        transposed = match.node("transposed").outputs[0]
        if _rank(residual) != 4 or _dim(residual, 1) not in (channels, None):
            raise Skip(f"the residual is not [B, {channels}, H, W]")
        same_hw = (residual.shape[2:] == transposed.shape[2:] and None not in residual.shape[2:]) \
            or _spatial_source(match, channels) is residual
        if not same_hw or match.output.shape != residual.shape:
            raise Skip("the residual's H and W are not those of the reshaped sequence")
        b.plugin("Seq2Spatial", [x, bias_c, residual], match.output, residual_layout=LAYOUT_NCHW)
    replace_match(graph, match, b.nodes)


def _tensorrt_seq2spatial(b: _Builder, inputs: list[gs.Tensor], spatial: gs.Tensor, channels: int,
                          output: gs.Tensor) -> None:
    """SeqLen2Spatial takes its output shape, channels included, from a float32 fourth input."""
    if _dim(spatial, 1) != channels:
        raise Skip(f"TensorRT's SeqLen2Spatial takes C from its shape input, which has {_dim(spatial, 1)} channels")
    if spatial.dtype != np.float32:
        cast = gs.Variable(f"{b.base}/spatial_float", dtype=np.float32, shape=spatial.shape)
        b.nodes.append(gs.Node("Cast", f"{b.base}/Cast", attrs={"to": onnx.TensorProto.FLOAT}, inputs=[spatial],
                               outputs=[cast]))
        spatial = cast
    b.plugin("Seq2Spatial", [*inputs, spatial], output)


# ---- RMSNorm (SD3.5's and Flux's Q/K norms) -------------------------------------------------------------

def _rms_norm_ops(one_cast: bool, weighted_in_float32: bool = False) -> dict[str, Op]:
    """x * (1 / sqrt(mean(x^2) + epsilon)) * weight, as diffusers' RMSNorm exports: in float32 (one Cast up, read by
    the square and the product, where `one_cast`; fp16 exports cast twice), then back to the weight's precision; or,
    `weighted_in_float32`, as torch.nn.RMSNorm computes it (models.transformer's export of Flux's): the weight's
    product in float32 too, cast back last."""
    if weighted_in_float32:
        last = {"weighted": Op("Mul", ("normalized", "weight")), "output": Op("Cast", ("weighted",))}
    else:
        last = {"downcast": Op("Cast", ("normalized",), optional="normalized"),
                "output": Op("Mul", ("downcast", "weight"))}
    return {
        "upcast": Op("Cast", ("x",), optional="x"),
        "squared": Op("Pow", ("upcast", "two")),
        "mean": Op("ReduceMean", ("squared",), where=_reduces_last_axis, exact_inputs=False),
        "mean_eps": Op("Add", ("mean", "epsilon")),
        "root": Op("Sqrt", ("mean_eps",)),
        "inverse": Op("Div", ("one", "root")),
        **({} if one_cast else {"upcast_x": Op("Cast", ("x",), optional="x")}),
        "normalized": Op("Mul", ("upcast" if one_cast else "upcast_x", "inverse")),
        **last,
    }


RMS_NORM_PATTERNS = tuple(
    Pattern(name, _rms_norm_ops(one_cast, weighted), "output", frozenset({"two", "epsilon", "one", "weight"}),
            where=lambda m: _close(m.tensor("two"), 2.0) and _close(m.tensor("one"), 1.0))
    for name, one_cast, weighted in (("rms-norm-weighted-in-float32", True, True), ("rms-norm", True, False),
                                     ("rms-norm-two-casts", False, False)))


def _rewrite_rms_norm(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x, weight = match.tensor("x"), constant_values(match.tensor("weight"))
    width = _dim(x, -1) if _rank(x) else None
    if not isinstance(width, int):
        raise Skip("the normalized width is not known")
    if weight.size != width:
        raise Skip(f"the weight has {weight.size} values for a width of {width}")
    if x.dtype is not None and match.output.dtype is not None and x.dtype != match.output.dtype:
        raise Skip(f"its output is {match.output.dtype}, its input {x.dtype}")
    epsilon = scalar_value(match.tensor("epsilon"))
    b = _Builder(match, _dtype(x, weight), convention, provenance)
    weight_c = b.constant("weight", weight.reshape(width).astype(b.dtype), match.tensor("weight"))
    b.plugin("RMSNorm", [x, weight_c], match.output, epsilon=epsilon)
    replace_match(graph, match, b.nodes)


# ---- AdaLayerNorm (the modulated LayerNorm of AdaLN blocks) ------------------------------------------------

def _ada_layer_norm_ops(one_plus_first: bool) -> dict[str, Op]:
    """LayerNorm(x, no affine) * (1 + scale[:, None]) + shift[:, None]; AdaLayerNormContinuous adds the 1 before
    the unsqueeze (`one_plus_first`). The LayerNorm is shared: MMDiT-X modulates one norm twice."""
    ops = {"norm": Op("LayerNormalization", ("x", "gamma", "beta"), shared=True),
           "shift_heads": Op("Unsqueeze", ("shift", "shift_axes")),
           "output": Op("Add", ("scaled", "shift_heads"))}
    if one_plus_first:
        return {**ops, "one_plus": Op("Add", ("scale", "one")), "scale_heads": Op("Unsqueeze", ("one_plus", "axes")),
                "scaled": Op("Mul", ("norm", "scale_heads"))}
    return {**ops, "scale_heads": Op("Unsqueeze", ("scale", "axes")), "one_plus": Op("Add", ("scale_heads", "one")),
            "scaled": Op("Mul", ("norm", "one_plus"))}


ADA_LAYER_NORM_PATTERNS = tuple(
    Pattern(name, _ada_layer_norm_ops(first), "output", frozenset({"gamma", "beta", "one", "axes", "shift_axes"}),
            where=lambda m: _close(m.tensor("one"), 1.0))
    for name, first in (("ada-layer-norm", False), ("ada-layer-norm-continuous", True)))


def _rewrite_ada_layer_norm(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    x, scale, shift, norm = match.tensor("x"), match.tensor("scale"), match.tensor("shift"), match.node("norm")
    if _rank(x) != 3 or not isinstance(_dim(x, 2), int):
        raise Skip("the input is not [B, S, C] of a known width")
    width = _dim(x, 2)
    if norm.attrs.get("axis", -1) not in (-1, 2):
        raise Skip("its LayerNorm is not over the last dimension")
    gamma, beta = constant_values(match.tensor("gamma")), constant_values(match.tensor("beta"))
    if not (np.all(gamma == 1) and np.all(beta == 0)):
        raise Skip("its LayerNorm has an affine of its own")
    if any(constant_values(match.tensor(a)).reshape(-1).tolist() != [1] for a in ("axes", "shift_axes")):
        raise Skip("scale and shift are not broadcast over the sequence ([:, None])")
    if any(_rank(t) != 2 or _dim(t, 1) not in (width, None) for t in (scale, shift)):
        raise Skip(f"scale and shift are not [B, {width}]")
    b = _Builder(match, _dtype(x, gamma), convention, provenance)
    b.plugin("AdaLayerNorm", [x, scale, shift], match.output, epsilon=float(norm.attrs.get("epsilon", 1e-5)))
    replace_match(graph, match, b.nodes)
    if not norm.outputs[0].outputs:  # its last modulation taken: gone now, not left for the LayerNorm pass
        norm.inputs.clear()
        norm.outputs.clear()


# ---- GeLU (the tanh approximation, the transformers' feed-forward) -----------------------------------------

def _gelu_tanh_ops(cube: dict[str, Op]) -> dict[str, Op]:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) of x = y + bias, as torch exports it at opset 17."""
    return {
        "biased": Op("Add", ("y", "bias"), optional="y"),
        **cube,
        "cubic": Op("Mul", ("cube", "cubic_scale")),
        "inner": Op("Add", ("biased", "cubic")),
        "inner_scaled": Op("Mul", ("inner", "tanh_scale")),
        "tanh": Op("Tanh", ("inner_scaled",)),
        "tanh_plus_one": Op("Add", ("tanh", "one")),
        "gated": Op("Mul", ("biased", "tanh_plus_one")),
        "output": Op("Mul", ("gated", "half")),
    }


def _is_tanh_gelu(match: Match) -> bool:
    return (_close(match.tensor("cubic_scale"), 0.044715) and _close(match.tensor("tanh_scale"), math.sqrt(2 / math.pi))
            and _close(match.tensor("one"), 1.0) and _close(match.tensor("half"), 0.5)
            and (match.tensor("three") is None or _close(match.tensor("three"), 3.0)))


_GELU_CONSTANTS = frozenset({"bias", "cubic_scale", "tanh_scale", "one", "half", "three"})
GELU_PATTERNS = (
    Pattern("gelu-tanh", _gelu_tanh_ops({"square": Op("Mul", ("biased", "biased")),
                                         "cube": Op("Mul", ("square", "biased"))}), "output", _GELU_CONSTANTS,
            where=_is_tanh_gelu),
    Pattern("gelu-tanh-pow", _gelu_tanh_ops({"cube": Op("Pow", ("biased", "three"))}), "output", _GELU_CONSTANTS,
            where=_is_tanh_gelu),
)


def _rewrite_gelu(graph: gs.Graph, match: Match, convention: str, provenance: Provenance | None) -> None:
    y, source = match.tensor("y"), match.tensor("bias")
    width = _dim(y, -1) if _rank(y) else None
    if not isinstance(width, int):
        raise Skip("the last dimension is not known")
    bias = constant_values(source) if match.node("biased") is not None else None
    if bias is not None and bias.size != width:
        raise Skip(f"the bias has {bias.size} values for a width of {width}")
    b = _Builder(match, y.dtype or (bias.dtype if bias is not None else np.float32), convention, provenance)
    bias = np.zeros(width, b.dtype) if bias is None else bias.reshape(width).astype(b.dtype)
    b.plugin("GeLU", [y, b.constant("bias", bias, source)], match.output)
    replace_match(graph, match, b.nodes)


# In the order they run: AdaLayerNorm before LayerNorm, which would take the affine-less LayerNorms it modulates.
PLUGIN_PASSES = {
    "fMHA": PluginPass("fMHA", (SELF_ATTENTION, HEADS_FIRST_ATTENTION, SEQUENCE_FIRST_ATTENTION),
                       _rewrite_attention),
    "fMHCA": PluginPass("fMHCA", (CROSS_ATTENTION,), _rewrite_cross_attention),
    "GroupNorm": PluginPass("GroupNorm", GROUP_NORM_PATTERNS, _rewrite_group_norm),
    "AdaLayerNorm": PluginPass("AdaLayerNorm", ADA_LAYER_NORM_PATTERNS, _rewrite_ada_layer_norm),
    "LayerNorm": PluginPass("LayerNorm", LAYER_NORM_PATTERNS, _rewrite_layer_norm),
    "SplitGeLU": PluginPass("SplitGeLU", SPLIT_GELU_PATTERNS, _rewrite_split_gelu),
    "Seq2Spatial": PluginPass("Seq2Spatial", SEQ2SPATIAL_PATTERNS, _rewrite_seq2spatial),
    "RMSNorm": PluginPass("RMSNorm", RMS_NORM_PATTERNS, _rewrite_rms_norm),
    "GeLU": PluginPass("GeLU", GELU_PATTERNS, _rewrite_gelu),
}
