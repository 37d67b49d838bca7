"""A pipeline plan: a PipelineSpec with every check made and nothing loaded (what demo.runtime.loader.plan_pipeline
gives), and the one place a request is resolved and checked against it (PipelinePlan.checked); `load()` makes the
ready pipeline (demo.runtime.loaded), which knows the plan only by the small protocol it reads."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Callable

import torch

from core.errors import UsageError, field
from demo.backends.base import Backend
from demo.request import Request
from demo.runtime.loaded import Pipeline
from demo.runtime.memory import check_memory
from demo.runtime.spec import PipelineSpec
from demo.schedulers import check_steps
from models.base import StageModel
from models.families import GUESS_MODE
from models.recommended import Recommended
from models.source import ModelSource

Log = Callable[[str], None]


@dataclasses.dataclass
class StagePlan:
    """One model's stages (the base's, or a refiner's) and each one's backend settings."""

    source: ModelSource
    models: list[StageModel]
    settings: dict[str, object]  # stage name -> the backend's settings for it
    reason: str  # where the settings came from

    def settings_of(self, model: StageModel):
        return self.settings[model.name]

    @property
    def denoiser(self) -> StageModel:
        """The stage model that denoises (its family's denoiser stage)."""
        return next(model for model in self.models if model.name == self.source.family.denoiser_stage)


@dataclasses.dataclass
class PipelinePlan:
    """A spec with every check made and nothing loaded: what plan_pipeline gives."""

    spec: PipelineSpec
    backend: Backend
    backend_reason: str
    device: torch.device
    dtype: torch.dtype
    modes: tuple[str, ...]
    base: StagePlan
    refiner: StagePlan | None
    loras: list
    notes: list[str]  # what the spec sets that this pipeline does not use, each naming fields (core.errors.field)
    log: Log
    progress: Log
    request: Request | None = None  # the one request the plan was sized for (plan_pipeline), resolved and checked

    @property
    def source(self) -> ModelSource:
        return self.base.source

    def checked(self, request: Request, loras: list | None = None) -> Request:
        """The request resolved for this pipeline with `loras` applied (resolve_request; None: the plan's LoRAs) and
        checked (check): what every face runs. The plan's own request is so already."""
        loras = self.loras if loras is None else loras
        if request is self.request and lora_recommendations(loras) == lora_recommendations(self.loras):
            return request
        request = resolve_request(request, self.spec, self.source, loras)
        self.check(request)
        return request

    def check(self, request: Request) -> None:
        """A UsageError where the loaded pipeline cannot run a resolved request: the request's own checks against the
        model, then what this pipeline was made for (its modes, a refiner's schedule, the backend's limits, its
        ControlNets)."""
        request.check(self.source)
        # the pipeline's weights are counted when it is planned: a call's own floor is its activations'
        check_memory(self.source, request.images, request.height, request.width, self.device, self.dtype,
                     loaded=True)
        if request.mode not in self.modes:
            raise UsageError(f"this pipeline runs {', '.join(self.modes)}, not {request.mode}: load it with that "
                             f"among its {field('modes')}")
        if self.refiner is not None:
            if request.timesteps is not None:  # the ensemble splits the schedule of a step count between its experts
                raise UsageError(f"{field('timesteps')}: a pipeline with a refiner splits the schedule of "
                                 f"{field('denoising_steps')}; give that instead")
            check_steps(request.make_scheduler(self.refiner.source), request.scheduler, request.denoising_steps)
        self.backend.check_request(self.base.settings_of(self.base.denoiser), self.source, request)
        check_control_images(request, self.spec)
        if request.guess_mode and request.control_images:
            self.source.family.require(GUESS_MODE, self.source.name, field("guess_mode"))

    def build(self) -> dict[str, dict]:
        """Build or find every stage's artifacts (engines), loading nothing; what each took."""
        stats = {}
        for part in filter(None, (self.base, self.refiner)):
            stats.update(self.backend.prepare(part.models, part.settings_of, self.device, self.dtype, self.log,
                                              self.progress))
        return stats

    def load(self) -> Pipeline:
        return Pipeline(self)


def resolve_request(request: Request, spec: PipelineSpec, source: ModelSource, loras: list = ()) -> Request:
    """The request with what it leaves out filled in, in the one order every face gets: the spec's scheduler and size
    (for text-to-image: an image request keeps its image's size), else what the LoRAs (`loras`: (LoraFile, scale)
    pairs) or the model recommend, else the model's (Request.resolved); a random seed."""
    defaults = {"scheduler": spec.scheduler}
    if request.image is None:
        defaults.update(height=spec.height, width=spec.width)
    left_out = {name: value for name, value in defaults.items() if getattr(request, name) is None}
    return replace(request, **left_out).resolved(source, recommended=lora_recommendations(loras))


def lora_recommendations(loras: list) -> tuple[Recommended, ...]:
    """What LoRAs ((LoraFile, scale) pairs) recommend (models.recommended), those that say anything, in order."""
    return tuple(lora.recommended for lora, _ in loras if lora.recommended)


def check_control_images(request: Request, spec: PipelineSpec) -> None:
    """A UsageError where a request brings another number of control images than the pipeline has ControlNets."""
    given, wanted = len(request.control_images or ()), len(spec.controlnets)
    if given != wanted:
        names = ", ".join(name for name, _ in spec.controlnets)
        raise UsageError(f"{field('control_images')}: {given} given; this pipeline has {wanted} ControlNet(s)"
                         + (f" ({names}): one image each, in their order" if wanted else
                            f": load it with {field('controlnets')}"))
