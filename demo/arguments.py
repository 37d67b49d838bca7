"""Command-line flags shared by demo_diffusion.py and the scripts, and what they turn into."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from core.errors import UsageError


class Parser(argparse.ArgumentParser):
    """Usage errors become one line (UsageError) instead of usage text plus exit."""

    def error(self, message):
        raise UsageError(message)


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command-line entry point: usage errors exit 2, engine build failures 1, and artifacts that
    are missing where nothing may build them (EngineSettings.build_missing) 1, each one line."""
    from core.artifacts import ArtifactError
    from demo.engine import EngineBuildError

    try:
        return body()
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except EngineBuildError as exc:
        print(f"{prog}: engine build failed: {exc}", file=sys.stderr)
        return 1
    except ArtifactError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    from models.builtin import BUILTIN_MODELS

    p.add_argument("--model", default="tiny",
                   help=f"built-in ({', '.join(BUILTIN_MODELS)}), a diffusers-format directory, or a hub id "
                        "(default: tiny)")
    p.add_argument("--verbose", action="store_true", help="show library logs and build details")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    from models.plugin_set import PLUGINS_HELP

    g = p.add_argument_group("ONNX and TensorRT engines")
    g.add_argument("--onnx-dir", default="onnx", help="ONNX artifact directory (default: onnx)")
    g.add_argument("--engine-dir", default="engine", help="TensorRT engine directory (default: engine)")
    g.add_argument("--force-onnx-export", action="store_true", help="re-export ONNX even if cached")
    g.add_argument("--force-onnx-optimize", action="store_true", help="re-optimize ONNX even if cached")
    g.add_argument("--force-engine-build", action="store_true", help="rebuild engines even if cached")
    g.add_argument("--build-static-batch", action="store_true", help="engines for exactly --batch-size")
    g.add_argument("--build-dynamic-shape", action="store_true",
                   help="engines for any height/width in the model's range (default: exactly --height/--width)")
    g.add_argument("--optimization-level", type=int, default=3, help="TensorRT builder level 0-5 (default: 3)")
    g.add_argument("--timing-cache", help="timing cache file, read and updated by builds")
    g.add_argument("--use-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each engine from a CUDA graph (static shapes; default: off); with --backend torch, "
                        "each stage from a graph captured per input shape (default: the torch defaults table)")
    g.add_argument("--plugins", default="auto", help=PLUGINS_HELP + "; with --backend torch, the kernels substituted "
                   "into the diffusers modules (auto: the torch defaults table)")
    g.add_argument("--plugin-convention", default="sdplugins", choices=("sdplugins", "tensorrt"),
                   help="whose plugin nodes the passes emit: ours (sdplugins, default) or TensorRT 8.5/8.6's own "
                        "Stable Diffusion plugins in libnvinfer_plugin (tensorrt), for comparison")
    g.add_argument("--disable-tactic-sources", metavar="NAMES",
                   help="TensorRT tactic sources the builder must not use, e.g. CUDNN where cuDNN is missing")
    g.add_argument("--target-cc", help="target GPUs for TensorRT for RTX builds, e.g. 8.0,8.6,8.9 "
                                       "(default: this machine's GPU)")


def add_torch_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the torch backend alone; --plugins and --use-cuda-graph (engine flags) apply to it too."""
    from demo.torch_accel import COMPILE_MODES, TORCH_DEFAULTS_TABLE

    table = f"{TORCH_DEFAULTS_TABLE.parent.name}/{TORCH_DEFAULTS_TABLE.name}"
    g = p.add_argument_group("PyTorch backend", f"unset, each comes from {table}: the fastest combination "
                                                "scripts/benchmark.py measured on this GPU's compute capability "
                                                "(none there, or no GPU: plain diffusers modules)")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="run the modules in channels-last memory")
    g.add_argument("--compile", default="auto", metavar="MODE",
                   help=f"torch.compile mode: {', '.join(COMPILE_MODES)} (default: auto, from the table)")


# Engine flags the torch backend uses as well.
TORCH_USES_ENGINE_FLAGS = ("plugins", "use_cuda_graph")


def torch_flags_set(parser: argparse.ArgumentParser, args) -> list[str]:
    """Torch-only flags given a non-default value (reported as unused by the engine backends)."""
    return _flags_set(parser, args, add_torch_arguments)


def _flags_set(parser: argparse.ArgumentParser, args, add_group, shared: tuple[str, ...] = ()) -> list[str]:
    """The flags `add_group` adds, less those named in `shared`, that `args` gives a non-default value."""
    group_only = argparse.ArgumentParser(add_help=False)
    add_group(group_only)
    return [action.option_strings[0] for action in group_only._actions
            if action.dest not in shared and getattr(args, action.dest) != parser.get_default(action.dest)]


def torch_settings(args, device):
    """The torch backend's settings for these flags on `device`, and where they came from (a UsageError
    for combinations that cannot run)."""
    from demo.torch_accel import resolve_torch_settings

    return resolve_torch_settings(args.plugins, args.channels_last, args.use_cuda_graph, args.compile, device)


def parse_stages(text: str) -> list[str]:
    """A --stages value (comma-separated stage names) as a list, or a UsageError naming the unknown ones."""
    from models import STAGE_MODELS

    stages = [s for s in text.split(",") if s]
    unknown = [s for s in stages if s not in STAGE_MODELS]
    if unknown or not stages:
        raise UsageError(f"unknown stage(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(STAGE_MODELS)}")
    return stages


def engine_flags_set(parser: argparse.ArgumentParser, args) -> list[str]:
    """Engine flags given a non-default value (reported as unused by the torch backend)."""
    return _flags_set(parser, args, add_engine_arguments, TORCH_USES_ENGINE_FLAGS)


def engine_settings(args, source, flavour: str, batch_size: int, height: int, width: int, guided: bool):
    from demo.engine import (BuildOptions, EngineSettings, ImageProfile, build_targets, parse_tactic_sources,
                             parse_target_ccs)
    from demo.trt_flavour import TensorRTAPI

    if not 0 <= args.optimization_level <= 5:
        raise UsageError(f"--optimization-level must be 0..5, got {args.optimization_level}")
    profile = ImageProfile.for_request(source, batch_size, height, width, args.build_static_batch,
                                       args.build_dynamic_shape)
    if args.use_cuda_graph and not profile.static:
        raise UsageError("--use-cuda-graph needs static shapes: add --build-static-batch and drop --build-dynamic-shape")
    check_engine_image_size(source, height, width)
    check_writable_directory("ONNX directory", Path(args.onnx_dir))
    check_writable_directory("engine directory", Path(args.engine_dir))
    if args.timing_cache:
        check_writable_file("timing cache", Path(args.timing_cache))
    options = BuildOptions(flavour, args.optimization_level, Path(args.timing_cache) if args.timing_cache else None,
                           parse_target_ccs(args.target_cc), parse_tactic_sources(args.disable_tactic_sources))
    build_targets(options, TensorRTAPI(flavour))  # a target the flavour cannot build for fails before any export
    return EngineSettings(Path(args.onnx_dir), Path(args.engine_dir), profile, options, guided=guided,
                          use_cuda_graph=bool(args.use_cuda_graph), force_onnx_export=args.force_onnx_export,
                          force_onnx_optimize=args.force_onnx_optimize, force_engine_build=args.force_engine_build,
                          plugins=engine_plugins(args.plugins, flavour, args.plugin_convention),
                          plugin_convention=args.plugin_convention)


def engine_plugins(text: str, flavour: str, convention: str = "sdplugins") -> tuple[str, ...]:
    """The plugin set engines of `flavour` get for a --plugins value, or a UsageError saying why not."""
    from models.plugin_set import parse_plugin_set
    from plugins import trt_plugins

    plugins = parse_plugin_set(text)
    if plugins and flavour == "tensorrt-rtx":
        if text == "auto":  # TensorRT for RTX cannot load plugin libraries like ours: auto means none there
            return ()
        raise UsageError("TensorRT for RTX cannot load our plugin library; use --plugins none, or --backend tensorrt")
    if plugins and convention == "sdplugins" and trt_plugins.status() != "built":
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


def _unwritable(directory: Path) -> str | None:
    """Why files cannot be made in `directory` (created on demand), or None; creates nothing."""
    existing = directory
    while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"'{existing}' is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable"
    return None


def check_writable_directory(what: str, directory: Path) -> None:
    """A directory the run will write into: a one-line UsageError now, not a traceback after the work."""
    reason = _unwritable(directory)
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
    reason = reason or _unwritable(file.parent)
    if reason:
        raise UsageError(f"{what} '{file}' cannot be written: {reason}")
