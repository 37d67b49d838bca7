"""PipelineSpec: everything that decides what a loaded pipeline is (the model, the backend and its options, LoRA
files, a refiner, the modes, the sizes and batches it runs), frozen and picklable, so that a server's device
processes, a benchmark's contenders and a user's notebook all describe a pipeline the same way (demo.runtime.loader
turns one into a ready pipeline)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from core.errors import UsageError, at_least, field
from core.typed import check_field_types
from demo.backends import AUTO, BACKENDS, REFERENCE_BACKEND
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.options import TorchOptions
from demo.request import MODES
from demo.schedulers import scheduler_named
from models import check_stage_names
from models.families import FAMILIES, FP8
from models.single_file import PREDICTION_TYPES as SINGLE_FILE_PREDICTIONS
from models.source import VAE_PRECISIONS
from models.step_cache import DEFAULT_MAX_SKIPS, StepCache

# auto: the backend's own (engines fp16; torch fp16 on a GPU, fp32 on a CPU); else what some family runs in (a model
# of another family is refused in one line: models.families Family.check_precision)
PRECISIONS = ("auto", *dict.fromkeys(precision for family in FAMILIES for precision in family.precisions))
DEFAULT_HIGH_NOISE_FRAC = 0.8


@dataclass(frozen=True)
class StageOverride:
    """One stage's own plugins and engine options in place of the spec's (sd-ablation runs each stage from the engines
    of its own build, with the plugin families that stage has)."""

    stage: str
    plugins: str | None = None  # None: the spec's
    engine: EngineOptions | None = None  # None: the spec's

    def __post_init__(self):
        check_field_types(self)


@dataclass(frozen=True)
class PipelineSpec:
    """What load_pipeline makes ready. Left as they are, the fields give the built-in `tiny` model on the best backend
    this machine has, for every mode the model runs, at its native size."""

    model: str = "tiny"  # a built-in (models.builtin), a diffusers-format folder, a single file, or a hub id
    model_config: str | None = None  # a single-file model's configs: a diffusers folder (None: the built-in ones)
    prediction_type: str | None = None  # a single-file SD 2.x model's (None: models.single_file's default)
    # another VAE: an AutoencoderKL or AutoencoderTiny folder, a model folder with one in vae/, a single file, or a
    # built-in's name (models.builtin.BUILTIN_VAES)
    vae: str | None = None
    # what the VAE stages run in, one of VAE_PRECISIONS (None: the pipeline's precision, fp32 where the family upcasts)
    vae_precision: str | None = None
    backend: str = AUTO  # demo.backends.BACKENDS
    precision: str = "auto"  # PRECISIONS
    plugins: str = AUTO  # our kernels: none, all, a comma list of plugin keys, or auto (the tuned defaults)
    use_cuda_graph: bool | None = None  # None: the backend's default
    engine: EngineOptions = EngineOptions()  # the TensorRT backends' own options
    torch: TorchOptions = TorchOptions()  # the torch backend's own options
    loras: tuple[tuple[str, float], ...] = ()  # LoRA files and their scales, fused or refitted in
    refiner: str | None = None  # SDXL: refine with this model, an ensemble of experts (text-to-image)
    high_noise_frac: float = DEFAULT_HIGH_NOISE_FRAC  # with a refiner: the part of the schedule the base denoises
    modes: tuple[str, ...] | None = None  # demo.request.MODES to run (None: every mode the model runs)
    stages: tuple[str, ...] | None = None  # build only these stages (build-engines); None: those the modes need
    scheduler: str | None = None  # what requests that name none get (None: the model's own)
    height: int | None = None  # the size requests get unless they say, and engines are built for (None: native)
    width: int | None = None
    batch_size: int = 1  # the batch engines are tuned for
    max_batch_size: int | None = None  # the most images one call runs (None: batch_size; engines take 4 at least)
    guided: bool = True  # engines for guided batches (classifier-free guidance) or unguided ones
    controlnets: tuple[tuple[str, float], ...] = ()  # ControlNets (a built-in name or folder) and their scales
    cache_interval: int = 1  # the step cache: every Nth UNet call runs whole, the rest the shallow pass (1: off)
    cache_branch: int = 0  # the skip branch whose deep features the cached calls reuse (models.unet_cache)
    # the adaptive step cache (models.step_cache): a call runs whole where its indicator moved more than this since the
    # last whole call (0: off), and after cache_max_skips cached calls in a row
    cache_threshold: float = 0.0
    cache_max_skips: int = DEFAULT_MAX_SKIPS
    cache_forecast: bool = False  # cached calls extrapolate the last two whole calls' residuals (transformers)
    stage_overrides: tuple[StageOverride, ...] = ()
    verbose: bool = False  # library logs and build details

    def __post_init__(self):
        """Each field as its type says (core.typed; a path object taken for its text, a LoRA or ControlNet given
        without its scale at scale 1, as on the command line): a UsageError naming the first that is not, before any
        work (check() then checks the values)."""
        for name in ("loras", "controlnets"):
            entries = getattr(self, name)
            if isinstance(entries, (tuple, list)):
                object.__setattr__(self, name, tuple(_scaled(entry) for entry in entries))
        check_field_types(self, paths=("model", "model_config", "vae", "refiner"))

    @property
    def cached_branch(self) -> int | None:
        """The step cache's branch where a cache is on (cache_interval above 1, or cache_threshold above 0: a UNet's
        adaptive cache takes the same shallow pass), else None."""
        return self.cache_branch if self.step_cache.on else None

    @property
    def step_cache(self) -> StepCache:
        """The pipelines' step cache: the fixed schedule, the adaptive one, or none."""
        return StepCache(self.cache_interval, self.cache_threshold, self.cache_max_skips, self.cache_forecast)

    def check(self) -> None:
        """The spec's own values, before anything is resolved, read or loaded: a UsageError naming the field (what
        needs the model is checked when the pipeline is planned)."""
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend '{self.backend}'; choose one of {', '.join(BACKENDS)}")
        if self.prediction_type is not None and self.prediction_type not in SINGLE_FILE_PREDICTIONS:
            raise UsageError(f"{field('prediction_type')} must be one of {', '.join(SINGLE_FILE_PREDICTIONS)}, got "
                             f"'{self.prediction_type}'")
        if self.precision not in PRECISIONS:
            raise UsageError(f"{field('precision')} must be one of {', '.join(PRECISIONS)}, got '{self.precision}'")
        if self.vae_precision is not None and self.vae_precision not in VAE_PRECISIONS:
            raise UsageError(f"{field('vae_precision')} must be one of {', '.join(VAE_PRECISIONS)}, got "
                             f"'{self.vae_precision}'")
        if self.scheduler is not None:
            scheduler_named(self.scheduler)
        at_least("batch_size", self.batch_size, 1)
        at_least("cache_interval", self.cache_interval, 1)
        at_least("cache_branch", self.cache_branch, 0)
        if not math.isfinite(self.cache_threshold) or self.cache_threshold < 0:
            raise UsageError(f"{field('cache_threshold')} must be a finite number at least 0, got "
                             f"{self.cache_threshold}")
        at_least("cache_max_skips", self.cache_max_skips, 1)
        if self.cache_forecast and not self.cache_threshold > 0:
            raise UsageError(f"{field('cache_forecast')} extrapolates what the adaptive step cache keeps: give "
                             f"{field('cache_threshold')} above 0")
        if self.precision == FP8 and self.engine.int8:
            raise UsageError(f"{field('precision')} {FP8} and {field('int8')} are two quantizations of the UNet: ask "
                             "for one")
        if self.cache_threshold > 0 and self.cache_interval > 1:
            raise UsageError(f"{field('cache_threshold')} and {field('cache_interval')} are two step caches: ask for "
                             "one (the adaptive cache decides each call itself)")
        for name in ("loras", "controlnets"):
            for entry, scale in getattr(self, name):
                if not math.isfinite(scale):
                    raise UsageError(f"{field(name)} {entry}: the scale must be a finite number, got {scale}")
        if self.max_batch_size is not None:
            at_least("max_batch_size", self.max_batch_size, 1)
        unknown = [mode for mode in self.modes or () if mode not in MODES]
        if unknown or self.modes == ():
            raise UsageError(f"unknown mode(s) {', '.join(unknown) or '(none)'} in {field('modes')}; choose from "
                             f"{', '.join(MODES)}")
        if self.stages is not None:
            check_stage_names(self.stages)
        if self.stage_overrides:
            check_stage_names([override.stage for override in self.stage_overrides])
        self.engine.check(self.use_cuda_graph)
        for override in self.stage_overrides:
            if override.engine is not None:
                override.engine.check(self.use_cuda_graph)
        self.torch.check()
        self.torch.check_precision(self.precision)


def _scaled(entry):
    """A loras or controlnets entry as (path or name, scale): one given alone (a text or path) at scale 1."""
    if isinstance(entry, (str, os.PathLike)):
        return os.fspath(entry), 1.0
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], os.PathLike):
        return os.fspath(entry[0]), entry[1]
    return entry


def reference_spec(spec: PipelineSpec) -> PipelineSpec:
    """The spec's model, sizes and modes on the reference backend as diffusers runs it: its own torch modules, no
    kernels, CUDA graphs or compiling, no LoRA files or refiner; its ControlNets (diffusers' pipeline has them)."""
    return PipelineSpec(model=spec.model, model_config=spec.model_config, prediction_type=spec.prediction_type,
                        vae=spec.vae, vae_precision=spec.vae_precision, backend=REFERENCE_BACKEND,
                        precision=spec.precision, controlnets=spec.controlnets,
                        plugins="none", use_cuda_graph=False, torch=TorchOptions(channels_last=False, compile="none"),
                        modes=spec.modes, scheduler=spec.scheduler, height=spec.height, width=spec.width,
                        batch_size=spec.batch_size, max_batch_size=spec.max_batch_size, guided=spec.guided,
                        verbose=spec.verbose)
