"""The one place where a command line becomes what the library takes: its flag groups (demo.cli.flags) into a
PipelineSpec and a Request."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from core.errors import UsageError, field
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.options import TorchOptions
from demo.cli.flags import (
    CacheFlags,
    ControlImageFlags,
    ControlNetFlags,
    DemoFlags,
    EngineFlags,
    Flags,
    ImageFlags,
    LoraFlags,
    ModelFlags,
    PrecisionFlags,
    RefinerFlags,
    RequestFlags,
    TorchFlags,
)
from demo.request import Request, load_image
from demo.runtime.spec import PipelineSpec
from models.builtin import CONTROLNET_NAMES, LORA_NAMES


def options_of(flags, options_type: type):
    """The library's options (`options_type`, a dataclass) that a flag group of the same field names sets (those it
    has no flag for keep their defaults)."""
    return options_type(**{item.name: getattr(flags, item.name) for item in dataclasses.fields(options_type)
                           if hasattr(flags, item.name)})


def parse_lora_spec(text: str, name: str = "loras", names: tuple[str, ...] = ()) -> tuple[str, float]:
    """--lora's PATH[:SCALE] (or --controlnet's, `name` the spec's field; `names` the built-ins it takes by name) as
    (path, scale). A path may hold colons: the whole text is the path where it exists, or where what follows the last
    colon is no number and what precedes it does not exist either (read_lora or resolve_controlnet then names it
    missing); a UsageError where what precedes the last colon exists (or is a built-in's name) and what follows is not
    a finite number."""
    path, colon, tail = text.rpartition(":")
    if not colon or Path(text).exists():
        return text, 1.0
    try:
        scale = float(tail)
    except ValueError:
        if Path(path).exists() or path in names:
            raise UsageError(f"{field(name)} {text}: the scale after the last ':' must be a number, got "
                             f"'{tail}'") from None
        return text, 1.0  # no such file either way: the whole text is named as missing
    if not math.isfinite(scale):
        raise UsageError(f"{field(name)} {text}: the scale must be a finite number, got {tail}")
    return path, scale


def spec_from_flags(flags: Flags, **fields) -> PipelineSpec:
    """The pipeline spec a command line asks for: the model, backend, engine and torch flags, LoRA files and refiner of
    the groups the command takes, then `fields`, what the command decides itself (a request's batch, a build's
    size)."""
    values: dict = {}
    if ModelFlags in flags:
        model = flags[ModelFlags]
        values.update(model=model.model, model_config=model.model_config, prediction_type=model.prediction_type,
                      vae=model.vae, vae_precision=model.vae_precision, verbose=model.verbose)
    if DemoFlags in flags:
        values["backend"] = flags[DemoFlags].backend
    if PrecisionFlags in flags:
        values["precision"] = flags[PrecisionFlags].precision
    if EngineFlags in flags:
        engine = flags[EngineFlags]
        values.update(plugins=engine.plugins, use_cuda_graph=engine.use_cuda_graph,
                      engine=options_of(engine, EngineOptions))
    if TorchFlags in flags:
        values["torch"] = options_of(flags[TorchFlags], TorchOptions)
    if LoraFlags in flags:
        values["loras"] = tuple(parse_lora_spec(text, "loras", LORA_NAMES) for text in flags[LoraFlags].lora or ())
    if ControlNetFlags in flags:
        values["controlnets"] = tuple(parse_lora_spec(text, "controlnets", CONTROLNET_NAMES)
                                      for text in flags[ControlNetFlags].controlnet or ())
    if CacheFlags in flags:
        cache = flags[CacheFlags]
        values.update(cache_interval=cache.cache_interval, cache_branch=cache.cache_branch,
                      cache_threshold=cache.cache_threshold, cache_max_skips=cache.cache_max_skips,
                      cache_forecast=cache.cache_forecast)
    if RefinerFlags in flags:
        refiner = flags[RefinerFlags]
        values.update(refiner=refiner.refiner, high_noise_frac=refiner.high_noise_frac)
    return PipelineSpec(**{**values, **fields})


def request_from_flags(flags: Flags) -> Request:
    """The request a command line asks for, its input image (RGB) and mask read where given (a one-line UsageError
    where one cannot be)."""
    request = Request(**dataclasses.asdict(flags[RequestFlags]))
    if ControlImageFlags in flags:
        control = flags[ControlImageFlags]
        images = tuple(load_image("control_images", path) for path in control.control_image or ())
        request = dataclasses.replace(request, control_images=images or None,
                                      control_guidance_start=control.control_guidance_start,
                                      control_guidance_end=control.control_guidance_end, guess_mode=control.guess_mode)
    if ImageFlags not in flags:
        return request
    images = flags[ImageFlags]
    image = None if images.input_image is None else load_image("image", images.input_image)
    mask = None if images.mask_image is None else load_image("mask", images.mask_image, "L")
    return dataclasses.replace(request, image=image, mask=mask, strength=images.strength)
