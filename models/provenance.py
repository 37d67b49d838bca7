"""Where the initializers of a stage's ONNX come from: which of its component's torch parameters (the names
models.lora.lora_deltas yields, e.g. `down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight`), transposed
or not, placed where in the initializer. Engine refit takes LoRA deltas through it (models.refit).

    provenance = export_provenance(onnx_model, module, module.unet, "unet")  # at export: one whole part each
    ...the passes carry it: Provenance.copy (a constant made from another), Provenance.stack (fused Q/K/V, K/V)
    provenance = check_provenance(graph, provenance)                         # at the end of optimization
    provenance.write(optimized_onnx_path)                                    # beside it: <file>.provenance.json

An initializer's record is a list of parts; a part is one parameter (as a matrix it is transposed where the graph
multiplies by its transpose, as MatMul takes a Linear's weight) put, in C order, into a slice [start, stop) along
one axis of the initializer seen as another shape (its `view`). A plain weight is one part filling all of it; the
fMHA pass's packed QKV weight, [C, heads x 3 x head size], is three parts, to_q, to_k and to_v, at index 0, 1 and 2
of the view [C, heads, 3, head size]. A part never says more than where the parameter's values sit: what fills the
rest (a projection without a bias packed beside one with) stays as the ONNX has it.

The optimizer checks every record bit for bit against the parameter's values as exported, and that every weight of
a MatMul, Gemm or Conv (where every LoRA-targetable Linear and Conv2d weight ends up) has one. Where a record cannot
be made or does not hold (a model the export cannot trace, a pass that makes such a weight without recording where it
came from), the provenance keeps why (`problem`) and no records: the ONNX and its engines build as ever, and only a
refit fails, in one line saying why, so a refit can never lose track of a weight.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from core.errors import RunFailure

SUFFIX = ".provenance.json"
# The ops whose weight input a Linear or Conv2d weight becomes, and which input that is.
WEIGHT_INPUTS = {"MatMul": 1, "Gemm": 1, "Conv": 1}


class ProvenanceError(RunFailure):
    """An initializer that engine refit could not trace to the parameters it holds (exit 1, one line)."""


@dataclass(frozen=True)
class Part:
    """One parameter's values in an initializer."""

    parameter: str  # the component's parameter name
    shape: tuple[int, ...]  # the parameter's shape
    transpose: bool  # the (2-D) parameter sits transposed
    view: tuple[int, ...]  # the initializer seen as this shape (same elements, C order) ...
    axis: int  # ... holds the parameter in [start, stop) along this axis of it
    start: int
    stop: int

    @classmethod
    def whole(cls, parameter: str, shape: Sequence[int], transpose: bool) -> Part:
        """The parameter filling an initializer (of its shape, reversed where transposed)."""
        view = tuple(reversed(shape)) if transpose else tuple(shape)
        return cls(parameter, tuple(shape), transpose, view, 0, 0, view[0])

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == self.view[self.axis]

    def region(self, value: np.ndarray) -> np.ndarray:
        """The part's slice of an initializer's values (a view into `value`, which must be C-contiguous)."""
        index = (slice(None),) * self.axis + (slice(self.start, self.stop),)
        return value.reshape(self.view)[index]

    def placed(self, values: np.ndarray) -> np.ndarray:
        """A parameter-shaped array (the parameter itself, or a LoRA delta of it) as the part holds it."""
        oriented = values.T if self.transpose else values
        return oriented.reshape(self.region_shape)

    def values(self, value: np.ndarray) -> np.ndarray:
        """The parameter's values, as a contiguous array of its shape, read out of an initializer's values."""
        stored = tuple(reversed(self.shape)) if self.transpose else self.shape
        region = self.region(np.ascontiguousarray(value)).reshape(stored)
        return np.ascontiguousarray(region.T if self.transpose else region)

    @property
    def region_shape(self) -> tuple[int, ...]:
        return self.view[:self.axis] + (self.stop - self.start,) + self.view[self.axis + 1:]

    def as_json(self) -> list:
        return [self.parameter, list(self.shape), self.transpose, list(self.view), self.axis, self.start, self.stop]

    @classmethod
    def from_json(cls, item: list) -> Part:
        parameter, shape, transpose, view, axis, start, stop = item
        return cls(parameter, tuple(shape), transpose, tuple(view), axis, start, stop)


class Provenance:
    """Initializer name -> the parts it holds, for one stage's component (`component`: unet, text_encoder, ...);
    with what the export found, which the optimizer checks its records against: each recorded parameter's values as
    exported (`digests`), and the parameters that were MatMul, Gemm or Conv weights (`weights`: those a LoRA
    changes)."""

    def __init__(self, component: str, records: Mapping[str, Sequence[Part]], digests: Mapping[str, str],
                 weights: Iterable[str], problem: str | None = None):
        self.component = component
        self.records: dict[str, tuple[Part, ...]] = {name: tuple(parts) for name, parts in records.items()}
        self.digests = dict(digests)
        self.weights = frozenset(weights)
        self.problem = problem  # why the records cannot be trusted for a refit (None: they can)

    def failed(self, problem: str) -> Provenance:
        """This provenance, unusable for a refit because of `problem` (the first one found is kept)."""
        return Provenance(self.component, {}, self.digests, self.weights, self.problem or problem)

    def check_usable(self, stage: str) -> None:
        """A ProvenanceError where a refit cannot go through these records."""
        if self.problem:
            raise ProvenanceError(f"{stage}: its engine cannot take a LoRA by refit: {self.problem}")

    def parameters(self) -> set[str]:
        """The parameters recorded in some initializer."""
        return {part.parameter for parts in self.records.values() for part in parts}

    def holding(self, parameters: Iterable[str]) -> dict[str, tuple[Part, ...]]:
        """The records of every initializer that holds one of `parameters`."""
        wanted = set(parameters)
        return {name: parts for name, parts in self.records.items() if any(p.parameter in wanted for p in parts)}

    # ---- what the passes call when they make an initializer out of others ----------------------------------
    def copy(self, name: str, source: str) -> None:
        """`name` holds `source`'s values, in the same order (perhaps in another shape)."""
        if source in self.records:
            self.records[name] = self.records[source]

    def stack(self, name: str, sources: Sequence[str | None], view: Sequence[int], axis: int) -> None:
        """`name`, seen as `view`, holds the i-th of `sources` at index i of `axis` (np.stack along that axis, then
        reshaped, as the attention passes fuse projections); None, or a source with no record, is no parameter's.
        Each recorded source must be one whole parameter: stacking a stack is not recorded, and fails loudly."""
        parts = []
        for index, source in enumerate(sources):
            for part in self.records.get(source, ()) if source is not None else ():
                if not part.is_whole or len(self.records[source]) != 1:
                    self.problem = self.problem or (f"{name}: its source {source} holds parts of several parameters, "
                                                    "which stacking again cannot record")
                    return
                parts.append(Part(part.parameter, part.shape, part.transpose, tuple(view), axis, index, index + 1))
        if parts:
            self.records[name] = tuple(parts)

    # ---- the file beside an ONNX artifact -------------------------------------------------------------------
    def write(self, onnx_path: Path) -> None:
        records = {name: [part.as_json() for part in parts] for name, parts in sorted(self.records.items())}
        data = {"component": self.component, "records": records, "digests": dict(sorted(self.digests.items())),
                "weights": sorted(self.weights), "problem": self.problem}
        provenance_path(onnx_path).write_text(json.dumps(data))

    @classmethod
    def read(cls, onnx_path: Path) -> Provenance:
        data = json.loads(provenance_path(onnx_path).read_text())
        records = {name: [Part.from_json(item) for item in parts] for name, parts in data["records"].items()}
        return cls(data["component"], records, data["digests"], data["weights"], data["problem"])


def provenance_path(onnx_path: Path) -> Path:
    return onnx_path.with_name(onnx_path.name + SUFFIX)


# ---- at export -------------------------------------------------------------------------------------------------

def _digest(values: np.ndarray) -> str:
    data = np.ascontiguousarray(values)
    return hashlib.blake2b(f"{data.dtype}{data.shape}".encode() + data.tobytes(), digest_size=16).hexdigest()


def _scope(node_name: str) -> str:
    """The module path the TorchScript exporter scopes a node under: '/unet/down_blocks.1/attn1/to_q/MatMul' ->
    'unet.down_blocks.1.attn1.to_q'."""
    return ".".join(node_name.strip("/").split("/")[:-1])


def _attribute(node, name: str):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def export_provenance(model, module, component, component_name: str) -> Provenance:
    """The record of every initializer of a raw export (an onnx.ModelProto of `module`) that is one of `component`'s
    parameters (`component`: the diffusers or transformers model inside `module`, named `component_name`; its
    parameter names are the ones recorded), each checked bit for bit against the parameter.

    The exporter tells which parameter an initializer is in two ways, both used: it names the initializer of a
    parameter used as it is by the parameter's (module-path) name, and a deduplicated copy of it (an Identity of an
    equal initializer) too; a Linear on a 3-D input it exports as MatMul by the weight's transpose, which its
    constant folding turns into an anonymous initializer (`onnx::MatMul_N`), so that one is known by the MatMul's
    scope, which names the Linear. Any MatMul, Gemm or Conv weight left unknown is the provenance's problem."""
    from onnx import numpy_helper

    prefix = next(name for name, child in module.named_modules() if child is component)
    prefix = f"{prefix}." if prefix else ""
    parameters = {prefix + name: (name, parameter) for name, parameter in component.named_parameters()}
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    constants = {name: name for name in initializers}  # constant tensor -> the initializer holding its values
    consumers = defaultdict(list)
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in constants:
            constants[node.output[0]] = constants[node.input[0]]
            continue
        for index, name in enumerate(node.input):
            consumers[name].append((node, index))

    records, digests, weights, unknown = {}, {}, set(), []
    for name, initializer in constants.items():
        weight_of = [node for node, index in consumers[name] if WEIGHT_INPUTS.get(node.op_type) == index]
        if name in parameters:
            candidate, transpose = name, False
        elif weight_of:
            node = weight_of[0]
            transpose = node.op_type == "MatMul" or (node.op_type == "Gemm" and not _attribute(node, "transB"))
            candidate = f"{_scope(node.name)}.weight"
        else:
            continue
        found = parameters.get(candidate)
        if found is not None:
            parameter_name, parameter = found
            value = parameter.detach().cpu().numpy()
            if np.array_equal(value.T if transpose else value, numpy_helper.to_array(initializers[initializer])):
                records[name] = (Part.whole(parameter_name, value.shape, transpose),)
                digests[parameter_name] = _digest(value)
                if weight_of:
                    weights.add(parameter_name)
                continue
        if weight_of:
            unknown.append(f"{name} (weight of {weight_of[0].name})")
    provenance = Provenance(component_name, records, digests, weights)
    if unknown:
        return provenance.failed(f"the export has {len(unknown)} weight(s) whose {component_name} parameter it "
                                 f"cannot tell; first: {unknown[0]}")
    return provenance


# ---- through the optimizer -------------------------------------------------------------------------------------

def weight_constants(graph) -> dict[str, str]:
    """Constant name -> a node (name) that takes it as its MatMul, Gemm or Conv weight, in an onnx-graphsurgeon
    graph."""
    import onnx_graphsurgeon as gs

    found = {}
    for node in graph.nodes:
        index = WEIGHT_INPUTS.get(node.op)
        if index is not None and len(node.inputs) > index and isinstance(node.inputs[index], gs.Constant):
            found.setdefault(node.inputs[index].name, node.name)
    return found


def check_provenance(graph, provenance: Provenance) -> Provenance:
    """The records of the constants left in the optimized `graph` (an onnx-graphsurgeon graph), each checked to
    hold exactly its parameter's exported values where it says; a ProvenanceError where one does not, where a
    MatMul, Gemm or Conv weight has no record, or where an exported weight is recorded in no initializer any more.
    A provenance that already has a problem is returned as it is."""
    import onnx_graphsurgeon as gs

    if provenance.problem:
        return provenance

    constants = {name: tensor for name, tensor in graph.tensors().items() if isinstance(tensor, gs.Constant)}
    kept = Provenance(provenance.component, {name: parts for name, parts in provenance.records.items()
                                             if name in constants}, provenance.digests, provenance.weights)
    for name, parts in kept.records.items():
        for part in parts:
            if _digest(part.values(constants[name].values)) != provenance.digests[part.parameter]:
                raise ProvenanceError(f"{name} does not hold {part.parameter} where its record says (a pass changed "
                                      "its values or recorded it wrongly)")
    unrecorded = [f"{name} (weight of {node})" for name, node in weight_constants(graph).items()
                  if name not in kept.records]
    if unrecorded:
        raise ProvenanceError(f"{len(unrecorded)} weight(s) of the optimized graph have no record of the parameters "
                              "they hold, which engine refit needs (a pass made them without recording it); first: "
                              f"{unrecorded[0]}")
    lost = sorted(provenance.weights - kept.parameters())
    if lost:
        raise ProvenanceError(f"{len(lost)} exported weight(s) are held by no initializer of the optimized graph any "
                              f"more; first: {lost[0]}")
    return kept
