"""A declarative graph matcher for onnx-graphsurgeon graphs.

A `Pattern` is a small graph of named `Op`s: each names the op types it accepts, its inputs (other ops
of the pattern, or variables that bind to any tensor), exact attribute values and an optional
predicate on the node. One generic matcher finds every place in a graph where the pattern's output
op is rooted: it walks from that node up through the inputs, binding pattern names to nodes and
variables to tensors (a name bound twice must be the same node or tensor), and tries both operand
orders of Add and Mul. An `optional` op may be absent, in which case it stands for one of its inputs.

A match is only reported when everything it would remove is private to it: the outputs of its
nodes (other than the pattern's output) feed only nodes of the match and are not graph outputs.
`shared` ops (e.g. a Shape read elsewhere too) are matched but not removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import onnx_graphsurgeon as gs

COMMUTATIVE_OPS = frozenset({"Add", "Mul"})


@dataclass(frozen=True)
class Op:
    """One node of a pattern.

    `inputs` holds references: the name of another op of the pattern ("name", or "name:1" for its
    second output), or a variable name. `exact_inputs=False` lets the node have further inputs that
    the pattern does not constrain (read them in the pass, e.g. a Slice's starts and ends).
    """

    op: str | tuple[str, ...]
    inputs: tuple[str, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    where: Callable[[gs.Node], bool] | None = None
    optional: str | None = None  # when absent, this op stands for this input reference
    exact_inputs: bool = True
    shared: bool = False  # matched, but may feed nodes outside the match and is never removed

    def accepts(self, node: gs.Node) -> bool:
        ops = (self.op,) if isinstance(self.op, str) else self.op
        if node.op not in ops:
            return False
        if len(node.inputs) < len(self.inputs) or (self.exact_inputs and len(node.inputs) != len(self.inputs)):
            return False
        for name, value in self.attrs.items():
            actual = node.attrs.get(name)
            if actual is None or _normalize(actual) != _normalize(value):
                return False
        return self.where is None or bool(self.where(node))


def _normalize(value):
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(np.asarray(value).tolist())
    return value


@dataclass(frozen=True)
class Pattern:
    """Named ops, the op whose first output is the pattern's result, and variables that must be constants."""

    name: str
    ops: Mapping[str, Op]
    output: str
    constants: frozenset[str] = frozenset()
    where: Callable[["Match"], bool] | None = None  # conditions across several nodes

    def __post_init__(self):
        if self.output not in self.ops:
            raise ValueError(f"pattern {self.name}: output {self.output!r} is not one of its ops")
        for op_name, op in self.ops.items():
            for ref in op.inputs + ((op.optional,) if op.optional else ()):
                if _split_ref(ref)[0] == op_name:
                    raise ValueError(f"pattern {self.name}: {op_name} refers to itself")


@dataclass
class Match:
    """Where a pattern matched: pattern op names -> nodes (None for an absent optional op), variables -> tensors."""

    pattern: Pattern
    nodes: dict[str, gs.Node | None]
    tensors: dict[str, gs.Tensor]

    @property
    def root(self) -> gs.Node:
        return self.nodes[self.pattern.output]

    @property
    def output(self) -> gs.Tensor:
        return self.root.outputs[0]

    def node(self, name: str) -> gs.Node | None:
        return self.nodes.get(name)

    def tensor(self, name: str) -> gs.Tensor | None:
        """The tensor bound to a variable (None when it sits behind an absent optional op)."""
        return self.tensors.get(name)

    def removable_nodes(self) -> list[gs.Node]:
        return [n for name, n in self.nodes.items() if n is not None and not self.pattern.ops[name].shared]


def _split_ref(ref: str) -> tuple[str, int]:
    name, _, index = ref.partition(":")
    return name, int(index) if index else 0


class _Matcher:
    def __init__(self, pattern: Pattern, graph_outputs: set[int]):
        self.pattern = pattern
        self.graph_outputs = graph_outputs

    def match_root(self, node: gs.Node) -> Match | None:
        root = self.pattern.output
        if not self.pattern.ops[root].accepts(node) or not node.outputs:
            return None
        for binding in self._match_ref(root, node.outputs[0], {}):
            match = self._as_match(binding)
            if self._is_private(match) and (self.pattern.where is None or self.pattern.where(match)):
                return match
        return None

    def _as_match(self, binding: dict) -> Match:
        nodes = {k: v for k, v in binding.items() if k in self.pattern.ops}
        tensors = {k: v for k, v in binding.items() if k not in self.pattern.ops}
        return Match(self.pattern, nodes, tensors)

    def _is_private(self, match: Match) -> bool:
        inside = {id(n) for n in match.nodes.values() if n is not None}
        for name, node in match.nodes.items():
            if node is None or self.pattern.ops[name].shared:
                continue
            outputs = node.outputs[1:] if node is match.root else node.outputs
            for tensor in outputs:
                if id(tensor) in self.graph_outputs or any(id(c) not in inside for c in tensor.outputs):
                    return False
        return True

    def _match_ref(self, ref: str, tensor: gs.Tensor, binding: dict) -> Iterator[dict]:
        name, index = _split_ref(ref)
        op = self.pattern.ops.get(name)
        if op is None:  # a variable
            bound = binding.get(name)
            if bound is None:
                if name in self.pattern.constants and not isinstance(tensor, gs.Constant):
                    return
                yield {**binding, name: tensor}
            elif bound is tensor:
                yield binding
            return
        if name in binding:  # an op already matched through another path
            node = binding[name]
            if node is None:
                yield from self._match_ref(op.optional, tensor, binding)
            elif index < len(node.outputs) and node.outputs[index] is tensor:
                yield binding
            return
        producer = tensor.inputs[0] if isinstance(tensor, gs.Variable) and tensor.inputs else None
        if (producer is not None and index < len(producer.outputs) and producer.outputs[index] is tensor
                and op.accepts(producer) and not any(v is producer for v in binding.values())):
            bound = {**binding, name: producer}
            orders = [op.inputs]
            if producer.op in COMMUTATIVE_OPS and len(op.inputs) == 2:
                orders.append(op.inputs[::-1])
            for refs in orders:
                yield from self._match_inputs(list(zip(refs, producer.inputs)), bound)
        if op.optional is not None:
            yield from self._match_ref(op.optional, tensor, {**binding, name: None})

    def _match_inputs(self, pairs: list[tuple[str, gs.Tensor]], binding: dict) -> Iterator[dict]:
        if not pairs:
            yield binding
            return
        (ref, tensor), rest = pairs[0], pairs[1:]
        for bound in self._match_ref(ref, tensor, binding):
            yield from self._match_inputs(rest, bound)


def find_matches(graph: gs.Graph, pattern: Pattern) -> Iterator[Match]:
    """Matches of `pattern` in graph order, found lazily: a caller may rewrite each before the next is sought."""
    matcher = _Matcher(pattern, {id(t) for t in graph.outputs})
    for node in list(graph.nodes):
        match = matcher.match_root(node)
        if match is not None:
            yield match


def replace_match(graph: gs.Graph, match: Match, new_nodes: list[gs.Node]) -> None:
    """Disconnect the match's nodes (cleanup drops them) and add `new_nodes`, one of which must
    produce the match's output tensor, so every consumer of the old result reads the new one."""
    output = match.output
    for node in match.removable_nodes():
        node.inputs.clear()
        node.outputs.clear()
    graph.nodes.extend(new_nodes)
    if not any(output in n.outputs for n in new_nodes):
        raise ValueError(f"pattern {match.pattern.name}: the replacement does not produce {output.name}")


# ---- reading values out of a graph -------------------------------------------------------------

def constant_values(tensor: gs.Tensor | None) -> np.ndarray | None:
    """The values of a constant tensor (an initializer), else None."""
    return tensor.values if isinstance(tensor, gs.Constant) else None


def scalar_value(tensor: gs.Tensor | None) -> float | None:
    """The value of a one-element constant, else None."""
    values = constant_values(tensor)
    return float(values.reshape(-1)[0]) if values is not None and values.size == 1 else None


@dataclass(frozen=True)
class DimOf:
    """A shape-vector element that is dimension `axis` of `tensor` at run time."""

    tensor: gs.Tensor
    axis: int


def shape_elements(tensor: gs.Tensor) -> list[int | DimOf | None] | None:
    """What each element of a 1-D int64 shape tensor is: a constant, a dimension of some tensor, or
    unknown (None); None for the whole when the tensor is built in a way this does not follow.

    Follows the subgraphs exporters emit for dynamic reshapes: Concat of constants and
    Unsqueeze(Gather(Shape(t), i)).
    """
    values = constant_values(tensor)
    if values is not None:
        return [int(v) for v in values.reshape(-1)]
    producer = tensor.inputs[0] if tensor.inputs else None
    if producer is None:
        return None
    if producer.op == "Shape":
        source = producer.inputs[0]
        if source.shape is None:
            return None
        rank = len(source.shape)
        start, end = producer.attrs.get("start", 0), producer.attrs.get("end", rank)
        return [DimOf(source, axis) for axis in range(rank)][start:end]
    if producer.op == "Concat" and producer.attrs.get("axis") == 0:
        parts = [shape_elements(t) for t in producer.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if producer.op == "Unsqueeze":
        # A scalar made one element: whatever the scalar is, unknown when computed (e.g. H * W).
        elements = shape_elements(producer.inputs[0])
        return [None] if elements is None else elements
    if producer.op == "Gather" and producer.attrs.get("axis", 0) == 0:
        indices, source = constant_values(producer.inputs[1]), shape_elements(producer.inputs[0])
        if indices is None or source is None or indices.ndim > 1:
            return None
        try:
            return [source[int(i)] for i in indices.reshape(-1)]
        except IndexError:
            return None
    return None
