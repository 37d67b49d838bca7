"""The commands' flags: each group of flags is a frozen dataclass whose fields declare their flags, parsed into it by
one function; their defaults are the library's (a PipelineSpec's, a Request's, EngineOptions', TorchOptions'), and
demo.cli.to_spec turns the groups into a spec and a request.

    parser = Parser(prog="demo-diffusion")
    add_flags(parser, ModelFlags)
    add_flags(parser, RequestFlags, required=("prompt",))
    add_flags(parser, EngineFlags, "ONNX and TensorRT engines")
    flags = parse_flags(parser, argv)
    flags[EngineFlags].onnx_dir, changed(flags[EngineFlags])

A field's flag, help, type and choices are written once, on the field; every command that takes the group
gets the same flags with the same defaults (a command may override a default, e.g. the benchmark's model).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from core.errors import UsageError
from demo.backends import BACKENDS
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.options import COMPILE_MODES, TorchOptions
from demo.request import DEFAULT_PROMPT, DEFAULT_STRENGTH, Request
from demo.runtime.spec import DEFAULT_HIGH_NOISE_FRAC, PRECISIONS, PipelineSpec
from demo.schedulers import (
    DEFAULT_STEPS,
    ETA,
    FEW_STEPS,
    KARRAS_SIGMAS,
    SCHEDULERS,
    TAKER_OF,
    TIMESTEP_SPACING,
    TIMESTEP_SPACINGS,
    TIMESTEPS,
)
from models import shapes
from models.builtin import BUILTIN_NAMES, BUILTIN_VAES, CONTROLNET_NAMES, LORA_NAMES
from models.families import DEFAULT_FP8_SCALES
from models.plugin_set import PLUGINS_HELP
from models.single_file import PREDICTION_TYPES as SINGLE_FILE_PREDICTIONS
from models.single_file import SD2_DEFAULT_PREDICTION
from models.source import DEFAULT_GUIDANCE_SCALE, VAE_PRECISIONS
from plugins.contract import CONVENTIONS

Group = TypeVar("Group")
SPEC, REQUEST, ENGINE, TORCH = PipelineSpec(), Request(DEFAULT_PROMPT), EngineOptions(), TorchOptions()


class Parser(argparse.ArgumentParser):
    """Usage errors become one line (UsageError) instead of usage text plus exit."""

    def error(self, message):
        raise UsageError(message)


def summary(doc: str) -> str:
    """A command's --help description: the first paragraph of its module docstring, whole."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def flag(help: str | Callable[[], str], default: Any = None, *, name: str | None = None, metavar: str | None = None,
         choices: tuple | None = None, positional: bool = False, repeatable: bool = False,
         comma_separated: bool = False) -> Any:
    """A dataclass field that declares its flag: `--field-name` unless `name` says otherwise; booleans that
    default to False are switches, those that default to None take --x / --no-x; a `repeatable` one (a tuple,
    default None) takes one value each time it is given; a `comma_separated` one (a tuple) takes its values as one
    argument, e.g. 999,749,499. A callable `help` is called when the flag is declared (for help that names what
    another module defines)."""
    return field(default=default, metadata={"help": help, "name": name, "metavar": metavar, "choices": choices,
                                            "positional": positional, "repeatable": repeatable,
                                            "comma_separated": comma_separated})


def same_as(group: type, name: str) -> Any:
    """A field declaring the same flag, help and default as `group`'s field `name` (for a command that takes
    that one flag of a group and not the rest)."""
    item = group.__dataclass_fields__[name]
    return field(default=item.default, metadata=item.metadata)


@dataclass(frozen=True)
class ModelFlags:
    model: str = flag(f"built-in ({', '.join(BUILTIN_NAMES)}), a diffusers-format directory, a single-file "
                      ".safetensors checkpoint (SD 1.x/2.x, SDXL base or refiner), or a hub id (default: %(default)s)",
                      SPEC.model)
    model_config: str | None = flag("with a single-file --model: a diffusers folder whose configs describe it "
                                    "(default: the built-in architecture its tensors' names say)", SPEC.model_config,
                                    metavar="DIR")
    prediction_type: str | None = flag(f"with a single-file SD 2.x --model, which cannot tell: what its UNet predicts "
                                       f"(default: {SD2_DEFAULT_PREDICTION})", SPEC.prediction_type,
                                       choices=SINGLE_FILE_PREDICTIONS)
    vae: str | None = flag("decode with another VAE: an AutoencoderKL or AutoencoderTiny folder, a model folder with "
                           f"one in vae/, a single-file VAE .safetensors, or a built-in ({', '.join(BUILTIN_VAES)}) "
                           "(default: the model's own)", SPEC.vae, metavar="PATH")
    vae_precision: str | None = flag("what the VAE runs in (default: the pipeline's precision; fp32 where an SDXL "
                                     "VAE overflows in fp16)", SPEC.vae_precision, choices=tuple(VAE_PRECISIONS))
    verbose: bool = flag("show library logs and build details", SPEC.verbose)


@dataclass(frozen=True)
class PrecisionFlags:
    precision: str = flag("what the pipeline runs in (default auto: the backend's choice for the model's family: on a "
                          "GPU bf16 for SD3 and Flux where it has bf16, else fp16; fp32 on a CPU; TensorRT fp16); "
                          "fp8: SD's and SDXL's UNet GEMMs in FP8, the rest fp16 (torch backend, compute capability "
                          "8.9+: docs/torch-backend.md)",
                          SPEC.precision, choices=PRECISIONS)


@dataclass(frozen=True)
class RequestFlags:
    """What one generation asks for (demo.request.Request): the same flags and defaults in every command that
    renders."""

    prompt: str = flag("text prompt", REQUEST.prompt, positional=True)
    negative_prompt: str | None = flag("negative prompt (default: none, which is an empty prompt, or zero "
                                       "embeddings where an SDXL model's config says so)", REQUEST.negative_prompt)
    batch_size: int = flag("images per run (default: %(default)s)", REQUEST.batch_size)
    height: int | None = flag("image height in pixels, a multiple of 8, SD3's 16 (default: model's native)",
                              REQUEST.height)
    width: int | None = flag("image width in pixels, a multiple of 8, SD3's 16 (default: model's native)",
                             REQUEST.width)
    denoising_steps: int | None = flag("scheduler steps (default: what a LoRA or the model recommends, else "
                                       f"{', '.join(f'{count} for {name}' for name, count in FEW_STEPS.items())}, "
                                       f"else {DEFAULT_STEPS})", REQUEST.denoising_steps)
    guidance_scale: float | None = flag("classifier-free guidance scale; <= 1 disables guidance (default: what a LoRA "
                                        f"or the model recommends, else the model's own: {shapes.GUIDANCE_SCALE:g} "
                                        f"for shapes, {DEFAULT_GUIDANCE_SCALE:g} otherwise)", REQUEST.guidance_scale)
    scheduler: str | None = flag(f"one of {', '.join(SCHEDULERS)} (default: what a LoRA recommends, else the model's "
                                 "own)", REQUEST.scheduler)
    timestep_spacing: str | None = flag(f"{', '.join(TAKER_OF[TIMESTEP_SPACING])}: how the steps spread over the "
                                        "training timesteps (trailing: from the noisiest, as few-step models want; "
                                        "default: the model's scheduler config)", REQUEST.timestep_spacing,
                                        choices=TIMESTEP_SPACINGS)
    karras_sigmas: bool | None = flag(f"{', '.join(TAKER_OF[KARRAS_SIGMAS])}: Karras' noise levels (DPM++2M with them "
                                      "is A1111's DPM++ 2M Karras; default: the model's scheduler config)",
                                      REQUEST.karras_sigmas)
    eta: float | None = flag(f"{', '.join(TAKER_OF[ETA])}: the noise each step adds back, 0..1 (TCD's gamma; "
                             "default: 0, as diffusers' pipelines)", REQUEST.eta, metavar="F")
    timesteps: tuple[int, ...] | None = flag(f"{', '.join(TAKER_OF[TIMESTEPS])}: exactly these timesteps, noisiest "
                                             "first, e.g. 999,749,499,249 (DMD2, SDXL-Lightning); they set the step "
                                             "count", REQUEST.timesteps, metavar="T,T,...", comma_separated=True)
    seed: int | None = flag("random seed (default: a random one, reported)", REQUEST.seed)


@dataclass(frozen=True)
class ImageFlags:
    input_image: str | None = flag("image-to-image: start from this image, resized to --height/--width where given "
                                   "(default: its own size, rounded down to a multiple of 8, SD3's 16)", metavar="PATH")
    strength: float | None = flag("with --input-image: how much of the schedule re-draws it, above 0 and at most 1 "
                                  f"(default: {', '.join(f'{v} for {mode}' for mode, v in DEFAULT_STRENGTH.items())})",
                                  REQUEST.strength, metavar="F")
    mask_image: str | None = flag("inpainting, with --input-image: repaint where this mask is white, keep where it is "
                                  "black (resized with the image)", metavar="PATH")


@dataclass(frozen=True)
class EngineFlags:
    """How ONNX and engines are made and found, and what goes into them (EngineOptions, and the spec's plugins and
    use_cuda_graph, which the torch backend takes too)."""

    onnx_dir: str = flag("ONNX artifact directory (default: %(default)s)", ENGINE.onnx_dir)
    engine_dir: str = flag("TensorRT engine directory (default: %(default)s)", ENGINE.engine_dir)
    force_onnx_export: bool = flag("re-export ONNX even if cached", ENGINE.force_onnx_export)
    force_onnx_optimize: bool = flag("re-optimize ONNX even if cached", ENGINE.force_onnx_optimize)
    force_engine_build: bool = flag("rebuild engines even if cached", ENGINE.force_engine_build)
    build_static_batch: bool = flag("engines for exactly --batch-size", ENGINE.build_static_batch)
    build_dynamic_shape: bool = flag("engines for any height/width in the model's range (default: exactly "
                                     "--height/--width)", ENGINE.build_dynamic_shape)
    build_enable_refit: bool = flag("refittable engines: --lora refits their weights in place, and switching LoRAs "
                                    "needs no rebuild", ENGINE.build_enable_refit)
    optimization_level: int = flag("TensorRT builder level 0-5 (default: %(default)s)", ENGINE.optimization_level)
    timing_cache: str | None = flag("timing cache file, read and updated by builds", ENGINE.timing_cache)
    use_cuda_graph: bool | None = flag("replay each engine from a CUDA graph (default: on where the engines take "
                                       "exactly the request's shapes: --build-static-batch without "
                                       "--build-dynamic-shape); with --backend torch, each stage from a graph captured "
                                       "per input shape (default: the torch defaults)", SPEC.use_cuda_graph)
    plugins: str = flag(f"{PLUGINS_HELP}; with --backend torch, the kernels substituted into the diffusers modules "
                        "(auto: the torch defaults)", SPEC.plugins)
    plugin_convention: str = flag("whose plugin nodes the passes emit: ours (sdplugins, default) or TensorRT "
                                  "8.5/8.6's own Stable Diffusion plugins in libnvinfer_plugin (tensorrt), for "
                                  "comparison", ENGINE.plugin_convention, choices=CONVENTIONS)
    int8: bool = flag("INT8 UNet engine: Q/DQ on its convolutions and linear layers (SmoothQuant where a LayerNorm "
                      "feeds them), calibrated on the pipeline's own activations; attention and norms stay in fp16",
                      ENGINE.int8)
    calibration_prompts: str | None = flag("prompts to calibrate --int8 on, one a line (default: a built-in set of "
                                           "8)", ENGINE.calibration_prompts, metavar="FILE")
    calibration_steps: int = flag("denoising steps of each --int8 calibration render, with the model's own scheduler "
                                  "(default: %(default)s)", ENGINE.calibration_steps)
    disable_tactic_sources: str | None = flag("TensorRT tactic sources the builder must not use, e.g. CUDNN where "
                                              "cuDNN is missing", ENGINE.disable_tactic_sources, metavar="NAMES")
    enable_tactic_sources: str | None = flag("TensorRT tactic sources the builder may time besides its defaults, e.g. "
                                             "CUBLAS_LT (TensorRT 8.6 and later leave cuBLAS, cuBLASLt and cuDNN "
                                             "off)", ENGINE.enable_tactic_sources, metavar="NAMES")
    target_cc: str | None = flag("target GPUs for TensorRT for RTX builds, e.g. 8.0,8.6,8.9 (default: this "
                                 "machine's GPU)", ENGINE.target_cc)


# EngineFlags' fields that are the spec's own (both backends take them), not EngineOptions'.
SHARED_ENGINE_FLAGS = ("plugins", "use_cuda_graph")


@dataclass(frozen=True)
class TorchFlags:
    """The torch backend's own flags (TorchOptions); EngineFlags' plugins and use_cuda_graph apply to it too. Unset,
    each comes from the torch defaults measured on this GPU's compute capability (plugins/tuned_defaults.json)."""

    channels_last: bool | None = flag("run the modules in channels-last memory", TORCH.channels_last)
    compile: str = flag(f"torch.compile mode: {', '.join(COMPILE_MODES)} (default: auto, from the torch defaults)",
                        TORCH.compile, metavar="MODE")
    fp8_scales: str = flag("with --precision fp8, how its operands are scaled: static (per tensor, the activations' "
                           "from the calibration), dynamic (per tensor, from each input) or row (each activation row "
                           f"and weight row from itself) (default: auto, {DEFAULT_FP8_SCALES})", TORCH.fp8_scales,
                           metavar="HOW")


@dataclass(frozen=True)
class LoraFlags:
    lora: tuple[str, ...] | None = flag("fuse this LoRA (a .safetensors file of diffusers/PEFT or kohya keys, a "
                                        f"diffusers LoRA folder, or {', '.join(LORA_NAMES)}, shipped with shapes) "
                                        "into the UNet or transformer and the CLIP text encoders, its delta times "
                                        "SCALE (default 1.0); repeatable, the deltas add up; SD's and SDXL's "
                                        "engines take it by refit, with --build-enable-refit",
                                        metavar="PATH[:SCALE]", repeatable=True)


@dataclass(frozen=True)
class RefinerFlags:
    refiner: str | None = flag("SDXL: then refine with this model (a built-in such as tiny-xl-refiner, or a folder "
                               "of SDXL's refiner), an ensemble of experts", SPEC.refiner, metavar="MODEL")
    high_noise_frac: float = flag("with --refiner: the part of the schedule the base denoises, the rest is the "
                                  "refiner's (default: %(default)s)", DEFAULT_HIGH_NOISE_FRAC)


@dataclass(frozen=True)
class ControlNetFlags:
    controlnet: tuple[str, ...] | None = flag(f"steer the UNet with this ControlNet (a ControlNetModel folder, a "
                                              f"single-file .safetensors in the original layout, or "
                                              f"{', '.join(CONTROLNET_NAMES)}), its residuals times SCALE (default "
                                              "1.0); repeatable: several add up, each with its --control-image",
                                              metavar="PATH[:SCALE]", repeatable=True)


@dataclass(frozen=True)
class ControlImageFlags:
    """A request's ControlNet inputs (demo.request.Request's control fields)."""

    control_image: tuple[str, ...] | None = flag("the conditioning image of each --controlnet, in their order "
                                                 "(resized to the request's size)", metavar="PATH", repeatable=True)
    control_guidance_start: float = flag("the part of the schedule after which the ControlNets start steering "
                                         "(default: %(default)s)", REQUEST.control_guidance_start, metavar="F")
    control_guidance_end: float = flag("the part of the schedule after which they stop (default: %(default)s)",
                                       REQUEST.control_guidance_end, metavar="F")
    guess_mode: bool = flag("guess mode: the ControlNets see the prompt alone, their residuals ramp up the skip "
                            "connections (diffusers' guess_mode)", REQUEST.guess_mode)


@dataclass(frozen=True)
class CacheFlags:
    """The step cache (docs/step-cache.md): the UNet's deep features reused between full calls, every Nth call whole
    or where the adaptive cache decides."""

    cache_interval: int = flag("step cache: every Nth UNet call runs the whole UNet and keeps its deep features, the "
                               "calls between run only the shallow path from them (default: %(default)s, no cache)",
                               SPEC.cache_interval, metavar="N")
    cache_branch: int = flag("with --cache-interval above 1: the skip branch (0 = the shallowest, as DeepCache's "
                             "cache_branch_id) from which the cached calls recompute; higher is slower and closer to "
                             "the uncached image (default: %(default)s)", SPEC.cache_branch, metavar="K")
    cache_threshold: float = flag("the adaptive step cache: each UNet call after the first runs the shallow path, and "
                                  "the whole UNet too where the shallow prediction moved more than T (relative mean "
                                  "absolute change) since the last whole call; higher caches more (default: "
                                  "%(default)s, no cache; not with --cache-interval)", SPEC.cache_threshold,
                                  metavar="T")
    cache_max_skips: int = flag("with --cache-threshold: at most M cached calls in a row (default: %(default)s)",
                                SPEC.cache_max_skips, metavar="M")
    cache_forecast: bool = flag("with --cache-threshold, on SD3 and Flux: a cached call extrapolates the last two "
                                "whole calls' residuals to itself (TaylorSeer's first order) instead of reusing the "
                                "last (docs/step-cache.md: measured, it does not help)", SPEC.cache_forecast)


@dataclass(frozen=True)
class DemoFlags:
    backend: str = flag(f"one of {', '.join(BACKENDS)} (default: %(default)s)", SPEC.backend)
    output_dir: str = flag("where images and the report go (default: %(default)s)", "output")
    num_warmup_runs: int = flag("untimed runs before the timed one (default: %(default)s)", 1)


def _value_type(annotation: str | type) -> tuple[type, bool]:
    """The flag's value type from a field's annotation ("int | None" -> int), and whether it takes several values
    ("tuple[str, ...]")."""
    hint = annotation
    if isinstance(hint, str):  # under `from __future__ import annotations`
        hint = eval(hint, {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple})  # noqa: S307
    if isinstance(hint, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def comma_separated(kind: type) -> Callable[[str], tuple]:
    """argparse's type for a flag of values of `kind` given as one comma-separated argument."""
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(value) for value in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind.__name__}s separated by commas, got '{text}'") from None
    parse.__name__ = f"comma-separated {kind.__name__}s"  # how argparse names the type in its message
    return parse


def option_name(item: dataclasses.Field) -> str:
    return item.metadata["name"] or "--" + item.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, group: type, title: str | None = None,
              required: tuple[str, ...] = (), description: str | None = None, **defaults: Any) -> None:
    """Declare `group`'s flags on `parser` (in an argument group titled `title`, with `description`), with this
    command's `defaults` where it differs; `required` names fields the command needs given (a positional
    becomes mandatory)."""
    target = parser.add_argument_group(title, description) if title else parser
    registered = getattr(parser, "flag_groups", [])
    parser.flag_groups = [*registered, group]
    unknown = set(defaults) - {item.name for item in dataclasses.fields(group)}
    if unknown:
        raise TypeError(f"{group.__name__} has no field(s) {', '.join(sorted(unknown))}")
    for item in dataclasses.fields(group):
        meta = item.metadata
        default = defaults.get(item.name, item.default)
        kind, several = _value_type(item.type)
        help_text = meta["help"]() if callable(meta["help"]) else meta["help"]
        options: dict[str, Any] = {"help": help_text, "default": default, "dest": item.name}
        if kind is bool:
            options["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        elif meta["comma_separated"]:
            options.update(type=comma_separated(kind), metavar=meta["metavar"])
        else:
            options.update(type=kind, metavar=meta["metavar"], choices=meta["choices"])
        if meta["repeatable"]:
            options["action"] = "append"
        elif several and not meta["comma_separated"]:
            options["nargs"] = "+" if item.name in required else "*"
        if meta["positional"]:
            del options["dest"]
            if item.name not in required and not several:
                options["nargs"] = "?"
            target.add_argument(item.name, **options)
        else:
            target.add_argument(option_name(item), required=item.name in required, **options)


def add_pipeline_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of how a pipeline runs, as every rendering command takes them: the step cache, the engines' (with
    the plugins and CUDA graphs both backends take) and the torch backend's own."""
    add_flags(parser, CacheFlags, "step cache")
    add_flags(parser, EngineFlags, "ONNX and TensorRT engines")
    shared = ", ".join("--" + name.replace("_", "-") for name in SHARED_ENGINE_FLAGS)
    add_flags(parser, TorchFlags, "PyTorch backend", description="unset, each comes from the torch defaults measured "
              f"on this GPU's compute capability; {shared} apply to it too")


class Flags:
    """The parsed groups of one command line: `flags[EngineFlags]` is an EngineFlags."""

    def __init__(self, groups: dict[type, Any]):
        self._groups = groups

    def __getitem__(self, group: type[Group]) -> Group:
        return self._groups[group]

    def __contains__(self, group: type) -> bool:
        return group in self._groups

    def replaced(self, value) -> Flags:
        """These flags with one group's value (its type names the group) replaced."""
        return Flags({**self._groups, type(value): value})


def parse_flags(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> Flags:
    """Parse a command line into the groups add_flags declared on `parser` (usage errors: UsageError, via Parser)."""
    return _grouped(parser, parser.parse_args(argv))


def parse_known_flags(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[Flags, list[str]]:
    """parse_flags for a command that hands the arguments it does not know to another command: (its flags, those
    arguments, in their order)."""
    namespace, rest = parser.parse_known_args(argv)
    return _grouped(parser, namespace), rest


def _grouped(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> Flags:
    namespace = {name: tuple(value) if isinstance(value, list) else value for name, value in vars(parsed).items()}
    return Flags({group: group(**{item.name: namespace[item.name] for item in dataclasses.fields(group)})
                  for group in getattr(parser, "flag_groups", [])})


def changed(settings: Any, ignore: tuple[str, ...] = ()) -> list[str]:
    """The flags of a group given a value other than the group's default (less `ignore`), as typed."""
    return [option_name(item) for item in dataclasses.fields(settings)
            if item.name not in ignore and getattr(settings, item.name) != item.default]


def to_argv(settings: Any) -> list[str]:
    """Command-line arguments that parse back into `settings` (for a command run in another process)."""
    argv = []
    for item in dataclasses.fields(settings):
        value = getattr(settings, item.name)
        if value == item.default:
            continue
        values = [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
        if item.metadata["comma_separated"]:
            values = [",".join(values)]
        if item.metadata["positional"]:
            argv += values
        elif isinstance(value, bool):
            argv.append(option_name(item) if value else "--no-" + option_name(item)[2:])
        elif item.metadata["repeatable"]:
            argv += [arg for v in values for arg in (option_name(item), v)]
        else:
            argv += [option_name(item), *values]
    return argv
