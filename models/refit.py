"""The refit core: an optimized ONNX's initializers as a set of LoRA deltas changes them, computed from the ONNX's own
(base) values and the initializers' provenance (models.provenance); no TensorRT here (demo.backends.tensorrt.refit
hands the values to an engine).

    refit = RefitWeights(provenance, lambda names: read_initializers(onnx_path, names))
    weights = refit.plan(deltas)           # initializer name -> its values under `deltas` (parameter -> fp32 delta)
    ...set them in the engine (and refit.values(names, deltas) of those TensorRT asks for besides), then
    refit.commit(deltas)

Each initializer is always recomputed from its BASE values plus the sum of the current deltas, never from what the
engine holds: an initializer no delta touches any more goes back to its base values, byte for byte, and switching
LoRAs never mixes old and new, nor drifts. Arithmetic is float32 (a part's delta added into its slice, transposed
where the part is), cast once to the initializer's type, as LoraFusion fuses into torch weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from models.provenance import Part, Provenance


def read_initializers(onnx_path: Path, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The values of those of these initializers an ONNX file has (external data read for them alone)."""
    import onnx
    from onnx import numpy_helper

    wanted = set(names)
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {tensor.name: numpy_helper.to_array(tensor, str(onnx_path.parent))
            for tensor in model.graph.initializer if tensor.name in wanted}


def refitted(base: np.ndarray, parts: Iterable[Part], deltas: Mapping[str, np.ndarray]) -> np.ndarray:
    """One initializer's values: `base` with each part's delta (where `deltas` has one) added into its slice, in
    float32, cast back to the base's type; `base` itself where none applies."""
    applied = [part for part in parts if part.parameter in deltas]
    if not applied:
        return base
    value = np.array(base, dtype=np.float32, order="C")
    for part in applied:
        part.region(value)[...] += part.placed(deltas[part.parameter])
    return value.astype(base.dtype)


class RefitWeights:
    """One optimized ONNX's initializers under the LoRA deltas set so far. Base values are read from the ONNX
    (`read`: names -> values, as read_initializers gives them) the first time an initializer is needed, and kept
    (only those a LoRA touched, or TensorRT asked for)."""

    def __init__(self, provenance: Provenance, read: Callable[[Iterable[str]], dict[str, np.ndarray]]):
        self.provenance = provenance
        self._read = read
        self._base: dict[str, np.ndarray] = {}
        self._changed: set[str] = set()  # the initializers the committed deltas change

    def base(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The base values of these initializers (a KeyError names one the ONNX has not)."""
        missing = set(names) - set(self._base)
        if missing:
            self._base.update(self._read(sorted(missing)))
        return {name: self._base[name] for name in names}

    def plan(self, deltas: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Initializer name -> its values under `deltas` (parameter name -> float32 delta of the parameter's shape),
        for every initializer they change and every one the committed deltas changed (back to base where the new
        ones leave it). Deltas of parameters no initializer holds change nothing: the export has no such weight (an
        SDXL text encoder's last layer, which the penultimate states never reach)."""
        names = set(self.provenance.holding(deltas)) | self._changed
        base = self.base(sorted(names))
        return {name: refitted(base[name], self.provenance.records[name], deltas) for name in sorted(names)}

    def values(self, names: Iterable[str], deltas: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Initializers' values under `deltas`, for those TensorRT asks for besides the planned ones (weights it fused
        with them), read in one go (reading an ONNX costs a parse of the whole file: 0.5 s for SD 1.5's UNet, each
        time); a KeyError names one the ONNX has not."""
        base = self.base(names)
        return {name: refitted(base[name], self.provenance.records.get(name, ()), deltas) for name in names}

    def commit(self, deltas: Mapping[str, np.ndarray]) -> None:
        """The engine now holds what plan(deltas) gave."""
        self._changed = set(self.provenance.holding(deltas))
