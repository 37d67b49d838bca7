"""Where the denoiser's GPU time goes (a UNet's, or SD3's and Flux's transformer's) at one torch-backend setting,
kernel family by family.

torch.profiler over N denoiser steps at the batch the pipeline gives it (both guidance halves for classifier-free
guidance): the CUDA kernels grouped by family (attention, GEMM, convolution, normalization, elementwise/other,
memcpy), each family's share of kernel time, and the busiest kernels. With --controlnet (UNets), a step is each
ControlNet's call and then the UNet's on their residuals, as the pipeline runs them.

    python scripts/profile_denoiser.py --steps 10 [--plugins all] [--channels-last] [--use-cuda-graph]
        [--compile default] [--precision auto] [--controlnet DIR[:SCALE] ...]

The settings flags are the torch backend's (demo-diffusion's), defaults included (the tuned torch defaults; the
family's precision). Writes profile-<stage>-<gpu>-<label>.md and .json into --results-dir. Kernels inside CUDA
graphs are listed one by one (CUPTI traces graph launches kernel by kernel). Our kernels (namespace sdp::) are
counted in their family and also on their own.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench.common import ResultsFlags, log, slug
from core.atomic import atomic_write_bytes, check_writable_directory
from core.errors import UsageError, at_least, field
from demo.cli.command import run_command
from demo.cli.flags import (
    ControlNetFlags,
    EngineFlags,
    ModelFlags,
    Parser,
    PrecisionFlags,
    RequestFlags,
    TorchFlags,
    add_flags,
    flag,
    parse_flags,
    same_as,
    summary,
)
from demo.cli.to_spec import spec_from_flags
from models import FLUX_TRANSFORMER, TRANSFORMER, UNET

PROG = "profile_denoiser"
say = partial(log, PROG)
STAGE_TITLES = {UNET: "UNet", TRANSFORMER: "SD3 transformer", FLUX_TRANSFORMER: "Flux transformer"}
FAMILIES = ("attention", "gemm", "conv", "norm", "elementwise/other", "memcpy")

# Tried in this order: attention before conv (cuDNN's SDPA kernels say "fprop") and conv before gemm
# (implicit-GEMM convolutions say "gemm").
_PATTERNS = (
    ("memcpy", re.compile(r"^(memcpy|memset)\b|\b(memcpy|memset) (dtod|htod|dtoh|\(device\))", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|\bmha|mha_|attention|attn|sdpa|softmax", re.IGNORECASE)),
    ("conv", re.compile(r"conv|fprop|dgrad|wgrad|winograd|implicit_gemm|nchwtonhwc|nhwctonchw|im2col", re.IGNORECASE)),
    ("norm", re.compile(r"norm(?!al)|rowwisemoments|computefusedparams|welford", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|gemv|matmul|cublas|cutlass|nvjet|xmma|tensorop|s16816|h16816|h1688|splitkreduce",
                        re.IGNORECASE)),
)
# Inductor names its Triton kernels after the aten ops they fuse: a pointwise kernel "fused_convolution" is a
# convolution's bias epilogue, not a convolution. Only its templates (tem) do matrix or convolution work.
_TRITON = re.compile(r"^triton_(poi|per|red|tem)_")
_TRITON_TEMPLATE = (("gemm", re.compile(r"(^|_)(addmm|mm|bmm|baddbmm)(_|$)")), ("conv", re.compile(r"convolution")),
                    ("attention", re.compile(r"attention|sdpa")))


def is_ours(name: str) -> bool:
    """One of our kernels (plugins/src, namespace sdp)."""
    return "sdp::" in name


def kernel_family(name: str) -> str:
    """The family a CUDA kernel (as the profiler names it) belongs to."""
    if is_ours(name):
        if "attention" in name:
            return "attention"
        if re.search(r"norm_|nchw_|nhwc_|finalize", name):  # the *_norm.cu files, group_norm.cu's others
            return "norm"
        return "elementwise/other"  # split_gelu, seq2spatial, gelu_tanh
    triton = _TRITON.match(name)
    if triton:
        if "norm" in name:
            return "norm"
        if triton.group(1) == "tem":
            return next((family for family, pattern in _TRITON_TEMPLATE if pattern.search(name)), "elementwise/other")
        return "attention" if re.search(r"attention|sdpa|softmax", name) else "elementwise/other"
    return next((family for family, pattern in _PATTERNS if pattern.search(name)), "elementwise/other")


def summarize(kernels: list[tuple[str, float, int]], steps: int, elapsed_ms: float) -> dict:
    """Kernels as (name, total device µs, calls) -> families with time shares, the busiest kernels, totals."""
    total_us = sum(us for _, us, _ in kernels) or 1.0
    families = {family: {"ms": 0.0, "share": 0.0, "kernels": 0, "calls": 0, "ours_ms": 0.0} for family in FAMILIES}
    rows = []
    for name, us, calls in kernels:
        family = kernel_family(name)
        entry = families[family]
        entry["ms"] += us / 1e3
        entry["kernels"] += 1
        entry["calls"] += calls
        entry["ours_ms"] += us / 1e3 if is_ours(name) else 0.0
        rows.append({"name": name, "family": family, "ms": us / 1e3, "calls": calls, "share": us / total_us,
                     "ours": is_ours(name)})
    for entry in families.values():
        entry["share"] = entry["ms"] * 1e3 / total_us
    kernel_ms = total_us / 1e3 if kernels else 0.0
    return {"steps": steps, "kernel_ms": kernel_ms, "kernel_ms_per_step": kernel_ms / steps,
            "elapsed_ms_per_step": elapsed_ms / steps, "gpu_busy": kernel_ms / elapsed_ms if elapsed_ms else None,
            "ours_ms": sum(e["ours_ms"] for e in families.values()), "families": families,
            "kernels": sorted(rows, key=lambda r: -r["ms"])}


def markdown(profile: dict, top: int = 25) -> str:
    stage = profile.get("stage", UNET)  # profiles written before transformers were profiled are UNets', in fp16
    title = STAGE_TITLES.get(stage, stage)
    lines = [f"{title} profile on {profile['gpu']}: {profile['model']}, {profile['workload']}, "
             f"{profile.get('precision', 'fp16')}, torch backend with {profile['settings_text']}; "
             f"{profile['steps']} {title} steps; torch {profile['torch']}.", "",
             f"Per step: {profile['elapsed_ms_per_step']:.2f} ms elapsed (without the profiler), "
             f"{profile['kernel_ms_per_step']:.2f} ms in kernels"
             + (f" (GPU busy {profile['gpu_busy']:.0%})" if profile["gpu_busy"] else "")
             + f"; our kernels {profile['ours_ms'] / profile['steps']:.2f} ms.", "",
             "| family | ms / step | share | kernels | launches / step | of which ours, ms / step |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for family, entry in sorted(profile["families"].items(), key=lambda item: -item[1]["ms"]):
        lines.append(f"| {family} | {entry['ms'] / profile['steps']:.3f} | {entry['share']:.1%} | {entry['kernels']} "
                     f"| {entry['calls'] / profile['steps']:.1f} | {entry['ours_ms'] / profile['steps']:.3f} |")
    lines += ["", f"Busiest {min(top, len(profile['kernels']))} kernels:", "",
              "| kernel | family | ms / step | share | launches / step |", "| --- | --- | ---: | ---: | ---: |"]
    for row in profile["kernels"][:top]:
        name = row["name"] if len(row["name"]) <= 110 else row["name"][:107] + "..."
        lines.append(f"| `{name.replace('|', '/')}` | {row['family']} | {row['ms'] / profile['steps']:.3f} "
                     f"| {row['share']:.1%} | {row['calls'] / profile['steps']:.1f} |")
    return "\n".join(lines) + "\n"


def denoiser_step(stages: dict, denoiser: str, batch: int, height: int, width: int, device, dtype):
    """A denoising step on fixed random inputs, as the pipeline runs it: each ControlNet stage's call, their residuals
    added up, then the UNet's on them (the denoiser stage's alone without ControlNets). Returns a function giving the
    denoiser's outputs."""
    import torch

    from demo.pipelines.controlnet import controlnet_residuals
    from models import is_controlnet_stage

    unet = stages[denoiser]
    feed = unet.model.sample_inputs(batch, height, width, device, dtype, torch.Generator().manual_seed(0))
    steering = [(stage, stage.model.sample_inputs(batch, height, width, device, dtype,
                                                  torch.Generator().manual_seed(1)))
                for name, stage in stages.items() if is_controlnet_stage(name)]

    def step() -> dict:
        return unet({**feed, **controlnet_residuals(steering)})

    return step


@dataclass(frozen=True)
class ProfileFlags:
    height: int | None = same_as(RequestFlags, "height")
    width: int | None = same_as(RequestFlags, "width")
    batch_size: int = same_as(RequestFlags, "batch_size")  # a guided denoiser sees twice as many
    steps: int = flag("denoiser steps profiled (default: %(default)s)", 10)
    warmup_steps: int = flag("denoiser steps before profiling (default: %(default)s)", 3)
    plugins: str = same_as(EngineFlags, "plugins")
    use_cuda_graph: bool | None = same_as(EngineFlags, "use_cuda_graph")
    label: str | None = flag("name of this setting in the output file names (default: from the settings)")
    results_dir: str = same_as(ResultsFlags, "results_dir")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=PROG, description=summary(__doc__))
    add_flags(p, ModelFlags, model="sd1.5-arch")
    add_flags(p, ProfileFlags)
    add_flags(p, PrecisionFlags)
    add_flags(p, ControlNetFlags, "ControlNet", description="profile each ControlNet's call with the UNet's")
    add_flags(p, TorchFlags, "PyTorch backend")
    return run_command(PROG, lambda: profile_denoiser(parse_flags(p, argv)))


def profile_denoiser(flags) -> int:
    # torch and the runtime load here: --help and the flags' own errors answer without them.
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from demo.runtime.loader import load_pipeline
    from demo.runtime.report import run_precision
    from models.families import CLASSIFIER_FREE
    from models.source import resolve_model
    from models.stages import stage_batch

    options = flags[ProfileFlags]
    at_least("steps", options.steps, 1)
    at_least("warmup_steps", options.warmup_steps, 0)
    at_least("batch_size", options.batch_size, 1)
    if not torch.cuda.is_available():
        raise UsageError(f"{PROG} profiles CUDA kernels and needs a CUDA GPU; none is visible")
    check_writable_directory("results directory", Path(options.results_dir))
    device = torch.device("cuda")
    spec = spec_from_flags(flags, backend="torch", precision=flags[PrecisionFlags].precision, plugins=options.plugins,
                           use_cuda_graph=options.use_cuda_graph, height=options.height, width=options.width,
                           batch_size=options.batch_size)
    spec.check()
    family = resolve_model(spec.model, config=spec.model_config).family  # which stage denoises: the family says
    denoiser = family.denoiser_stage
    if spec.controlnets and denoiser != UNET:
        raise UsageError(f"{field('controlnets')}: {PROG} profiles ControlNets with UNets only ({family.label} "
                         f"denoises with a {denoiser})")
    spec = dataclasses.replace(spec, stages=(denoiser,))
    pipeline = load_pipeline(spec, device, progress=lambda line: print(line, flush=True))
    plan = pipeline.plan
    source, settings, reason = plan.source, plan.base.settings[denoiser], plan.base.reason
    height, width = plan.spec.height or source.native_image_size, plan.spec.width or source.native_image_size
    batch = stage_batch(denoiser, options.batch_size, guided=source.guidance == CLASSIFIER_FREE)
    controlnet_names = [Path(name).name for name, _ in plan.spec.controlnets]
    model_name = " + ".join([source.name, *controlnet_names])
    precision = run_precision(spec.precision, pipeline.dtype)
    say(f"{denoiser} of {model_name}, {width}x{height}, batch {batch}, {precision}: {settings.describe()} ({reason})")
    step = denoiser_step(pipeline.stages, denoiser, batch, height, width, device, pipeline.dtype)
    say(f"getting ready (compiling, capturing) and {options.warmup_steps} warm-up steps ...")
    for ready in pipeline.stages.values():
        ready.prepare(batch, height, width)
    for _ in range(options.warmup_steps):
        step()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(options.steps):  # timed without the profiler, whose own overhead would count
        step()
    end.record()
    end.synchronize()
    elapsed_ms = begin.elapsed_time(end)
    say(f"{elapsed_ms / options.steps:.2f} ms per step; profiling {options.steps} steps ...")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(options.steps):
            step()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", None)
        us = us if us is not None else event.self_cuda_time_total
        if us > 0:
            kernels.append((event.key, float(us), int(event.count)))
    if not kernels:
        raise RuntimeError("the profiler recorded no CUDA kernels (is CUPTI available?)")
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "model": model_name, "stage": denoiser, "precision": precision,
              "workload": f"{width}x{height}, {STAGE_TITLES.get(denoiser, denoiser)} batch {batch}",
              "settings": settings.as_dict(), "settings_text": settings.describe(), "settings_reason": reason,
              "torch": torch.__version__, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
              **summarize(kernels, options.steps, elapsed_ms)}
    stem = "-".join([f"profile-{denoiser}", slug(gpu), options.label or slug(settings.describe()),
                     *map(slug, controlnet_names)])
    table = markdown(result)
    results = Path(options.results_dir)
    atomic_write_bytes(results / f"{stem}.json", (json.dumps(result, indent=1) + "\n").encode())
    atomic_write_bytes(results / f"{stem}.md", table.encode())
    print(table, end="")
    say(f"wrote {results / stem}.md and .json")
    return 0

