"""The base ONNX optimizer: cleanup, constant folding with shape inference, with a node-count report.

Built on onnx-graphsurgeon (graph edits) and polygraphy (folding and shape inference, which also
handle models above 2 GB by going through disk). The plugin passes (models.plugin_passes) run after
them, on the shape-inferred graph, and show up in the same report. The export's record of which parameters
each initializer holds (models.provenance) goes through every pass (folding keeps names; the plugin passes record
what they make) and is checked against the final graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from polygraphy.backend.onnx import loader as poly

from models.onnx_io import save_onnx
from models.plugin_passes import PLUGIN_PASSES, empty_report, write_pass_report
from models.provenance import Provenance, ProvenanceError, check_provenance
from models.quantize import Int8Request, describe, quantize_graph, write_int8_report
from plugins.contract import OURS
from plugins.contract import convention as plugin_convention


class GraphOptimizer:
    """Runs named passes over one ONNX model and records the node count after each."""

    def __init__(self, model: onnx.ModelProto, stage: str, provenance: Provenance | None = None):
        self.stage = stage
        self.graph = gs.import_onnx(model)
        self.history: list[tuple[str, int]] = [("exported", len(self.graph.nodes))]
        self.plugin_report = empty_report()
        self.provenance = provenance  # the export's, which the plugin passes add to

    def _record(self, name: str) -> None:
        self.history.append((name, len(self.graph.nodes)))

    def model(self) -> onnx.ModelProto:
        return gs.export_onnx(self.graph)

    def cleanup(self) -> None:
        self.graph.cleanup(remove_unused_graph_inputs=False).toposort()
        self._record("cleanup")

    def fold_constants(self) -> None:
        """Folds constants and infers every tensor's shape: polygraphy infers shapes (onnxruntime's symbolic
        inference) after each folding pass, so the folded graph is shape-inferred; a separate inference after it gave
        the same graph byte for byte and cost SD 1.5's UNet 18 s of its 150 on a 2-core CPU."""
        folded = poly.fold_constants(self.model(), num_passes=3, do_shape_inference=True, error_ok=False)
        self.graph = gs.import_onnx(folded)
        self._record("fold-constants")

    def plugin_pass(self, key: str, convention: str = OURS) -> None:
        self.plugin_report[key] = PLUGIN_PASSES[key].apply(self.graph, convention, self.provenance).as_dict()
        self._record(key)

    def quantize(self, provenance: Provenance, int8: Int8Request) -> dict:
        """Smooth and quantize the graph as models.quantize does, from `int8`'s calibration; returns its report."""
        report = quantize_graph(self.graph, provenance, int8.calibrate(), int8.alpha)
        self._record("int8")
        return report

    def plugin_passes(self, plugins: tuple[str, ...], convention: str = OURS) -> list[tuple[str, Callable[[], None]]]:
        """The passes of the selected plugins, in PLUGIN_PASSES' order, then a cleanup; `convention` says
        whose plugin nodes they emit (plugins.contract.CONVENTIONS). A key the convention has no plugin for has
        no pass."""
        keys = [key for key in PLUGIN_PASSES if plugin_convention(convention).has(key)]
        passes = [(key, lambda key=key: self.plugin_pass(key, convention)) for key in keys if key in plugins]
        return passes + [("cleanup", self.cleanup)] if passes else []

    def run(self, passes: list[tuple[str, Callable[[], None]]] | None = None) -> onnx.ModelProto:
        """Runs exactly `passes` (`[]`: none), or the base passes where it is None; returns the model."""
        for _, apply in self.base_passes() if passes is None else passes:
            apply()
        return self.model()

    def base_passes(self) -> list[tuple[str, Callable[[], None]]]:
        return [
            ("cleanup", self.cleanup),
            ("fold-constants", self.fold_constants),
            ("cleanup", self.cleanup),
        ]

    def checked_provenance(self) -> Provenance:
        """The provenance of the graph as it is now, checked; where it does not hold, one that says why (a refit
        then fails, nothing else does)."""
        try:
            return check_provenance(self.graph, self.provenance)
        except ProvenanceError as exc:
            return self.provenance.failed(str(exc))

    def precision_warning(self) -> str | None:
        """Names the matrix ops that compute in fp32 beside fp16 ones (a half-converted export)."""
        matrix_ops = [n for n in self.graph.nodes if n.op in ("MatMul", "Conv", "Gemm") and n.outputs]
        wide = [n.name for n in matrix_ops if n.outputs[0].dtype == np.float32]
        if not wide or not any(n.outputs[0].dtype == np.float16 for n in matrix_ops):
            return None
        return (f"[optimize] {self.stage}: WARNING {len(wide)} of {len(matrix_ops)} MatMul/Conv/Gemm nodes compute "
                f"in fp32 in an fp16 model (first: {wide[0]}); strongly typed engines will run them in fp32")

    def report(self) -> str:
        steps = " -> ".join(f"{name} {count}" for name, count in self.history)
        warning = self.precision_warning()
        skipped = [f"[optimize] {self.stage}: {key} skipped {reason}"
                   for key, result in self.plugin_report.items() for reason in result["skipped_reasons"]]
        return "\n".join([f"[optimize] {self.stage}: nodes {steps}", *skipped, *([warning] if warning else [])])


def optimize_onnx_file(src: Path, dst: Path, stage: str, log: Callable[[str], None] = print,
                       plugins: tuple[str, ...] = (), convention: str = OURS, provenance: bool = False,
                       int8: Int8Request | None = None) -> None:
    """Optimize `src` into `dst`, running the passes of `plugins`; their report goes beside `dst`. With
    `provenance`, the export's record beside `src` is carried through, checked, and written beside `dst`. With
    `int8` (which needs the provenance: it finds each weight's module by it), the graph is then smoothed and
    quantized from the request's calibration (models.quantize), and what that did goes beside `dst` too."""
    optimizer = GraphOptimizer(onnx.load(str(src)), stage, Provenance.read(src) if provenance else None)
    model = optimizer.run(optimizer.base_passes() + optimizer.plugin_passes(plugins, convention))
    checked = optimizer.checked_provenance() if provenance else None  # before anything is written
    int8_report = None
    if int8 is not None:
        if checked is None or checked.problem:
            raise ProvenanceError(f"{stage}: --int8 finds each weight's module through the export's record of it, "
                                  f"which {'this stage lacks' if checked is None else 'failed: ' + checked.problem}")
        int8_report = optimizer.quantize(checked, int8)
        model = optimizer.model()
        checked = checked.failed("an INT8 engine's weights are smoothed and quantized, so a refit cannot restore them")
    save_onnx(model, dst)
    write_pass_report(dst, optimizer.plugin_report)
    if int8_report is not None:
        write_int8_report(dst, int8_report)
    if checked is not None:
        checked.write(dst)
    log(optimizer.report())
    if int8_report is not None:  # its refit is refused up front (demo.backends.tensorrt.settings), so no warning here
        log(f"[optimize] {stage}: {describe(int8_report)}")
    elif checked is not None and checked.problem:
        log(f"[optimize] {stage}: warning: LoRA refit of its engines will not work: {checked.problem}")
