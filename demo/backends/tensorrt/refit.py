"""LoRA on TensorRT engines by refit: engines built refittable (build_enable_refit) take each LoRA set in place, with no
rebuild.

The optimized ONNX an engine is built from carries the provenance of its initializers (models.provenance): which
torch parameters each holds, where (the fMHA pass's packed QKV weight holds to_q, to_k and to_v). A LoRA's deltas,
per parameter (models.lora.lora_deltas), become new values of the initializers that hold those parameters
(models.refit: always base + the sum of the current deltas), which TensorRT's ONNX parser named after them; the
engine's Refitter takes them by name (runtime.Engine.refit).

A refittable engine records the files (names and SHA-256) of the optimized ONNX it was built from
(build.built_from): base values are read only from that very ONNX, since another export of it may number its
anonymous initializers (`onnx::MatMul_N`) otherwise, and a weight set under another's name would be a wrong layer's.

refit_names (the command: scripts/refit_names.py) lists an engine's refittable weight names against the provenance,
for checking how a TensorRT version names them, on a GPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, ContextManager, Mapping, Protocol

import numpy as np

from core.artifacts import artifact_lock, read_manifest
from core.errors import UsageError, field
from demo.backends.base import LoraApplier
from demo.backends.tensorrt.build import built_from, register_plugins
from demo.backends.tensorrt.flavour import TensorRTAPI
from models.base import StageModel
from models.lora import lora_deltas, lora_targets
from models.provenance import Provenance
from models.refit import RefitWeights, read_initializers


class RefittableStage(Protocol):
    """What a refit reads of an engine stage (runtime.EngineStage, which imports this module: it knows this protocol,
    not the other way round)."""

    name: str
    model: StageModel
    engine: object  # runtime.Engine: its `path`
    onnx: Callable[[], ContextManager[Path]]  # the optimized ONNX it was built from, locked while in use

    @property
    def refittable(self) -> bool: ...

    def refit(self, named_weights: Mapping[str, np.ndarray],
              more: Callable[[list[str]], Mapping[str, np.ndarray]]) -> None: ...

ENGINES_NEED_REFIT = (f"LoRA on TensorRT engines needs engines built refittable: add {field('build_enable_refit')} "
                      f"(built once more), or use {field('backend')} torch")


class EngineRefit:
    """The LoRA deltas refitted into one engine stage so far. The stage's optimized ONNX is made ready (through the
    artifact cache) and checked to be the engine's own the first time a refit needs its values."""

    def __init__(self, stage: RefittableStage):
        self.stage = stage
        self.weights: RefitWeights | None = None

    def _ready(self) -> RefitWeights:
        if self.weights is None:
            with self.stage.onnx() as onnx_path:  # exported and optimized again only where it is gone
                recorded = built_from(self.stage.engine.path)
                if read_manifest(onnx_path)["files"] != recorded:
                    raise UsageError(self._stale(onnx_path))
                provenance = Provenance.read(onnx_path)
            provenance.check_usable(self.stage.name)

            def read(names) -> dict[str, np.ndarray]:
                with artifact_lock(onnx_path):  # no other process replaces it while it is read
                    if (read_manifest(onnx_path) or {}).get("files") != recorded:
                        raise UsageError(self._stale(onnx_path))
                    return read_initializers(onnx_path, names)

            self.weights = RefitWeights(provenance, read)
        return self.weights

    def _stale(self, onnx_path: Path) -> str:
        return (f"{self.stage.name}: {onnx_path} is not the ONNX its engine was built from any more (exported or "
                f"optimized again since): rebuild the engine with {field('force_engine_build')} to refit it")

    def plan(self, deltas: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The engine's weights to set for `deltas` (the stage component's parameter name -> float32 delta) in place
        of those set before (models.refit.RefitWeights.plan); {} where nothing changes."""
        if not deltas and self.weights is None:  # nothing now, nothing before
            return {}
        return self._ready().plan(deltas)

    def apply(self, planned: Mapping[str, np.ndarray], deltas: Mapping[str, np.ndarray]) -> None:
        """Refit the engine with what plan(deltas) gave."""
        self.stage.refit(planned, lambda names: self.weights.values(names, deltas))
        self.weights.commit(deltas)


def refit_engines(stages: list[RefittableStage], refits: dict[str, EngineRefit],
                  deltas: Mapping[str, Mapping[str, np.ndarray]]) -> float | None:
    """Refit each stage for its component's `deltas` (component -> parameter -> delta), keeping each stage's state in
    `refits`; every engine's new weights are computed (and its ONNX checked) before any engine changes. Returns the
    milliseconds it took, None where no engine changed."""
    start = time.perf_counter()
    plans = []
    for stage in stages:
        refit = refits.setdefault(stage.name, EngineRefit(stage))
        own = deltas.get(stage.model.component, {})
        plans.append((refit, refit.plan(own), own))
    changed = [(refit, planned, own) for refit, planned, own in plans if planned]
    for refit, planned, own in changed:
        refit.apply(planned, own)
    return (time.perf_counter() - start) * 1e3 if changed else None


class RefittedLoras(LoraApplier):
    """LoRA files refitted into engines built refittable: every file is checked, and every delta made, before any
    engine changes."""

    def __init__(self, stages: list[RefittableStage]):
        if not all(stage.refittable for stage in stages):
            raise UsageError(ENGINES_NEED_REFIT)
        self.stages = stages
        self.refits: dict[str, EngineRefit] = {}

    def set(self, files):
        targets = {stage.model.component: lora_targets(stage.model.component_skeleton()) for stage in self.stages}
        deltas: dict[str, dict] = defaultdict(dict)
        for component, name, delta in lora_deltas(files, targets):
            deltas[component][name] = delta.numpy()
        return refit_engines(self.stages, self.refits, deltas)


# ---- how TensorRT names an engine's refittable weights, against the provenance ----------------------------------

def refit_names(engine_path: Path, onnx_path: Path, flavour: str = "tensorrt", convention: str | None = None,
                dry_refit: bool = False) -> tuple[list[str], bool]:
    """Report lines comparing a refittable engine's weight names (Refitter.get_all_weights) with the initializers
    the provenance of its optimized ONNX records, and whether every LoRA-targetable one (a MatMul, Gemm or Conv
    weight) is refittable by its name. With `dry_refit`, every such weight is set to its ONNX values (the engine's
    own), the names TensorRT asks for besides are listed, and the refit is run and timed. Needs a GPU."""
    api = TensorRTAPI(flavour)
    if convention:
        register_plugins(api, convention)
    engine = api.trt.Runtime(api.logger()).deserialize_cuda_engine(engine_path.read_bytes())
    if engine is None:
        return [f"{engine_path}: {api.label} could not deserialize it"], False
    if not engine.refittable:
        return [f"{engine_path}: not refittable (built without build_enable_refit)"], False
    refitter = api.trt.Refitter(engine, api.logger())
    names = set(refitter.get_all_weights())
    provenance = Provenance.read(onnx_path)
    if provenance.problem:
        return [f"{onnx_path}: no usable provenance: {provenance.problem}"], False
    weights = sorted(name for name, parts in provenance.records.items()
                     if any(part.parameter in provenance.weights for part in parts))
    absent = [name for name in weights if name not in names]
    others = sorted(names - set(provenance.records))
    lines = [f"{engine_path.name} ({api.label}): {len(names)} refittable weights; the provenance records "
             f"{len(provenance.records)} initializers, {len(weights)} of them LoRA-targetable weights",
             f"LoRA-targetable weights the engine cannot refit by name: {len(absent)}",
             *[f"  {name}" for name in absent[:20]],
             f"refittable names the provenance does not record (biases, norms, constants): {len(others)}",
             *[f"  {name}" for name in others[:20]]]
    ok = not absent
    if dry_refit and ok:
        values = read_initializers(onnx_path, weights)
        start = time.perf_counter()
        held = []  # TensorRT reads the arrays when the refit runs
        for name in weights:
            held.append(np.ascontiguousarray(values[name]))
            ok &= refitter.set_named_weights(name, api.trt.Weights(held[-1]))
        missing = sorted(refitter.get_missing_weights())
        extra = read_initializers(onnx_path, missing)
        for name, value in extra.items():
            held.append(np.ascontiguousarray(value))
            ok &= refitter.set_named_weights(name, api.trt.Weights(held[-1]))
        refitted = refitter.refit_cuda_engine()
        lines += [f"dry refit: set {len(weights)} weights; TensorRT asked for {len(missing)} more "
                  f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}), "
                  f"{len(missing) - len(extra)} of them no initializer; refit {'succeeded' if refitted else 'FAILED'} "
                  f"in {(time.perf_counter() - start) * 1e3:.0f} ms (with the ONNX values' host copies)"]
        ok &= refitted and len(extra) == len(missing)
    return lines, ok
