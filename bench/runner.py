"""Running one benchmark contender, or one ablation configuration: its pipeline loaded from its spec (engines built or
found), made ready (compiled, captured), warmed up, timed run by run; memory, and images compared."""

from __future__ import annotations

import gc
import hashlib
import io
import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from bench.common import STAGES, slug, steered_model, workload_title
from bench.contenders import DIFFUSERS, Contender, contenders, resolve_here
from bench.floor import denoiser_floor
from bench.jobs import BuildPlan, Job
from core.artifacts import ArtifactError
from core.atomic import atomic_write_bytes
from core.errors import UsageError
from demo.backends.registry import backend_named, why_not_for
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.tensorrt.runtime import GENERATED, plugin_counts, time_by_kind
from demo.cli.command import flag_name
from demo.cli.flags import EngineFlags
from demo.cli.to_spec import options_of
from demo.pipelines import image_psnr, to_uint8
from demo.pipelines.timer import timed_runs
from demo.request import TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline, plan_pipeline, quiet
from demo.runtime.report import device_name, precision_name
from demo.runtime.spec import PipelineSpec
from models import UNET
from models.plugin_passes import read_pass_report
from models.quantize import read_int8_report
from models.stages import stage_batch, stage_models, text_to_image_stages
from plugins.contract import OURS, PLUGIN_KEYS

PROFILED_UNET_CALLS = 20  # UNet calls under TensorRT's per-layer profiler, per engine set
SLOWEST_LAYERS = 8  # the UNet engine's slowest layers of each kind, kept beside its time per layer kind
ABLATION_WARMUP_RUNS = 2


@dataclass(frozen=True)
class Workload:
    height: int
    width: int
    batch: int

    def title(self, model: str, steps: int) -> str:
        return workload_title(model, self.height, self.width, self.batch, steps)

    def slug(self) -> str:
        return f"{self.width}x{self.height}-b{self.batch}"


@dataclass(frozen=True)
class Setup:
    """What every contender of one benchmark run shares."""

    spec: PipelineSpec  # the model's, and the command's engine flags before each contender's own
    source: object  # models.source.ModelSource
    device: object  # torch.device
    dtype: object  # torch.dtype
    request: Request  # resolved: size, scheduler and seed filled in
    engine: EngineFlags  # the engines' flags, before each contender's own
    runs: int
    warmup_runs: int
    engines_from_ablation: str | None = None
    verbose: bool = False
    say: Callable[[str], None] = print

    def request_at(self, workload: Workload) -> Request:
        return replace(self.request, height=workload.height, width=workload.width, batch_size=workload.batch)

    @property
    def model_title(self) -> str:
        return steered_model(self.source.name, self.spec.controlnets)

    def title(self, workload: Workload) -> str:
        return workload.title(self.model_title, self.request.denoising_steps)

    def images_dir(self, work: Path, gpu: str, workload: Workload) -> Path:
        """Where a workload's images go: the name carries everything the images depend on besides the
        contender, so an image is only ever compared with a reference made for the same request."""
        r = self.request
        return work / (f"{slug(gpu)}-{slug(self.model_title)}-{workload.slug()}-{r.denoising_steps}steps-"
                       f"{slug(r.scheduler)}-cfg{r.guidance_scale:g}-seed{r.seed}-{prompt_digest(r)}")


def prompt_digest(request: Request) -> str:
    """What of the request the images directory's name does not spell: its prompts and scheduler options."""
    text = f"{request.prompt}\0{request.negative_prompt!r}"
    if request.scheduler_options:  # without any, the digest of earlier runs' directories
        text += f"\0{sorted(request.scheduler_options.items())!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    gc.collect()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # compiled code and cudagraph trees of the last contender
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def contender_engine_flags(engine: EngineFlags, contender: Contender, workload: Workload,
                           first: Workload) -> EngineFlags:
    """A TensorRT contender's engine flags: plugin-free engines for the first workload in --onnx-dir and
    --engine-dir (so engines build-engines made with the same flags are reused), with all plugins in
    <dir>-plugins, with some in <dir>-plugins-<keys>, other workloads in <dir>[-plugins...]-<W>x<H>-b<batch>;
    static shapes, CUDA graphs. An INT8 UNet's engine has a file of its own, beside the fp16 one of the same
    plugins (whose text encoder and VAE engines it shares)."""
    suffix = plugin_dir_suffix(contender.plugins) + ("" if workload == first else f"-{workload.slug()}")
    return replace(engine, onnx_dir=engine.onnx_dir + suffix, engine_dir=engine.engine_dir + suffix,
                   build_static_batch=True, build_dynamic_shape=False, use_cuda_graph=True,
                   plugins=",".join(contender.plugins) or "none", plugin_convention=OURS, int8=contender.int8,
                   calibration_prompts=engine.calibration_prompts if contender.int8 else None)


def plugin_dir_suffix(plugins: tuple[str, ...]) -> str:
    if not plugins:
        return ""
    return "-plugins" if set(plugins) == set(PLUGIN_KEYS) else "-plugins-" + "-".join(k.lower() for k in plugins)


def contender_spec(setup: Setup, contender: Contender, workload: Workload, first: Workload) -> PipelineSpec:
    """The contender's pipeline at `workload`: its torch settings exactly, or its engines (in their folders, or those
    an ablation built: --engines-from-ablation)."""
    spec = replace(setup.spec, **{"precision": precision_name(setup.dtype), **contender.spec_fields()},
                   modes=(TEXT_TO_IMAGE,), height=workload.height, width=workload.width, batch_size=workload.batch,
                   guided=setup.request.guided)
    if contender.settings is not None:  # the torch backend's
        return spec
    if setup.engines_from_ablation:
        plan = BuildPlan(spec.model, Path(setup.engines_from_ablation), workload.height, workload.width,
                         workload.batch, setup.request.guided, setup.engine.optimization_level,
                         setup.engine.disable_tactic_sources, setup.engine.enable_tactic_sources)
        return plan.config_spec(setup.source, contender.plugins, OURS, use_cuda_graph=True)
    flags = contender_engine_flags(setup.engine, contender, workload, first)
    return replace(spec, engine=options_of(flags, EngineOptions), plugins=flags.plugins,
                   use_cuda_graph=flags.use_cuda_graph)


def why_skip(setup: Setup, contender: Contender, workload: Workload, first: Workload) -> str | None:
    """Why a contender cannot run here (None: it can), decided before anything is loaded."""
    if contender.skip:
        return contender.skip
    unfit = why_not_for(backend_named(contender.spec_fields()["backend"]), setup.source.family, setup.source.name)
    if unfit:  # the family's reason first: it holds on any machine, whatever is installed here
        return unfit
    if contender.precision is not None and contender.precision not in setup.source.family.precisions:
        return f"{setup.source.name} is of the {setup.source.family.label} family, which has no {contender.precision}"
    if contender.ablates and not any(plugin_matches(setup.source)[key] for key in contender.ablates):
        return (f"{'/'.join(contender.ablates)}: nothing in {setup.source.name}'s stages for their kernels, so it "
                "would run as ours does")
    cached = replace(setup.spec, **contender.spec_fields()).step_cache.on
    if contender.backend == DIFFUSERS and cached:
        return "diffusers' pipeline has no step cache"
    if contender.settings is None and setup.engines_from_ablation:  # contender_spec runs the ablation's engines
        lacking = [what for what, wanted in (("INT8", contender.int8), ("ControlNet", bool(setup.spec.controlnets)),
                                             ("step cache", cached)) if wanted]
        if lacking:
            return (f"sd-ablation builds no {', '.join(lacking)} engines ({flag_name('engines_from_ablation')} runs "
                    "its engines)")
    try:
        plan_pipeline(contender_spec(setup, contender, workload, first), setup.device, log=quiet, progress=quiet)
    except UsageError as exc:
        return exc.render(flag_name)
    return None


def plugin_matches(source) -> Counter:
    """How many modules each plugin family's kernel stands in for in the model's text-to-image stages (our kernels
    substituted into their meta modules, channels-first): whether a family has anything to do in this model at all."""
    from demo.backends.torch.settings import computed_part
    from plugins.diffusers_modules import substitute

    replaced = Counter()
    for model in stage_models(source, text_to_image_stages(source)):
        replaced += substitute(computed_part(model.name, model.meta_module()), PLUGIN_KEYS).replaced
    return replaced


def int8_layers(unet, onnx_dir: Path) -> dict:
    """How many layers the INT8 UNet's ONNX quantized, and how many of the engine's layers TensorRT runs on int8
    inputs (fewer: some Q/DQ pairs were not fused into int8 kernels); None where the ONNX's report is gone."""
    try:
        quantized = sum(read_int8_report(unet.model.optimized_onnx_path(onnx_dir, int8=True))["quantized"].values())
    except FileNotFoundError:
        quantized = None
    return {"unet_quantized_layers": quantized, "unet_int8_layers": unet.engine.int8_layers()}


def run_contender(setup: Setup, contender: Contender, workload: Workload, first: Workload) -> tuple[dict, object]:
    """One contender at one workload: (the row's measurements, the image of its last run)."""
    device, say = setup.device, setup.say
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        free_before = torch.cuda.mem_get_info(device)[0]
    spec = contender_spec(setup, contender, workload, first)
    if contender.backend == DIFFUSERS:
        return run_diffusers_pipeline(setup, contender, spec, workload, free_before if cuda else 0)
    if contender.settings is None and setup.engines_from_ablation:
        say(f"{contender.label}: engines from the ablation in {setup.engines_from_ablation}")
    elif contender.settings is None:
        say(f"{contender.label}: engines in {spec.engine.engine_dir} (ONNX in {spec.engine.onnx_dir})")
    start = time.perf_counter()
    pipeline = load_pipeline(spec, device, log=print if setup.verbose else quiet, progress=say)
    row = {"load_s": time.perf_counter() - start}
    try:
        request = setup.request_at(workload)
        say(f"{contender.label}: getting ready (compiling, capturing) ...")
        start = time.perf_counter()
        for name, stage in pipeline.stages.items():
            stage.prepare(stage_batch(name, workload.batch, request.guided), workload.height, workload.width)
        sync(device)
        row["ready_s"] = time.perf_counter() - start
        row.update(pipeline.stats())
        if pipeline.backend.capabilities.artifacts:  # engines capture their graphs while getting ready
            row["capture_s"] = row["ready_s"]
            row["engine_dir"] = str(setup.engines_from_ablation or spec.engine.engine_dir)
            if contender.int8:
                row.update(int8_layers(pipeline.stages["unet"], Path(spec.engine.onnx_dir)))
        images, timings = pipeline.timed_runs(request, setup.warmup_runs, setup.runs,
                                              say=lambda line: say(f"{contender.label}: {line}"))
        calls = pipeline.unet_calls(request)
        whole = pipeline.cache_whole_calls(request) if spec.step_cache.on else calls
        row.update(timed_row(timings, calls, whole, [stage.model for stage in pipeline.stages.values()], spec, workload,
                             request, device))
        if pipeline.backend.capabilities.layer_timings:
            row["unet_ms_by_kind"], row["unet_slowest_layers"] = unet_profile(pipeline.stages["unet"].engine)
        if contender.reference:
            row["unet_error_vs_reference"] = unet_error_vs_reference(setup, contender, workload, first,
                                                                     pipeline.stages["unet"])
        if cuda:
            row.update(memory_row(device, free_before))
        return row, to_uint8(images)
    finally:
        pipeline.close()


def timed_row(timings: list[dict[str, float]], unet_calls: int, whole: int, models: list, spec: PipelineSpec,
              workload: Workload, request: Request, device) -> dict:
    """A row's time fields from its runs' stage milliseconds: the medians, the runs, the UNet's time per call, how many
    calls ran whole (`whole`, as the last run's step cache counted them) and the denoiser's floor (`models`: the
    pipeline's stage models)."""
    floor = denoiser_floor({model.name: model for model in models}, unet_calls, whole,
                           stage_batch(UNET, workload.batch, request.guided), workload.height, workload.width,
                           device_name(device), controlnet_batch=workload.batch if request.guess_mode else None)
    latency = {stage: statistics.median(t[stage] for t in timings) for stage in STAGES}
    return {"unet_calls": unet_calls, "cache_whole_calls": whole, **floor, "latency_ms": latency,
            "latency_ms_runs": timings, "unet_ms_per_call": latency["unet"] / unet_calls}


def memory_row(device, free_before: int) -> dict:
    """A row's memory fields on a GPU: the peak torch allocated, and the device memory held since `free_before`."""
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "device_used_bytes": free_before - torch.cuda.mem_get_info(device)[0]}


def run_diffusers_pipeline(setup: Setup, contender: Contender, spec: PipelineSpec, workload: Workload,
                           free_before: int) -> tuple[dict, object]:
    """diffusers' own pipeline (bench.diffusers_pipeline) at one workload, measured as run_contender measures ours:
    its first call (compiling, recording graphs) as getting ready, then the warm-up and timed runs."""
    from bench.diffusers_pipeline import DiffusersPipeline

    device, say = setup.device, setup.say
    plan = plan_pipeline(spec, device, log=quiet, progress=quiet)  # the stage models, for the floor
    request = setup.request_at(workload)
    start = time.perf_counter()
    compile_mode = None if contender.settings.compile == "none" else contender.settings.compile
    pipeline = DiffusersPipeline(setup.source, setup.spec.controlnets, device, setup.dtype, compile_mode)
    row = {"load_s": time.perf_counter() - start}
    say(f"{contender.label}: getting ready (its first call compiles) ...")
    start = time.perf_counter()
    pipeline(request)
    sync(device)
    row["ready_s"] = time.perf_counter() - start
    if compile_mode is not None:
        row["compile_s"] = row["ready_s"]
    images, timings = timed_runs(lambda timer: pipeline(request, timer), device, setup.warmup_runs, setup.runs,
                                 say=lambda line: say(f"{contender.label}: {line}"))
    calls = pipeline.unet_calls()  # diffusers' loop runs no cache: every call whole
    row.update(timed_row(timings, calls, calls, plan.base.models, spec, workload, request, device))
    if device.type == "cuda":
        row.update(memory_row(device, free_before))
    return row, to_uint8(images)


def unet_profile(engine) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Where a UNet engine's time goes, from TensorRT's per-layer profiler over PROFILED_UNET_CALLS calls on the
    inputs bound last: milliseconds per call summed per layer kind (Engine.layer_kinds), and each kind's slowest
    layers (so that the reformats, say, are named)."""
    kinds = engine.layer_kinds()
    layer_ms = engine.layer_times(PROFILED_UNET_CALLS)
    slowest: dict[str, list[dict]] = {}
    for name, ms in sorted(layer_ms.items(), key=lambda item: -item[1]):
        layers = slowest.setdefault(kinds.get(name, GENERATED), [])
        if len(layers) < SLOWEST_LAYERS:
            layers.append({"layer": name, "ms": ms})
    return time_by_kind(layer_ms, kinds), slowest


def unet_error_vs_reference(setup: Setup, contender: Contender, workload: Workload, first: Workload,
                            unet) -> dict | None:
    """The UNet's output against the reference contender's UNet engine (built beside it, not rebuilt here) on the
    same random inputs: largest absolute difference and relative L2 error; None where that engine is not built.
    The other stages' engines are the reference's own files (an INT8 contender quantizes only the UNet)."""
    reference = resolve_here(contenders()[contender.reference], setup.device,
                             setup.source.family.tuned_key)
    spec = contender_spec(setup, reference, workload, first)
    spec = replace(spec, stages=("unet",), engine=replace(spec.engine, build_missing=False))
    try:
        other = load_pipeline(spec, setup.device, log=quiet, progress=setup.say)
    except ArtifactError as exc:
        setup.say(f"{contender.label}: no UNet error against {reference.label}: {exc}")
        return None
    try:
        batch = stage_batch("unet", workload.batch, setup.request.guided)
        stage = other.stages["unet"]
        stage.prepare(batch, workload.height, workload.width)
        feed = unet.model.sample_inputs(batch, workload.height, workload.width, setup.device, setup.dtype,
                                        torch.Generator().manual_seed(0))
        expected = stage(feed)["latent"].float().clone()
        got = unet(feed)["latent"].float()
        return {"reference": reference.label, "max_abs": float((got - expected).abs().max()),
                "rel_l2": float((got - expected).norm() / expected.norm())}
    finally:
        other.close()


def run_config(plan: BuildPlan, source, request: Request, runs: int, label: str, plugins: tuple[str, ...],
               convention: str, jobs: dict[str, Job]) -> dict:
    """One ablation configuration on its jobs' engines: medians of `runs` timed runs after warm-up, the
    UNet's time per layer kind (TensorRT's per-layer profiler), and each engine's plugin layers against what
    the ONNX passes reported replacing; "image" is the last run's first image."""
    with load_pipeline(plan.config_spec(source, plugins, convention, jobs=jobs), log=quiet, progress=print) \
            as pipeline:
        stages = pipeline.stages
        images, timings = pipeline.timed_runs(request, ABLATION_WARMUP_RUNS, runs)
        unet_calls = pipeline.unet_calls(request)
        kinds = {stage: stages[stage].engine.layer_kinds() for stage in jobs}
        unet_ms_by_kind, unet_slowest_layers = unet_profile(stages["unet"].engine)  # on the last step's inputs
        layers = {}
        for stage, job in jobs.items():
            found = plugin_counts(kinds[stage])
            report = read_pass_report(stages[stage].model.optimized_onnx_path(plan.work / job.folder / "onnx"))
            reported = {k: v["replaced"] for k, v in report.items() if v["replaced"]}
            layers[stage] = {"engine": dict(found), "passes": reported, "match": dict(found) == reported}
    return {
        "label": label, "plugins": list(plugins), "convention": convention,
        "engines": {stage: job.folder for stage, job in jobs.items()},
        "latency_ms": {s: statistics.median(t[s] for t in timings) for s in STAGES},
        "latency_ms_runs": timings, "unet_calls": unet_calls,
        "plugin_layers": layers, "unet_ms_by_kind": unet_ms_by_kind, "unet_slowest_layers": unet_slowest_layers,
        "image": to_uint8(images)[0],
    }


# ---- images -------------------------------------------------------------------------------------------------

def compare_images(image, reference) -> tuple[float | None, int | None]:
    """`image` against `reference`: PSNR in dB (None where identical, or without a reference) and the largest
    pixel difference (0-255; None without a reference)."""
    if reference is None:
        return None, None
    psnr = image_psnr(image, reference)
    difference = int(np.abs(image.astype(int) - reference.astype(int)).max())
    return (None if psnr == float("inf") else round(psnr, 3)), difference


def save_image(path: Path, pixels) -> None:
    buffer = io.BytesIO()
    Image.fromarray(pixels.reshape(-1, *pixels.shape[2:]) if pixels.ndim == 4 else pixels).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())


def load_image(path: Path):
    return np.asarray(Image.open(path)) if path.is_file() else None
