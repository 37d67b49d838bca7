"""The commands' shared plumbing: one-line usage errors, and what the typed flags (demo.settings) turn into."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from core.atomic import writable_reason
from core.errors import RunFailure, UsageError
from demo.settings import EngineFlags, RequestFlags, TorchFlags, at_least
from plugins.contract import OURS


class Parser(argparse.ArgumentParser):
    """Usage errors become one line (UsageError) instead of usage text plus exit."""

    def error(self, message):
        raise UsageError(message)


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command-line entry point: usage errors exit 2, engine build failures 1, artifacts that are
    missing where nothing may build them (EngineSettings.build_missing) 1, and SIGINT / SIGTERM stop it at the
    next safe point with 130 / 143, each one line."""
    import torch

    from core.artifacts import ArtifactError
    from core.interrupts import Interrupted, stop_on_signals
    from demo.engine import EngineBuildError

    try:
        with stop_on_signals():
            return body()
    except (Interrupted, KeyboardInterrupt) as exc:
        print(f"{prog}: interrupted", file=sys.stderr)
        return exc.exit_status if isinstance(exc, Interrupted) else 130
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except RunFailure as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except (MemoryError, torch.OutOfMemoryError) as exc:  # the device's memory, or the host's
        what = (str(exc).strip().splitlines() or ["no detail"])[0][:200]
        print(f"{prog}: error: out of memory ({what}); try a smaller --batch-size, --height or --width",
              file=sys.stderr)
        return 1
    except EngineBuildError as exc:
        print(f"{prog}: engine build failed: {exc}", file=sys.stderr)
        return 1
    except ArtifactError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


def torch_settings(engine: EngineFlags, torch_flags: TorchFlags, device, source):
    """The torch backend's settings for these flags on `device` for the model `source`, and where they came from
    (a UsageError for combinations that cannot run)."""
    from demo.torch_accel import resolve_torch_settings

    return resolve_torch_settings(engine.plugins, torch_flags.channels_last, engine.use_cuda_graph,
                                  torch_flags.compile, device, xl=source.is_xl)


def stages_of(source, chosen: list[str] | None) -> list[str]:
    """The stages a command works on: those chosen (each must be one this model has), or its text-to-image ones."""
    from models import STAGE_MODELS, text_to_image_stages

    if chosen is None:
        return list(text_to_image_stages(source))
    for stage in chosen:
        component = STAGE_MODELS[stage].component
        if component not in source.components:
            raise UsageError(f"stage {stage} needs component '{component}', which model '{source.name}' does not have")
    return chosen


def parse_stages(text: str) -> list[str]:
    """A --stages value (comma-separated stage names) as a list, or a UsageError naming the unknown ones."""
    from models import STAGE_MODELS

    stages = [s for s in text.split(",") if s]
    unknown = [s for s in stages if s not in STAGE_MODELS]
    if unknown or not stages:
        raise UsageError(f"unknown stage(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(STAGE_MODELS)}")
    return stages


def engine_settings(flags: EngineFlags, source, flavour: str, batch_size: int, height: int, width: int, guided: bool,
                    max_batch: int | None = None):
    """What the engine backends need for these flags and this request (engines tuned for `batch_size`, taking up to
    `max_batch` too, by default `batch_size`), checked before anything is exported."""
    from demo.engine import (
        BuildOptions,
        EngineSettings,
        ImageProfile,
        build_targets,
        parse_tactic_sources,
        parse_target_ccs,
    )
    from demo.trt_flavour import TensorRTAPI, current_cc

    if not 0 <= flags.optimization_level <= 5:
        raise UsageError(f"--optimization-level must be 0..5, got {flags.optimization_level}")
    if flags.use_cuda_graph and flags.build_dynamic_shape:
        raise UsageError("--use-cuda-graph needs static shapes: drop --build-dynamic-shape")
    static_batch = flags.build_static_batch or flags.use_cuda_graph  # graphs replay one shape: exactly this request
    max_batch = max_batch or batch_size
    if max_batch < batch_size or (static_batch and max_batch != batch_size):
        raise UsageError(f"--max-batch-size must be at least --batch-size ({batch_size}), or equal to it with "
                         f"--build-static-batch or --use-cuda-graph, got {max_batch}")
    if flags.use_cuda_graph and not flags.build_static_batch:
        print(f"note: --use-cuda-graph: engines built for exactly batch {batch_size} (as with --build-static-batch)",
              file=sys.stderr)
    profile = ImageProfile.for_request(source, batch_size, height, width, static_batch, flags.build_dynamic_shape,
                                       max_batch)
    check_engine_image_size(source, height, width)
    check_writable_directory("ONNX directory", Path(flags.onnx_dir))
    check_writable_directory("engine directory", Path(flags.engine_dir))
    timing_cache = Path(flags.timing_cache) if flags.timing_cache else None
    if timing_cache:
        check_writable_file("timing cache", timing_cache)
        if current_cc() is None:  # no GPU to time tactics on: TensorRT can neither use nor fill a cache here
            print(f"note: --timing-cache {timing_cache} is not used without a GPU (it is neither read nor written)",
                  file=sys.stderr)
            timing_cache = None
    if flags.int8 and flags.build_enable_refit:
        raise UsageError("--int8 engines cannot be refitted (their weights are smoothed and quantized): drop "
                         "--build-enable-refit (and --lora)")
    if flags.calibration_prompts and not flags.int8:
        raise UsageError("--calibration-prompts is for --int8")
    if flags.build_enable_refit and flavour == "tensorrt-rtx" and current_cc() is None:
        # tensorrt-rtx 1.7 compiles a refittable engine's kernels while building it, which needs a GPU
        raise UsageError("--build-enable-refit: TensorRT for RTX builds refittable engines on a GPU only")
    enabled = parse_tactic_sources(flags.enable_tactic_sources)
    disabled = parse_tactic_sources(flags.disable_tactic_sources)
    both = sorted(set(enabled) & set(disabled))
    if both:
        raise UsageError(f"tactic source {', '.join(both)} both enabled and disabled: give it to one of "
                         "--enable-tactic-sources and --disable-tactic-sources")
    options = BuildOptions(flavour, flags.optimization_level, timing_cache, parse_target_ccs(flags.target_cc),
                           disabled_tactic_sources=disabled, enabled_tactic_sources=enabled,
                           refit=flags.build_enable_refit)
    api = TensorRTAPI(flavour)
    build_targets(options, api)  # a target or tactic source the flavour lacks fails before any export
    api.check_tactic_sources((*enabled, *disabled))
    # Unset, graphs replay engines whose shapes are all static: there a graph saves the launches and costs nothing.
    use_cuda_graph = profile.static if flags.use_cuda_graph is None else flags.use_cuda_graph
    return EngineSettings(Path(flags.onnx_dir), Path(flags.engine_dir), profile, options, guided=guided,
                          use_cuda_graph=use_cuda_graph, force_onnx_export=flags.force_onnx_export,
                          force_onnx_optimize=flags.force_onnx_optimize, force_engine_build=flags.force_engine_build,
                          plugins=engine_plugins(flags.plugins, flavour, flags.plugin_convention, source.is_xl),
                          plugin_convention=flags.plugin_convention,
                          int8=int8_settings(flags, source, height, width))


def int8_settings(flags: EngineFlags, source, height: int, width: int):
    """The INT8 request of --int8 (None without it), checked now: calibration renders of --calibration-prompts at the
    engines' size, --calibration-steps steps of the model's own scheduler, the default guidance; so an INT8 engine,
    like an fp16 one, serves any steps, scheduler and guidance without a rebuild."""
    if not flags.int8:
        return None
    from demo.calibrate import int8_request, read_calibration_prompts
    from demo.pipeline import default_scheduler_name

    at_least("--calibration-steps", flags.calibration_steps, 1)
    return int8_request(source, read_calibration_prompts(flags.calibration_prompts), flags.calibration_steps,
                        default_scheduler_name(source), RequestFlags().guidance_scale, height, width,
                        Path(flags.onnx_dir))


def engine_plugins(text: str, flavour: str, convention: str = OURS, xl: bool = False) -> tuple[str, ...]:
    """The plugin set engines of `flavour` get for a --plugins value (for an SDXL model: `xl`), or a UsageError saying
    why not."""
    from models.plugin_set import parse_plugin_set
    from plugins import trt_plugins

    plugins = parse_plugin_set(text, xl=xl)
    if plugins and flavour == "tensorrt-rtx":
        if text == "auto":  # TensorRT for RTX cannot load plugin libraries like ours: auto means none there
            return ()
        raise UsageError("TensorRT for RTX cannot load our plugin library; use --plugins none, or --backend tensorrt")
    if plugins and convention == OURS and trt_plugins.status() != "built":
        raise UsageError(trt_plugins.status())
    return plugins


def check_image_size(source, height: int, width: int) -> None:
    low, high = source.image_size_range
    for flag, value in (("height", height), ("width", width)):
        if value % 8:
            raise UsageError(f"--{flag} must be a multiple of 8, got {value}")
        if not low <= value <= high:
            raise UsageError(f"--{flag} {value} is outside model '{source.name}' range {low}..{high}")


def check_engine_image_size(source, height: int, width: int) -> None:
    """The exported UNet upsamples by plain factors of 2: latents must divide by 2**upsamplers."""
    multiple = source.vae_scale_factor * 2 ** (len(source.config("unet")["block_out_channels"]) - 1)
    for flag, value in (("height", height), ("width", width)):
        if value % multiple:
            raise UsageError(f"--{flag} {value}: engines of model '{source.name}' need a multiple of {multiple}")


def check_writable_directory(what: str, directory: Path) -> None:
    """A directory the run will write into: a one-line UsageError now, not a traceback after the work."""
    reason = writable_reason(directory)
    if reason:
        raise UsageError(f"{what} '{directory}' cannot be written: {reason}")


def check_writable_file(what: str, file: Path) -> None:
    """A file the run reads if present and replaces atomically (so its directory must be writable too)."""
    reason = None
    if file.exists() or file.is_symlink():
        if not file.is_file():
            reason = "it is not a regular file"
        elif not os.access(file, os.R_OK):
            reason = "it is not readable"
    reason = reason or writable_reason(file.parent)
    if reason:
        raise UsageError(f"{what} '{file}' cannot be written: {reason}")
