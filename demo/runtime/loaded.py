"""A ready pipeline (what load_pipeline gives): its stages loaded, LoRA files applied, a family pipeline per mode over
one set of stages; called with a prompt (the Python API), with requests (sd-serve's batches, benchmarks), and closed."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from PIL import Image

from core.errors import UsageError, field
from demo.pipelines import ExpertsPipeline, make_pipeline, to_uint8
from demo.pipelines.lora import LoraSpec
from demo.pipelines.timer import StageTimer, timed_runs
from demo.request import TEXT_TO_IMAGE, Request
from demo.runtime.report import LatencyReport, device_name, library_versions, precision_name
from demo.schedulers import make_scheduler
from models.lora import LoraFile, read_lora


class Plan(Protocol):
    """What a pipeline is loaded from (demo.runtime.plan.PipelinePlan, which imports this module: the plan knows the
    pipeline, the pipeline only this)."""

    spec: object  # demo.runtime.spec.PipelineSpec
    backend: object  # demo.backends.base.Backend
    backend_reason: str
    device: torch.device
    dtype: torch.dtype
    modes: tuple[str, ...]
    base: object  # demo.runtime.plan.StagePlan: source, models, settings, settings_of, reason
    refiner: object | None
    loras: list
    log: Callable[[str], None]
    progress: Callable[[str], None]

    @property
    def source(self): ...

    def checked(self, request: Request) -> Request: ...


@dataclass
class Result:
    """What a call gives: the images, and the latency report of the call that made them."""

    images: list[Image.Image]
    report: LatencyReport

    @property
    def pixels(self) -> np.ndarray:
        """The images as 8-bit [B, H, W, 3]."""
        return np.stack([np.asarray(image) for image in self.images])


class Pipeline:
    """A loaded pipeline. `pipe("a red circle", seed=0)` renders one request (keyword arguments: demo.request.Request's
    fields) and returns a Result; `run` renders resolved, checked requests that share a call; `close()` (or leaving a
    `with` block) frees its stages' device memory and engines."""

    def __init__(self, plan: Plan):
        """The family pipelines start with no scheduler: each call sets its request's (_use_scheduler), one object
        per scheduler name, so that none is made only to be replaced."""
        self.plan = plan
        self.device, self.dtype, self.backend = plan.device, plan.dtype, plan.backend
        self.loras: list[tuple[LoraFile, float]] = []  # applied now
        self.lora_refit_ms: float | None = None  # what applying them took, where engines were refitted
        self._schedulers: dict[tuple[int, str], object] = {}  # (family pipeline, name) -> its scheduler
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        self.stages, self.refiner_stages = {}, {}
        try:
            with on_device:
                self.stages = self._create(plan.base)
                interval = plan.spec.cache_interval
                self.families = {mode: make_pipeline(plan.source, self.stages, None, self.device, self.dtype,
                                                     mode, interval) for mode in plan.modes}
                if plan.refiner is not None:
                    self.refiner_stages = self._create(plan.refiner)
                    refiner = make_pipeline(plan.refiner.source, self.refiner_stages, None, self.device,
                                            self.dtype, cache_interval=interval)
                    self.families = {TEXT_TO_IMAGE: ExpertsPipeline(self.families[TEXT_TO_IMAGE], refiner,
                                                                    plan.spec.high_noise_frac)}
                if plan.loras:
                    self.set_loras(plan.loras)
        except BaseException:
            self.close()
            raise

    def _create(self, part) -> dict:
        return self.backend.create_stages(part.models, part.settings_of, self.device, self.dtype, self.plan.log,
                                          self.plan.progress)

    # ---- what it is ----------------------------------------------------------------------------------------------
    @property
    def source(self):
        return self.plan.source

    @property
    def spec(self):
        return self.plan.spec

    def family(self, mode: str):
        """The family pipeline (demo.pipelines) that runs `mode`."""
        try:
            return self.families[mode]
        except KeyError:
            raise UsageError(f"this pipeline runs {', '.join(self.families)}, not {mode}: load it with that among "
                             f"its {field('modes')}") from None

    def stats(self) -> dict:
        """What getting the stages ready took and holds (the backend's account)."""
        return self.backend.stats(self.stages, self.plan.base.settings_of)

    # ---- requests ------------------------------------------------------------------------------------------------
    def request(self, prompt: str | Request, **fields) -> Request:
        """`prompt` (or a Request) with `fields`, resolved and checked for this pipeline (PipelinePlan.checked)."""
        return self.plan.checked(prompt if isinstance(prompt, Request) else Request(prompt, **fields))

    def __call__(self, prompt: str | Request, progress=None, **fields) -> Result:
        """The images of one request (a prompt with Request's fields as keyword arguments, or a Request), and their
        latency report. `progress` hears of each denoising step (update(); e.g. a tqdm bar)."""
        request = self.request(prompt, **fields)
        timer = StageTimer(self.device)
        pixels = to_uint8(self.run([request], timer, progress))
        return Result([Image.fromarray(image) for image in pixels], self.report(request, timer))

    def run(self, requests: Sequence[Request], timer: StageTimer | None = None, progress=None,
            pixels: bool = False) -> np.ndarray:
        """One call of resolved, checked requests that share it (demo.request.batch_key): float32 [B, H, W, 3] in
        [0, 1], or with `pixels` 8-bit ones made on the device."""
        family = self.family(requests[0].mode)
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            self._use_scheduler(family, requests[0].scheduler)
            return family(requests, timer or StageTimer(self.device), progress, pixels)

    def _use_scheduler(self, family, name: str) -> None:
        """The request's scheduler on the family's pipelines (a refiner's too), one object per name: a call sets its
        timesteps anew."""
        for pipeline in (family.base, family.refiner) if isinstance(family, ExpertsPipeline) else (family,):
            key = (id(pipeline), name)
            if key not in self._schedulers:
                self._schedulers[key] = make_scheduler(name, pipeline.source)
            pipeline.scheduler = self._schedulers[key]

    def timed_runs(self, request: Request, warmup_runs: int, runs: int,
                   say: Callable[[str], None] = lambda _: None) -> tuple[np.ndarray, list[dict[str, float]]]:
        """`warmup_runs` untimed runs, then `runs` timed ones: the last run's images and each run's stage
        milliseconds (demo.pipelines.timer.timed_runs)."""
        return timed_runs(lambda timer: self.run([request], timer), self.device, warmup_runs, runs, say)

    def unet_calls(self, request: Request) -> int:
        """How many times the UNet runs for a resolved request (some schedulers take extra warm-up steps)."""
        family = self.family(request.mode)
        self._use_scheduler(family, request.scheduler)
        return family.unet_calls(request.denoising_steps, 1.0 if request.strength is None else request.strength)

    def refiner_unet_calls(self, request: Request) -> int:
        """The refiner's part of unet_calls (a pipeline with a refiner)."""
        family = self.family(request.mode)
        self._use_scheduler(family, request.scheduler)
        return family.unet_calls_each(request.denoising_steps)[1]

    def dropped_text(self, text: str) -> str | None:
        """What of `text` the text encoder's token limit cuts off (None: all of it fits)."""
        return next(iter(self.families.values())).dropped_text(text)

    def set_loras(self, loras: Sequence[LoraSpec]) -> float | None:
        """Apply LoRA files ((path, scale) each, added up) in place of those applied before ([]: the base weights, bit
        for bit), without reloading; a refiner keeps its own weights. Returns how long refitting engines took, in ms
        (None: no engine was refitted); the report gives it too."""
        files = [(lora if isinstance(lora, LoraFile) else read_lora(lora), scale) for lora, scale in loras]
        self.lora_refit_ms = next(iter(self.families.values())).set_loras(files)  # the families share the stages
        self.loras = files
        return self.lora_refit_ms

    def report(self, request: Request, timer: StageTimer) -> LatencyReport:
        """The latency report of a call of `request` that `timer` timed."""
        plan, source = self.plan, self.source
        described = self.backend.describe(plan.base.settings[next(iter(plan.base.settings))])
        return LatencyReport(
            prompt=request.prompt if isinstance(request.prompt, str) else list(request.prompt),
            negative_prompt=(request.negative_prompt if not isinstance(request.negative_prompt, tuple)
                             else list(request.negative_prompt)),
            model=source.name if plan.refiner is None else f"{source.name} + {plan.refiner.source.name}",
            backend=self.backend.name, backend_reason=plan.backend_reason, device=device_name(self.device),
            precision=precision_name(self.dtype), scheduler=request.scheduler,
            steps=request.denoising_steps, unet_calls=self.unet_calls(request), guidance_scale=request.guidance_scale,
            seed=request.seed, batch_size=request.images, height=request.height, width=request.width,
            latent_shape=list(source.latent_shape(request.images, request.height, request.width)),
            latency_ms=timer.milliseconds(), versions=library_versions(self.backend),
            plugins=list(described.plugins), options=list(described.options), options_reason=plan.base.reason,
            cache_interval=plan.spec.cache_interval, cache_branch=plan.spec.cached_branch,
            strength=None if request.mode == TEXT_TO_IMAGE else request.strength,
            high_noise_frac=None if plan.refiner is None else plan.spec.high_noise_frac,
            refiner_unet_calls=None if plan.refiner is None else self.refiner_unet_calls(request),
            loras=[{"path": lora.path, "scale": scale} for lora, scale in self.loras],
            lora_refit_ms=self.lora_refit_ms)

    # ---- its end -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the stages (engines, device memory, graphs, modules); idempotent."""
        for stage in [*self.stages.values(), *self.refiner_stages.values()]:
            stage.close()
        self.stages, self.refiner_stages, self.families = {}, {}, {}
        self._schedulers.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
