"""LoRA files applied to a pipeline's denoiser and text-encoder stages (models.lora: its family's lora_components),
switched without reloading; how they apply is the stages' own (Stage.lora_applier: fused into the torch backend's
modules, refitted into engines built refittable)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from models.lora import LoraFile, read_lora

if TYPE_CHECKING:
    from demo.backends.base import LoraApplier, Stage

LoraSpec = tuple[str | Path | LoraFile, float]  # a file or LoRA folder (or what read_lora read from it), its scale


class StageLoras:
    """The LoRA files applied to the stages whose components LoRA files change (the family's lora_components: the
    denoiser, the CLIP text encoders)."""

    def __init__(self, stages: Mapping[str, Stage]):
        self.stages = [stage for stage in stages.values()
                       if stage.model.component in stage.model.source.family.lora_components]
        self.applier: LoraApplier | None = None  # made on first use

    def set(self, loras: Sequence[LoraSpec]) -> float | None:
        """Apply `loras`, added up, in place of those applied before ([]: the base weights, bit for bit). A bad file is
        a one-line UsageError and changes nothing. Returns how long changing built stages (refitting engines) took,
        in ms (None: nothing had to change that way)."""
        if not loras and self.applier is None:
            return None
        files = [(lora if isinstance(lora, LoraFile) else read_lora(lora), scale) for lora, scale in loras]
        if self.applier is None:
            self.applier = self.stages[0].lora_applier(self.stages)
        return self.applier.set(files)
