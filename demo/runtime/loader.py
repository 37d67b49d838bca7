"""The one way a pipeline is assembled: a PipelineSpec is planned (every check made, nothing loaded) and then loaded.

    plan = plan_pipeline(spec)        # the model resolved, the backend chosen, LoRA files read, settings checked
    plan.build()                      # artifacts built or found ahead (build-engines), nothing loaded
    pipeline = plan.load()            # stages loaded, LoRA files applied: a ready demo.runtime.loaded.Pipeline
    pipeline = load_pipeline(spec)    # the two at once

The plan (demo.runtime.plan) resolves and checks every request once (PipelinePlan.checked), whichever face made it.

Every command (demo-diffusion, build-engines, compare-backends, sd-serve's device processes, sd-benchmark,
sd-ablation, INT8 calibration) and the Python API go through here.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import replace
from pathlib import Path

import torch

from core.errors import UsageError, field
from demo.backends.base import Backend, Workload
from demo.backends.registry import select_backend
from demo.pipelines import PIPELINES
from demo.request import INPAINTING, TEXT_TO_IMAGE, Request, check_image_size, check_mode, modes_of
from demo.runtime.calibrate import calibration_spec, record_unet_activations
from demo.runtime.loaded import Pipeline
from demo.runtime.logs import configure_library_logging
from demo.runtime.memory import check_memory
from demo.runtime.plan import Log, PipelinePlan, StagePlan, resolve_request
from demo.runtime.report import precision_dtype
from demo.runtime.spec import DEFAULT_HIGH_NOISE_FRAC, PipelineSpec
from models.controlnet import resolve_controlnet
from models.families import (
    ADAPTIVE_CACHE,
    CACHE_FORECAST,
    CLASSIFIER_FREE,
    CONTROLNET,
    ENGINES,
    FP8,
    FP8_BASE,
    INT8,
    LORA,
    REFINER,
    STEP_CACHE,
)
from models.lora import check_loras, model_targets, read_lora
from models.source import ModelSource, resolve_model
from models.stages import (
    check_controlnets,
    check_model_stages,
    image_to_image_stages,
    stage_models,
    text_to_image_stages,
)
from models.unet_cache import Branches

__all__ = ["PipelinePlan", "StagePlan", "load_pipeline", "plan_pipeline", "quiet", "to_stderr"]
REFINER_DIR = "refiner"  # the refiner's ONNX and engines, inside the base's folders (stage names are the same)


def to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quiet(*_) -> None:
    pass


def plan_pipeline(spec: PipelineSpec, device: str | torch.device | None = None, request: Request | None = None,
                  log: Log | None = None, progress: Log = to_stderr, runs: bool = True) -> PipelinePlan:
    """Check everything `spec` asks for and decide how it runs, loading nothing: a UsageError for the first thing that
    cannot be. With `request` (a command's one request), the plan is sized for it: its resolved size, batch and mode
    where the spec leaves them (the plan's `request` is then the resolved one, checked: PipelinePlan.checked). `runs`
    False plans a build only (build-engines): the backend need not run here (TensorRT for RTX builds on a CPU), no
    memory is checked, and the stages are the model's text-to-image ones unless the spec names them. `progress` hears
    of long work (builds, calibration), `log` of the rest (default: nothing, or everything with spec.verbose)."""
    log = log or (print if spec.verbose else quiet)
    configure_library_logging(spec.verbose)
    spec.check()
    fp8 = spec.precision == FP8
    backend, reason = select_backend(spec.backend, runs=runs, fp8=fp8)  # one that cannot run here: refused first
    if spec.loras:
        backend.check_loras(spec_options(spec, backend))
    loras = [(read_lora(path), scale) for path, scale in spec.loras]
    source = resolve_model(spec.model, vae=spec.vae, config=spec.model_config, prediction_type=spec.prediction_type,
                           vae_precision=spec.vae_precision)
    chosen = backend  # and one the model's family cannot run on (its engines not built): refused, or passed over
    backend, reason = select_backend(spec.backend, runs=runs, family=source.family, model=source.name,
                                     controlled=bool(spec.controlnets), loras=bool(spec.loras), fp8=fp8)
    if spec.loras and backend is not chosen:
        backend.check_loras(spec_options(spec, backend))
    check_family_features(spec, source, backend)
    if spec.cache_branch != PipelineSpec.cache_branch:  # a branch the UNet lacks is wrong, the cache on or not
        Branches.of(source.denoiser_config).check(spec.cache_branch)
    controlnets = [(resolve_controlnet(name, source), scale) for name, scale in spec.controlnets]
    check_controlnets(source, controlnets)
    if controlnets and (spec.refiner is not None or spec.engine.int8):
        raise UsageError(f"{field('controlnets')} run without {field('refiner' if spec.refiner else 'int8')} for now")
    if controlnets and spec.step_cache.adaptive:  # a cached call would want their shallow residuals before deciding
        raise UsageError(f"{field('controlnets')} run without {field('cache_threshold')} (the adaptive step cache) for "
                         f"now: use {field('cache_interval')}")
    device = checked_device(device)
    auto = spec.precision == "auto"
    dtype = backend.default_dtype(device, source.family) if auto else precision_dtype(spec.precision)
    if request is not None:
        request = resolve_request(request, spec, source, loras)
        spec = replace(spec, height=request.height if spec.height is None else spec.height,
                       width=request.width if spec.width is None else spec.width,
                       modes=spec.modes or (request.mode,))
    modes = spec.modes or (modes_of(source) if runs else (TEXT_TO_IMAGE,))
    if controlnets:
        modes = controlled_modes(source, modes, chosen=bool(spec.modes))
    if not spec.modes and backend.family_feature == ENGINES:  # none asked: those its engines take
        modes = tuple(mode for mode in modes if mode == TEXT_TO_IMAGE or source.family.engines_take(mode))
    for mode in modes if runs else ():
        check_mode(source, mode)
        if mode != TEXT_TO_IMAGE and backend.family_feature == ENGINES:
            source.family.require_on_engines(mode, source.name, field("mask" if mode == INPAINTING else "image"),
                                             f"{field('backend')} {backend.name}")
    refiner = resolve_refiner(spec, source, modes)
    if loras:
        check_loras(loras, model_targets(source))
    height, width = (source.native_image_size if value is None else value for value in (spec.height, spec.width))
    check_image_size(source, height, width)
    # engines for classifier-free guidance's doubled batches, unless the spec or the model's guidance says otherwise
    guided = spec.guided and source.guidance == CLASSIFIER_FREE
    workload = Workload(spec.batch_size, height, width, guided, spec.max_batch_size)
    if runs:
        check_memory(source, max(spec.batch_size, spec.max_batch_size or 0), height, width, device, dtype)
    record = activation_recorder(spec, device)
    base = stage_plan(backend, spec, source, stage_names(spec, source, modes), workload, device, dtype, record,
                      controlnets)
    refiner_plan = None
    if refiner is not None:  # its own stages, with engines beside the base's; its UNet never INT8 (see below)
        if spec.engine.int8 or fp8:
            to_stderr(f"note: {'--int8' if spec.engine.int8 else '--precision fp8'} quantizes the base UNet; the "
                      "refiner's stays fp16")
        engine = replace(spec.engine, onnx_dir=str(Path(spec.engine.onnx_dir) / REFINER_DIR),
                         engine_dir=str(Path(spec.engine.engine_dir) / REFINER_DIR), int8=False,
                         calibration_prompts=None)
        precision = FP8_BASE if fp8 else spec.precision  # its UNet was not calibrated
        refined = replace(spec, engine=engine, stage_overrides=(), precision=precision)
        refiner_plan = stage_plan(backend, refined, refiner, text_to_image_stages(refiner), workload, device, dtype,
                                  record)
    plan = PipelinePlan(spec, backend, reason, device, dtype, tuple(modes), base, refiner_plan, loras,
                        unused_notes(spec, backend), log, progress)
    if request is not None:
        plan.check(request)
        plan.request = request
    return plan


def checked_device(device: str | torch.device | None) -> torch.device:
    """`device` (None: the GPU, else the CPU) as a torch.device this machine has; a UsageError naming it otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device {device!r} is no torch device ({str(exc).splitlines()[0]})") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"device {device}: a pipeline runs on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise UsageError(f"device {device}: this machine has {count} CUDA device(s)")
    return device


def check_family_features(spec: PipelineSpec, source: ModelSource, backend: Backend) -> None:
    """A UsageError naming the family where the spec asks for what the model's family lacks, or what its engines do
    not take on a backend that builds them (before a ControlNet is resolved: a built-in one is made then; each is
    checked against the model with it: models.stages.check_controlnets), or a precision it does not run in."""
    family = source.family
    if spec.precision != "auto":
        family.check_precision(spec.precision, source.name)
    wanted = ((LORA, "loras", bool(spec.loras)), (REFINER, "refiner", spec.refiner is not None),
              (INT8, "int8", spec.engine.int8), (STEP_CACHE, "cache_interval", spec.cache_interval > 1),
              (ADAPTIVE_CACHE, "cache_threshold", spec.step_cache.adaptive),
              (CACHE_FORECAST, "cache_forecast", spec.cache_forecast),
              (CONTROLNET, "controlnets", bool(spec.controlnets)))
    for feature, name, asked in wanted:
        if asked:
            family.require(feature, source.name, field(name))
            if backend.family_feature == ENGINES:
                family.require_on_engines(feature, source.name, field(name), f"{field('backend')} {backend.name}")


def controlled_modes(source: ModelSource, modes, chosen: bool) -> tuple[str, ...]:
    """Of `modes`, those the model's family runs with ControlNets (demo.pipelines.PIPELINES: where diffusers has a
    ControlNet pipeline for the mode); where the spec or the request `chosen` one it does not, a UsageError."""
    steered = tuple(mode for mode in modes if PIPELINES[source.family.name][mode][1] is not None)
    if chosen and steered != tuple(modes):
        other = next(mode for mode in modes if mode not in steered)
        raise UsageError(f"{field('controlnets')}: model '{source.name}' is of the {source.family.label} family, whose "
                         f"{other} takes no ControlNets (diffusers has no such pipeline); drop {field('image')}, or "
                         f"{field('controlnets')}")
    return steered


def load_pipeline(spec: PipelineSpec, device: str | torch.device | None = None, log: Log | None = None,
                  progress: Log = to_stderr) -> Pipeline:
    """A ready pipeline for `spec` on `device` (default: the GPU, else the CPU): plan_pipeline(...).load()."""
    return plan_pipeline(spec, device, log=log, progress=progress).load()


def resolve_refiner(spec: PipelineSpec, source: ModelSource, modes) -> ModelSource | None:
    """The spec's refiner (None: no refiner), checked against the base and the modes."""
    if spec.refiner is None:
        return None
    if tuple(modes) != (TEXT_TO_IMAGE,):
        other = next(mode for mode in modes if mode != TEXT_TO_IMAGE)
        raise UsageError(f"{field('refiner')} refines SDXL text-to-image, not {other}: drop {field('refiner')}, or "
                         f"{field('image')}")
    if not 0 < spec.high_noise_frac < 1:
        raise UsageError(f"{field('high_noise_frac')} must be between 0 and 1 (both excluded), got "
                         f"{spec.high_noise_frac}")
    refiner = resolve_model(spec.refiner, given="refiner", vae_precision=spec.vae_precision)  # its VAE decodes
    if refiner.family is not source.family or not refiner.family.can_refine(refiner.components):
        raise UsageError(f"{field('refiner')} {spec.refiner} is not an {source.family.label} model that refines (its "
                         f"model_index.json names {refiner.index.get('_class_name')})")
    channels = refiner.denoiser_config["in_channels"]
    if refiner.inpainting or channels != source.latent_channels:  # it takes the base's latents alone
        raise UsageError(f"{field('refiner')} {spec.refiner}: its UNet takes {channels} channels, the base's latents "
                         f"have {source.latent_channels}; a refiner denoises latents alone (not an inpainting model)")
    return refiner


def stage_names(spec: PipelineSpec, source: ModelSource, modes) -> tuple[str, ...]:
    """The stages the spec asks for (each one this model has), or those its modes run."""
    if spec.stages is None:
        text_only = tuple(modes) == (TEXT_TO_IMAGE,)  # the others need the VAE encoder too
        return tuple(text_to_image_stages(source) if text_only else image_to_image_stages(source))
    check_model_stages(source, spec.stages)
    return spec.stages


def spec_options(spec: PipelineSpec, backend: Backend):
    """The spec's options of the backend's own type (its `engine` or its `torch`)."""
    return next(options for options in (spec.engine, spec.torch) if isinstance(options, backend.options_type))


def stage_plan(backend: Backend, spec: PipelineSpec, source: ModelSource, names, workload: Workload,
               device: torch.device, dtype: torch.dtype, record, controlnets=()) -> StagePlan:
    """The stages `names` of `source` (with the step cache's shallow UNet where the spec turns the cache on, the
    ControlNets' after the UNet: (ControlNetSource, scale) each), each with the backend's checked settings: the spec's,
    or a stage override's (a stage that is part of another: that one's)."""
    overrides = {override.stage: override for override in spec.stage_overrides}
    made: dict[tuple, tuple[object, str]] = {}  # one settings object per distinct choice, shared by its stages
    settings = {}
    models = stage_models(source, names, spec.cached_branch, controlnets, spec.step_cache.adaptive)
    for model in models:
        override = overrides.get(model.part_of or model.name)
        plugins = spec.plugins if override is None or override.plugins is None else override.plugins
        options = spec_options(spec, backend)
        if override is not None and override.engine is not None and isinstance(override.engine, backend.options_type):
            options = override.engine
        key = (plugins, options)
        if key not in made:
            made[key] = backend.settings(source, options, plugins, spec.use_cuda_graph, workload, device, dtype,
                                         record, fp8=spec.precision == FP8)
        settings[model.name] = made[key][0]
    reason = next(iter(made.values()))[1]
    return StagePlan(source, models, settings, reason)


def unused_notes(spec: PipelineSpec, backend: Backend) -> list[str]:
    """What the spec sets away from its defaults that this pipeline does not use: the options of other backends, a
    refiner's split without a refiner."""
    unused = [item.name for options in (spec.engine, spec.torch) if not isinstance(options, backend.options_type)
              for item in dataclasses.fields(options) if getattr(options, item.name) != item.default]
    notes = [f"{', '.join(map(field, unused))} unused by the {backend.name} backend"] if unused else []
    if spec.refiner is None and spec.high_noise_frac != DEFAULT_HIGH_NOISE_FRAC:
        notes.append(f"{field('high_noise_frac')} unused without {field('refiner')}")
    if spec.cached_branch is None and spec.cache_branch != PipelineSpec.cache_branch:
        notes.append(f"{field('cache_branch')} unused with {field('cache_interval')} 1 and no "
                     f"{field('cache_threshold')} (no step cache)")
    return notes


def activation_recorder(spec: PipelineSpec, device: torch.device):
    """What records an INT8 calibration for the spec's engines: the torch pipeline of calibration_spec, loaded for the
    renders and closed after them."""

    def record(source, prompts, steps, scheduler, guidance_scale, height, width, progress):
        with load_pipeline(calibration_spec(spec), device, log=quiet, progress=quiet) as pipeline:
            return record_unet_activations(pipeline, prompts, steps, scheduler, guidance_scale, height, width,
                                           progress)

    return record
