"""LoRA files fused into a pipeline's UNet and text-encoder stages (models.lora), switched without reloading: into the
torch backend's modules in place (LoraFusion), or by refit into TensorRT engines built with --build-enable-refit
(demo.refit)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Mapping, Sequence

from core.errors import UsageError
from demo.stages import Stage, TorchStage
from models.lora import COMPONENTS, LoraFile, LoraFusion, lora_deltas, lora_targets, read_lora

ENGINES_NEED_REFIT = ("LoRA on TensorRT engines needs engines built refittable: add --build-enable-refit (built once "
                      "more), or use --backend torch")

LoraSpec = tuple[str | Path | LoraFile, float]  # a file (or what read_lora read from it) and its scale


class StageLoras:
    """The LoRA files fused into the stages whose models LoRA files change (the UNet, the text encoders)."""

    def __init__(self, stages: Mapping[str, Stage]):
        self.stages = [stage for stage in stages.values() if stage.model.component in COMPONENTS]
        self.fusion: LoraFusion | None = None  # made on first use: engines have no modules to fuse into
        self.refits: dict = {}  # engines: stage name -> its demo.refit.EngineRefit, made on first use

    def set(self, loras: Sequence[LoraSpec]) -> float | None:
        """Fuse `loras`, added up, in place of those fused before ([]: the base weights, bit for bit). A bad file is
        a one-line UsageError and changes nothing. Returns how long refitting engines took, in ms (None: torch
        stages, or no engine had to change)."""
        if not loras and self.fusion is None and not self.refits:
            return None
        torch_stages = all(isinstance(stage, TorchStage) for stage in self.stages)
        files = [(lora if isinstance(lora, LoraFile) else read_lora(lora), scale) for lora, scale in loras]
        if not torch_stages:
            return self._refit(files)
        if self.fusion is None:
            self.fusion = LoraFusion({stage.model.component: stage.model.component_module(stage.module)
                                      for stage in self.stages})
        self.fusion.set(files)
        substituted = [stage for stage in self.stages if stage.substitution is not None]
        if substituted:  # our fMHA reads a packed copy of the Q, K and V weights
            from plugins.diffusers_modules import repack_qkv

            for stage in substituted:
                repack_qkv(stage.model.component_module(stage.module))
        return None

    def _refit(self, files: list[tuple[LoraFile, float]]) -> float | None:
        """The engines refitted for `files`: every file is checked, and every delta made, before any engine changes."""
        from demo.engine_runtime import EngineStage
        from demo.refit import refit_engines

        if not all(isinstance(stage, EngineStage) and stage.refittable for stage in self.stages):
            raise UsageError(ENGINES_NEED_REFIT)
        targets = {stage.model.component: lora_targets(stage.model.component_skeleton()) for stage in self.stages}
        deltas: dict[str, dict] = defaultdict(dict)
        for component, name, delta in lora_deltas(files, targets):
            deltas[component][name] = delta.numpy()
        return refit_engines(self.stages, self.refits, deltas)
