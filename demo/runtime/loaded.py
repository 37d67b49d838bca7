"""A ready pipeline (what load_pipeline gives): its stages loaded, LoRA files applied, a family pipeline per mode over
one set of stages; called with a prompt (the Python API), with requests (sd-serve's batches, benchmarks), and closed."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from PIL import Image

from core.errors import UsageError, field, render_fields
from demo.backends.registry import why_not_for
from demo.pipelines import ExpertsPipeline, make_pipeline, to_uint8
from demo.pipelines.batch import Batch
from demo.pipelines.lora import LoraSpec
from demo.pipelines.stream import BatchStream
from demo.pipelines.timer import StageTimer, timed_runs
from demo.request import TEXT_TO_IMAGE, Request, request_fields
from demo.runtime.report import LatencyReport, device_name, library_versions, run_precision
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

    def checked(self, request: Request, loras: list | None = None) -> Request: ...


# A call's output_type (diffusers' names): PIL images; float32 [B, H, W, 3] in [0, 1]; a float32 tensor [B, 3, H, W]
OUTPUT_TYPES = ("pil", "np", "pt")


@dataclass
class Result:
    """What a call gives: the images (PIL images, or as its output_type asked), and the latency report of the call
    that made them."""

    images: list[Image.Image] | np.ndarray | torch.Tensor
    report: LatencyReport

    @property
    def pixels(self) -> np.ndarray:
        """The PIL images as 8-bit [B, H, W, 3]."""
        return np.stack([np.asarray(image) for image in self.images])


def denoising_parts(family) -> tuple:
    """The family pipelines that denoise in `family`'s run: an ensemble's base and refiner, else itself."""
    return (family.base, family.refiner) if isinstance(family, ExpertsPipeline) else (family,)


def serialised(method):
    """The pipeline's calls one at a time (its stages, schedulers and step cache hold one call's state: two threads at
    once would draw each other's images), and none once it is closed."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            if self._closed:
                raise UsageError("this pipeline is closed (close() or the end of its with block): load it again")
            return method(self, *args, **kwargs)

    return call


class Pipeline:
    """A loaded pipeline. `pipe("a red circle", seed=0)` renders one request (keyword arguments: demo.request.Request's
    fields, or diffusers' names for them) and returns a Result; `run` renders resolved, checked requests that share a
    call; `close()` (or leaving a `with` block) frees its stages' device memory and engines. Threads may share it:
    its calls run one at a time."""

    def __init__(self, plan: Plan):
        """The family pipelines start with no scheduler: each call sets its request's (_use_scheduler), one object
        per scheduler name, so that none is made only to be replaced."""
        self.plan = plan
        self._lock, self._closed = threading.RLock(), False
        self.device, self.dtype, self.backend = plan.device, plan.dtype, plan.backend
        self.loras: list[tuple[LoraFile, float]] = []  # applied now
        self.lora_refit_ms: float | None = None  # what applying them took, where engines were refitted
        self._schedulers: dict[tuple[int, tuple], object] = {}  # (family pipeline, scheduler key) -> scheduler
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        self.stages, self.refiner_stages = {}, {}
        try:
            with on_device:
                self.stages = self._create(plan.base)
                cache = plan.spec.step_cache
                self.families = {mode: make_pipeline(plan.source, self.stages, None, self.device, self.dtype,
                                                     mode, cache) for mode in plan.modes}
                if plan.refiner is not None:
                    self.refiner_stages = self._create(plan.refiner)
                    refiner = make_pipeline(plan.refiner.source, self.refiner_stages, None, self.device,
                                            self.dtype, cache=cache)
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

    @serialised
    def family(self, mode: str):
        """The family pipeline (demo.pipelines) that runs `mode`."""
        try:
            return self.families[mode]
        except KeyError:
            raise UsageError(f"this pipeline runs {', '.join(self.families)}, not {mode}: load it with that among "
                             f"its {field('modes')}") from None

    @serialised
    def stats(self) -> dict:
        """What getting the stages ready took and holds (the backend's account)."""
        return self.backend.stats(self.stages, self.plan.base.settings_of)

    # ---- requests ------------------------------------------------------------------------------------------------
    @serialised
    def request(self, prompt: str | Request, **fields) -> Request:
        """`prompt` (or a Request) with `fields` (demo.request.request_fields: ours or diffusers' names), resolved and
        checked for this pipeline (PipelinePlan.checked)."""
        if isinstance(prompt, Request):
            if fields:
                raise UsageError(f"a Request comes alone, without {', '.join(fields)}: set them in it")
            return self.plan.checked(prompt, self.loras)
        return self.plan.checked(Request(prompt, **request_fields(fields)), self.loras)

    @serialised
    def __call__(self, prompt: str | Request, progress=None, output_type: str = "pil", **fields) -> Result:
        """The images of one request (a prompt with Request's fields as keyword arguments, or a Request), as
        `output_type` says (OUTPUT_TYPES), and their latency report. `progress` hears of each denoising step
        (update(); e.g. a tqdm bar). A field that does nothing in this call (guess_mode without ControlNets, say) is a
        UserWarning."""
        if output_type not in OUTPUT_TYPES:
            raise UsageError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
        request = self.request(prompt, **fields)
        for note in request.unused():  # what the command line notes; stacklevel: the caller's line, past serialised
            warnings.warn(render_fields(note), UserWarning, stacklevel=3)
        timer = StageTimer(self.device)
        images = self.run([request], timer, progress)
        if output_type == "np":
            return Result(images, self.report(request, timer))
        if output_type == "pt":
            return Result(torch.from_numpy(images).permute(0, 3, 1, 2), self.report(request, timer))
        return Result([Image.fromarray(image) for image in to_uint8(images)], self.report(request, timer))

    @serialised
    def run(self, requests: Sequence[Request], timer: StageTimer | None = None, progress=None,
            pixels: bool = False) -> np.ndarray:
        """One call of resolved, checked requests that share it (demo.request.batch_key): float32 [B, H, W, 3] in
        [0, 1], or with `pixels` 8-bit ones made on the device."""
        if not requests:
            raise UsageError("run takes one request at least, got none")
        family = self.family(requests[0].mode)
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            self._use_scheduler(family, requests[0])
            return family(requests, timer or StageTimer(self.device), progress, pixels)

    @serialised
    def run_stream(self, batches: Sequence[Sequence[Request]], overlap: bool = True,
                   timers: Sequence[StageTimer] | None = None,
                   done: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """Calls of resolved, checked requests (each as `run` takes them) as one stream (demo.pipelines.stream): on a
        GPU with `overlap`, a call's text encoding beside the previous call's loop and its decode beside the next
        one's; each call's 8-bit pixels, those `run(requests, pixels=True)` gives. The calls share a mode and a
        scheduler (the loop's one state)."""
        if not batches or not all(batches):
            raise UsageError("run_stream takes one call at least, of one request at least")
        head = batches[0][0]
        if any(request.mode != head.mode or request.scheduler_key != head.scheduler_key
               for requests in batches for request in requests):
            raise UsageError("a stream's calls share one mode and one scheduler: run the others as a stream of "
                             "their own")
        family = self.family(head.mode)
        if isinstance(family, ExpertsPipeline):
            raise UsageError(f"a pipeline with a {field('refiner')} runs one call at a time: use run")
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            self._use_scheduler(family, head)
            # engines share their working memory; torch.compile's graphing modes one memory pool
            overlap = overlap and self.backend.why_serial(self.plan.base.settings.values()) is None
            return BatchStream(family, self.device, overlap).run([Batch.of(requests) for requests in batches], timers,
                                                                 done)

    def _use_scheduler(self, family, request: Request) -> None:
        """The request's scheduler on the family's pipelines (a refiner's too), one object per name and options
        (Request.scheduler_key): a call sets its timesteps anew."""
        for pipeline in denoising_parts(family):
            key = (id(pipeline), request.scheduler_key)
            if key not in self._schedulers:
                self._schedulers[key] = request.make_scheduler(pipeline.source)
            pipeline.scheduler = self._schedulers[key]

    @serialised
    def timed_runs(self, request: Request, warmup_runs: int, runs: int,
                   say: Callable[[str], None] = lambda _: None) -> tuple[np.ndarray, list[dict[str, float]]]:
        """`warmup_runs` untimed runs, then `runs` timed ones: the last run's images and each run's stage
        milliseconds (demo.pipelines.timer.timed_runs)."""
        return timed_runs(lambda timer: self.run([request], timer), self.device, warmup_runs, runs, say)

    @serialised
    def unet_calls(self, request: Request) -> int:
        """How many times the UNet runs for a resolved request (some schedulers take extra warm-up steps)."""
        family = self.family(request.mode)
        self._use_scheduler(family, request)
        return family.unet_calls(request.denoising_steps, 1.0 if request.strength is None else request.strength,
                                 request.timesteps)

    @serialised
    def cache_whole_calls(self, request: Request) -> int:
        """How many denoiser calls ran whole in the last run of the request's mode under the step cache, as its
        schedules counted them (a refiner's included: it counts its own)."""
        return sum(pipeline.last_schedule.whole_calls for pipeline in denoising_parts(self.family(request.mode)))

    @serialised
    def refiner_unet_calls(self, request: Request) -> int:
        """The refiner's part of unet_calls (a pipeline with a refiner)."""
        family = self.family(request.mode)
        self._use_scheduler(family, request)
        return family.unet_calls_each(request.denoising_steps)[1]

    @serialised
    def dropped_text(self, text: str) -> str | None:
        """What of `text` the text encoder's token limit cuts off (None: all of it fits)."""
        return next(iter(self.families.values())).dropped_text(text)

    @serialised
    def set_loras(self, loras: Sequence[LoraSpec]) -> float | None:
        """Apply LoRA files ((path, scale) each, added up) in place of those applied before ([]: the base weights, bit
        for bit), without reloading; a refiner keeps its own weights. Returns how long refitting engines took, in ms
        (None: no engine was refitted); the report gives it too."""
        source = self.plan.source
        unfit = loras and why_not_for(self.backend, source.family, source.name, loras=True)
        if unfit:  # a pipeline loaded without LoRAs on engines whose refit is not built (SD3's, Flux's)
            raise UsageError(unfit)
        files = [(lora if isinstance(lora, LoraFile) else read_lora(lora), scale) for lora, scale in loras]
        self.lora_refit_ms = next(iter(self.families.values())).set_loras(files)  # the families share the stages
        self.loras = files
        return self.lora_refit_ms

    @serialised
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
            precision=run_precision(plan.spec.precision, self.dtype), scheduler=request.scheduler,
            steps=request.denoising_steps, unet_calls=self.unet_calls(request), guidance_scale=request.guidance_scale,
            seed=request.seed, batch_size=request.images, height=request.height, width=request.width,
            latent_shape=list(source.latent_shape(request.images, request.height, request.width)),
            latency_ms=timer.milliseconds(), versions=library_versions(self.backend),
            plugins=list(described.plugins), options=list(described.options), options_reason=plan.base.reason,
            cache_interval=plan.spec.cache_interval, cache_branch=plan.spec.cached_branch,
            cache_threshold=plan.spec.cache_threshold,
            cache_max_skips=plan.spec.cache_max_skips if plan.spec.step_cache.adaptive else None,
            cache_forecast=plan.spec.cache_forecast,
            cache_whole_calls=self.cache_whole_calls(request) if plan.spec.step_cache.on else None,
            strength=None if request.mode == TEXT_TO_IMAGE else request.strength,
            scheduler_options=request.scheduler_options,
            high_noise_frac=None if plan.refiner is None else plan.spec.high_noise_frac,
            refiner_unet_calls=None if plan.refiner is None else self.refiner_unet_calls(request),
            loras=[{"path": lora.path, "scale": scale} for lora, scale in self.loras],
            lora_refit_ms=self.lora_refit_ms, denoiser=plan.base.denoiser.label or plan.base.denoiser.name)

    # ---- its end -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the stages (engines, device memory, graphs, modules); idempotent: a call after it is a UsageError."""
        with self._lock:
            self._closed = True
            self._free()

    def _free(self) -> None:
        for stage in [*self.stages.values(), *self.refiner_stages.values()]:
            stage.close()
        self.stages, self.refiner_stages, self.families = {}, {}, {}
        self._schedulers.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @serialised
    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
