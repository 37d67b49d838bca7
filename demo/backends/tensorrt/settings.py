"""The checked EngineSettings that the TensorRT backends' options (options.EngineOptions) give for a model and a
workload, before anything is exported; and what engines so built can run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from core.atomic import check_writable_directory, check_writable_file
from core.errors import UsageError, field
from demo.backends.base import Workload
from demo.backends.tensorrt.build import (
    BuildOptions,
    EngineSettings,
    ImageProfile,
    build_targets,
    parse_target_ccs,
)
from demo.backends.tensorrt.flavour import TensorRTAPI, current_cc
from demo.backends.tensorrt.int8 import int8_request, read_calibration_prompts
from demo.backends.tensorrt.options import EngineOptions, parse_tactic_sources
from demo.request import Request
from demo.schedulers import default_scheduler_name
from models.plugin_set import parse_plugin_set
from models.source import ModelSource
from plugins import trt_plugins
from plugins.contract import OURS


def engine_settings(options: EngineOptions, source: ModelSource, flavour: str, workload: Workload, plugins: str,
                    use_cuda_graph: bool | None, record_activations: Callable | None = None) -> EngineSettings:
    """What engines of `flavour` need for these options and this workload (engines tuned for its batch, taking up to
    its max_batch_size too), checked before anything is exported; `record_activations` (demo.backends.tensorrt.int8)
    calibrates an INT8 UNet."""
    options.check(use_cuda_graph)
    static_batch = options.build_static_batch or use_cuda_graph  # graphs replay one shape: exactly this batch
    batch_size = workload.batch_size
    max_batch = workload.max_batch_size or batch_size
    if max_batch < batch_size or (static_batch and max_batch != batch_size):
        raise UsageError(f"{field('max_batch_size')} must be at least {field('batch_size')} ({batch_size}), or equal "
                         f"to it with {field('build_static_batch')} or {field('use_cuda_graph')}, got {max_batch}")
    if use_cuda_graph and not options.build_static_batch:
        print(f"note: --use-cuda-graph: engines built for exactly batch {batch_size} (as with --build-static-batch)",
              file=sys.stderr)
    profile = ImageProfile.for_request(source, batch_size, workload.height, workload.width, static_batch,
                                       options.build_dynamic_shape, max_batch)
    check_engine_image_size(source, workload.height, workload.width)
    check_writable_directory("ONNX directory", Path(options.onnx_dir))
    check_writable_directory("engine directory", Path(options.engine_dir))
    timing_cache = Path(options.timing_cache) if options.timing_cache else None
    if timing_cache:
        check_writable_file("timing cache", timing_cache)
        if current_cc() is None:  # no GPU to time tactics on: TensorRT can neither use nor fill a cache here
            print(f"note: --timing-cache {timing_cache} is not used without a GPU (it is neither read nor written)",
                  file=sys.stderr)
            timing_cache = None
    if options.build_enable_refit and flavour == "tensorrt-rtx" and current_cc() is None:
        # tensorrt-rtx 1.7 compiles a refittable engine's kernels while building it, which needs a GPU
        raise UsageError(f"{field('build_enable_refit')}: TensorRT for RTX builds refittable engines on a GPU only")
    enabled = parse_tactic_sources(options.enable_tactic_sources)
    disabled = parse_tactic_sources(options.disable_tactic_sources)
    build = BuildOptions(flavour, options.optimization_level, timing_cache, parse_target_ccs(options.target_cc),
                         disabled_tactic_sources=disabled, enabled_tactic_sources=enabled,
                         refit=options.build_enable_refit)
    api = TensorRTAPI(flavour)
    if source.vae_precision == "bf16" and not api.bfloat16:
        raise UsageError(f"{field('vae_precision')} bf16: {api.label} builds no bf16 engines (TensorRT 10 and newer "
                         f"do); use {field('vae_precision')} fp32, or {field('backend')} torch")
    build_targets(build, api)  # a target or tactic source the flavour lacks fails before any export
    api.check_tactic_sources((*enabled, *disabled))
    # Unset, graphs replay engines whose shapes are all static: there a graph saves the launches and costs nothing.
    graphs = profile.static if use_cuda_graph is None else use_cuda_graph
    return EngineSettings(Path(options.onnx_dir), Path(options.engine_dir), profile, build, guided=workload.guided,
                          use_cuda_graph=graphs, force_onnx_export=options.force_onnx_export,
                          force_onnx_optimize=options.force_onnx_optimize,
                          force_engine_build=options.force_engine_build,
                          plugins=engine_plugins(plugins, flavour, options.plugin_convention,
                                                         source.family.tuned_key),
                          plugin_convention=options.plugin_convention,
                          int8=int8_settings(options, source, workload, record_activations),
                          build_missing=options.build_missing, bfloat16=api.bfloat16)


def int8_settings(options: EngineOptions, source: ModelSource, workload: Workload, record_activations):
    """The INT8 request of `int8` (None without it), checked now: calibration renders of the calibration prompts at the
    engines' size, calibration_steps steps of the model's own scheduler and guidance scale (what a request that gives
    none gets); so an INT8 engine, like an fp16 one, serves any steps, scheduler and guidance without a rebuild."""
    if not options.int8:
        return None
    return int8_request(source, read_calibration_prompts(options.calibration_prompts), options.calibration_steps,
                        default_scheduler_name(source), source.default_guidance_scale, workload.height, workload.width,
                        Path(options.onnx_dir), record_activations)


def engine_plugins(text: str, flavour: str, convention: str = OURS, family: str | None = None) -> tuple[str, ...]:
    """The plugin set engines of `flavour` get for a `plugins` value (for a family's models: its tuned key), or a
    UsageError saying why not."""
    plugins = parse_plugin_set(text, family=family)
    if plugins and flavour == "tensorrt-rtx":
        if text == "auto":  # TensorRT for RTX cannot load plugin libraries like ours: auto means none there
            return ()
        raise UsageError(f"TensorRT for RTX cannot load our plugin library; use {field('plugins')} none, or "
                         f"{field('backend')} tensorrt")
    if plugins and convention == OURS and trt_plugins.status() != "built":
        raise UsageError(trt_plugins.status())
    return plugins


def check_engine_image_size(source: ModelSource, height: int, width: int) -> None:
    """The exported UNet upsamples by plain factors of 2: latents must divide by 2**upsamplers. A transformer cuts
    the latents into patches, whatever their count: the model's own multiple (its requests are checked by it)."""
    if source.latent_patch:
        multiple = source.image_size_multiple
    else:
        multiple = source.vae_scale_factor * 2 ** (len(source.denoiser_config["block_out_channels"]) - 1)
    for name, value in (("height", height), ("width", width)):
        if value % multiple:
            raise UsageError(f"{field(name)} {value}: engines of model '{source.name}' need a multiple of {multiple}")


def check_engine_request(settings: EngineSettings, source: ModelSource, request: Request) -> None:
    """A UsageError where engines built for `settings` cannot run a resolved request: guided or not as they were built,
    a batch and a size within their profile."""
    profile = settings.profile
    if request.guided != settings.guided:
        built = "guided batches only (more than 1)" if settings.guided else "unguided batches only (1 or less)"
        raise UsageError(f"{field('guidance_scale')} {request.guidance_scale}: the engines were built for {built}")
    check_engine_image_size(source, request.height, request.width)
    for name, value, (low, _, high) in (("height", request.height, profile.height),
                                        ("width", request.width, profile.width),
                                        ("batch_size", request.images, profile.batch)):
        if not low <= value <= high:
            taken = str(low) if low == high else f"{low}..{high}"
            dynamic = f" (engines built with {field('build_dynamic_shape')} take any size)"
            dynamic = "" if name == "batch_size" else dynamic
            raise UsageError(f"{field(name)} {value}: the engines take {taken}{dynamic}")
