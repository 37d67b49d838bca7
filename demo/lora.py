"""LoRA files fused into a pipeline's UNet and text-encoder stages on the torch backend (models.lora), switched without
reloading. Engines would take the same deltas by refit, which is not there yet."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from core.errors import UsageError
from demo.stages import Stage, TorchStage
from models.lora import COMPONENTS, LoraFile, LoraFusion, read_lora

ENGINES_NEED_REFIT = "LoRA on TensorRT engines needs engine refit, which is not there yet: use --backend torch"

LoraSpec = tuple[str | Path | LoraFile, float]  # a file (or what read_lora read from it) and its scale


class StageLoras:
    """The LoRA files fused into the stages whose models LoRA files change (the UNet, the text encoders)."""

    def __init__(self, stages: Mapping[str, Stage]):
        self.stages = [stage for stage in stages.values() if stage.model.component in COMPONENTS]
        self.fusion: LoraFusion | None = None  # made on first use: engines have no modules to fuse into

    def set(self, loras: Sequence[LoraSpec]) -> None:
        """Fuse `loras`, added up, in place of those fused before ([]: the base weights, bit for bit). A bad file is
        a one-line UsageError and changes nothing."""
        if not loras and self.fusion is None:
            return
        if any(not isinstance(stage, TorchStage) for stage in self.stages):
            raise UsageError(ENGINES_NEED_REFIT)
        files = [(lora if isinstance(lora, LoraFile) else read_lora(lora), scale) for lora, scale in loras]
        if self.fusion is None:
            self.fusion = LoraFusion({stage.model.component: stage.model.component_module(stage.module)
                                      for stage in self.stages})
        self.fusion.set(files)
        substituted = [stage for stage in self.stages if stage.substitution is not None]
        if substituted:  # our fMHA reads a packed copy of the Q, K and V weights
            from plugins.diffusers_modules import repack_qkv

            for stage in substituted:
                repack_qkv(stage.model.component_module(stage.module))
