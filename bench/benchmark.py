"""Benchmark every contender on one GPU, in one process, on the same request.

    sd-benchmark [PROMPT] [--contenders LABEL,...] [--extra-shapes] [--runs 5] [--update-defaults]

Contenders (bench/contenders.py): diffusers' own modules, the strongest PyTorch peer (channels-last + torch.compile
reduce-overhead), our torch backend at its best and with each toggle off, TensorRT with and without our plugins.
Everyone gets the same request (the request flags every command takes: the model's native size, own scheduler and
own guidance scale, batch 1, 50 steps and a random seed unless given; the seed, scheduler and guidance scale used
are recorded); --extra-shapes adds 1.5x the size at batch 1, and batch 4. Per contender: load, then get ready
(torch.compile compiling and CUDA-graph capture, engine builds), timed apart; --warmup-runs untimed runs; --runs
timed runs, whose CLIP, UNet, VAE and pipeline medians are reported, with the peak of
torch.cuda.max_memory_allocated (reset per contender), device memory in use, and the image's PSNR and largest pixel
difference against diffusers-eager's for the same request. A contender that cannot run here is reported as skipped,
one that fails as failed, each with its one-line reason; the others go on.

Writes, into --results-dir (file names carry a GPU slug), after every contender: benchmark-<gpu>.json (rows in
the shape report-gpus merges; rows already there for other contenders or workloads are kept, --fresh drops
them), benchmark-<gpu>.md and benchmark-<gpu>.png. With --update-defaults, on a GPU, it then records the
fastest torch-backend combination measured at the first workload as this compute capability's torch defaults
(plugins/tuned_defaults.json, or --defaults-file), which the torch backend's unset flags take.

Engines: plugin-free engines for the first workload live in --onnx-dir / --engine-dir (so engines that
build-engines built with the same flags are reused); with all plugins in <dir>-plugins, with some (tensorrt-auto)
in <dir>-plugins-<keys>, other workloads in <dir>[-plugins...]-<W>x<H>-b<batch>. Build them ahead with
build-engines (--build-static-batch and the same --disable-tactic-sources and --optimization-level) to keep
long builds out of the measuring, or run those sd-ablation built (--engines-from-ablation).
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from bench.charts import gpu_chart
from bench.common import KINDS, ResultsFlags, earlier_entries, log, measuring_parser, one_line, slug
from bench.contenders import (
    CACHED,
    DEFAULT_CONTENDERS,
    EAGER,
    THRESHOLD,
    TRT_INT8,
    Contender,
    resolve_here,
    select_contenders,
)
from bench.gpu_report import merge, read_report
from core.atomic import atomic_write_bytes, check_writable_directory, check_writable_file
from core.errors import UsageError, at_least, field, render_fields
from demo.backends import FLAVOURS, TORCH
from demo.backends.tensorrt.options import MAX_OPTIMIZATION_LEVEL
from demo.cli.command import flag_name, run_command
from demo.cli.flags import (
    CacheFlags,
    ControlImageFlags,
    ControlNetFlags,
    EngineFlags,
    ModelFlags,
    add_flags,
    changed,
    flag,
    option_name,
    parse_flags,
    summary,
)
from demo.cli.to_spec import request_from_flags, spec_from_flags
from demo.request import TEXT_TO_IMAGE, check_image_size
from models.families import FP8
from models.plugin_set import local_compute_capability
from plugins.tuned import TORCH_DEFAULTS, entry_key, write_entry

if TYPE_CHECKING:
    from bench.runner import Setup, Workload
    from demo.request import Request

PROG = "sd-benchmark"
say = partial(log, PROG)
# Engine flags each TensorRT contender sets itself.
PER_CONTENDER = ("build_static_batch", "build_dynamic_shape", "use_cuda_graph", "plugins", "plugin_convention", "int8")


@dataclass(frozen=True)
class BenchmarkFlags:
    runs: int = flag("timed runs per contender; medians reported (default: %(default)s)", 5)
    warmup_runs: int = flag("untimed runs after getting ready (default: %(default)s)", 1)
    contenders: str | None = flag(f"comma list (default: {','.join(DEFAULT_CONTENDERS)}); all; ours+<plugin>+... "
                                  "for ours with exactly those plugins", metavar="LABELS")
    extra_shapes: bool = flag("also 1.5x the height and width at batch 1, and batch 4 at the first size", False)
    work_dir: str = flag("images per contender (default: %(default)s)", "output/benchmark")
    fresh: bool = flag("drop rows an earlier run left in the results JSON", False)
    engines_from_ablation: str | None = flag(
        "run the TensorRT contenders on the engines sd-ablation built in its --work-dir DIR (its 'none' and "
        "'+Seq2Spatial' configurations, with the same --optimization-level and --disable-tactic-sources) instead "
        "of building; a missing engine fails the contender", metavar="DIR")


def build_parser():
    p = measuring_parser(PROG, summary(__doc__), BenchmarkFlags)
    add_flags(p, ControlNetFlags, "ControlNet", description="every contender's, with the request's images")
    add_flags(p, ControlImageFlags, "ControlNet inputs")
    add_flags(p, CacheFlags, "step cache", description="every contender's (default: none); a contender "
              "<label>@cache<N> has its own interval, <label>@thr<T> its own adaptive threshold, with --cache-branch")
    add_flags(p, EngineFlags, "engines (as build-engines takes them)",
              description=", ".join(option_name(item) for item in fields(EngineFlags) if item.name in PER_CONTENDER)
              + ": set per contender")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)))


def run(flags) -> int:
    bench = flags[BenchmarkFlags]
    chosen = select_contenders(bench.contenders)
    check_flags(bench, flags[ResultsFlags], flags[EngineFlags])
    spec_from_flags(flags).check()
    request_from_flags(flags).check_inputs()
    for note in unused_flags(flags, chosen):
        say(f"note: {render_fields(note, flag_name)}")
    return benchmark(flags, chosen)


# The engine flags a run on sd-ablation's engines still takes (bench.jobs.BuildPlan: they pick its engines).
ABLATION_ENGINE_FLAGS = ("optimization_level", "disable_tactic_sources", "enable_tactic_sources")
CALIBRATION_FLAGS = ("calibration_prompts", "calibration_steps")


def unused_flags(flags, chosen: list[Contender]) -> list[str]:
    """What the flags set that no chosen contender uses, each naming fields (core.errors.field)."""
    bench, output, engine, cache = flags[BenchmarkFlags], flags[ResultsFlags], flags[EngineFlags], flags[CacheFlags]
    given = [item.name for item in fields(EngineFlags)
             if item.name not in PER_CONTENDER and getattr(engine, item.name) != item.default]
    engine_runs = [c for c in chosen if c.backend in FLAVOURS]
    notes = []
    if not engine_runs:
        unused = given + (["engines_from_ablation"] if bench.engines_from_ablation else [])
        if unused:
            notes.append(f"{', '.join(map(field, unused))} unused: no TensorRT contender runs")
    elif bench.engines_from_ablation:
        unused = [name for name in given if name not in ABLATION_ENGINE_FLAGS]
        if unused:
            notes.append(f"{', '.join(map(field, unused))} unused with {field('engines_from_ablation')}: its engines "
                         "run as they are, nothing is built")
    elif not any(c.int8 for c in engine_runs):
        unused = [name for name in given if name in CALIBRATION_FLAGS]
        if unused:
            notes.append(f"{', '.join(map(field, unused))} unused without an INT8 contender ({TRT_INT8})")
    own_cache = [c for c in chosen if c.own_cache]
    given = [name for name, on in (("cache_interval", cache.cache_interval > 1), ("cache_threshold",
                                                                                  cache.cache_threshold > 0)) if on]
    if given and len(own_cache) == len(chosen):
        notes.append(f"{field(given[0])} unused: every contender has its own ({CACHED}<N> or {THRESHOLD}<T>)")
    elif not given and not own_cache and cache.cache_branch != CacheFlags.cache_branch:
        notes.append(f"{field('cache_branch')} unused without the step cache ({field('cache_interval')} 1, and no "
                     f"contender{CACHED}<N> or {THRESHOLD}<T>)")
    if output.defaults_file and not output.update_defaults:
        notes.append(f"{field('defaults_file')} unused without {field('update_defaults')}")
    return notes


def check_flags(bench: BenchmarkFlags, output: ResultsFlags, engine: EngineFlags) -> None:
    """What can be checked before the model is resolved (which may generate a built-in one)."""
    at_least("runs", bench.runs, 1)
    at_least("warmup_runs", bench.warmup_runs, 0)
    if not 0 <= engine.optimization_level <= MAX_OPTIMIZATION_LEVEL:
        raise UsageError(f"--optimization-level must be 0..{MAX_OPTIMIZATION_LEVEL}, got {engine.optimization_level}")
    ours = changed(engine, ignore=tuple(item.name for item in fields(EngineFlags) if item.name not in PER_CONTENDER))
    if ours:
        raise UsageError(f"{', '.join(ours)}: the benchmark sets this per contender; choose them with --contenders")
    check_writable_directory("results directory", Path(output.results_dir))
    check_writable_directory("work directory", Path(bench.work_dir))
    if output.update_defaults:
        check_writable_file("tuned-defaults file", output.defaults_path)
    if bench.engines_from_ablation and not Path(bench.engines_from_ablation).is_dir():
        raise UsageError(f"--engines-from-ablation: no such directory: {bench.engines_from_ablation}")


def workloads_of(request: Request, extra_shapes: bool, source) -> list[Workload]:
    """The resolved request's size and batch, then (--extra-shapes) 1.5x the size, and batch 4."""
    from bench.runner import Workload
    workloads = [Workload(request.height, request.width, request.batch_size)]
    if extra_shapes:
        workloads += [Workload(request.height * 3 // 2 // 8 * 8, request.width * 3 // 2 // 8 * 8, 1),
                      Workload(request.height, request.width, 4)]
    for workload in workloads:
        check_image_size(source, workload.height, workload.width)
    return list(dict.fromkeys(workloads))


def compute_capability(device) -> str | None:
    return local_compute_capability() if device.type == "cuda" else None


class Results:
    """The results JSON, markdown and chart of one GPU, rewritten after every contender. Besides rows, skips
    and failures it keeps "discarded" entries: rows found invalid after the run (the reason says why), until
    their contender is measured again."""

    def __init__(self, directory: Path, fresh: bool, gpu: str, meta: dict):
        self.directory = directory
        self.stem = f"benchmark-{slug(gpu)}"
        self.json_path = self.directory / f"{self.stem}.json"
        self.data = {**meta, **earlier_entries(self.json_path, fresh, gpu, KINDS, PROG)}

    @staticmethod
    def _key(entry: dict) -> tuple:
        return entry["label"], entry["workload"]

    def record(self, kind: str, entry: dict) -> None:
        """Put a row (or a skip or failure) in, replacing what an earlier run left for its contender and workload."""
        for other in KINDS:
            self.data[other] = [e for e in self.data[other] if self._key(e) != self._key(entry)]
        self.data[kind].append(entry)
        self.write()

    def write(self) -> None:
        from bench.tables import benchmark_table

        data = dict(self.data)
        if not data["rows"]:
            del data["rows"]  # report-gpus takes a file without rows for no report and skips it
        atomic_write_bytes(self.json_path, (json.dumps(data, indent=1) + "\n").encode())
        atomic_write_bytes(self.directory / f"{self.stem}.md", benchmark_table(self.data).encode())
        if self.data["rows"]:
            atomic_write_bytes(self.directory / f"{self.stem}.png", self.chart())

    def chart(self) -> bytes:
        """report-gpus' stacked chart of the rows as it reads them from the JSON."""
        return gpu_chart(merge(read_report(self.json_path, self.json_path.name), with_published=False))


def write_defaults(path: Path, results: dict, workload_name: str, gpu: str, key: str, json_path: Path) -> None:
    """Record the fastest torch-backend combination measured at `workload_name` as the torch defaults under `key`
    (plugins.tuned.entry_key: this compute capability, SDXL's apart) in the tuned-defaults file `path`."""
    rows = [r for r in results["rows"] if r["workload"] == workload_name and r["backend"] == TORCH
            and r.get("cache_interval", 1) == 1  # a cache is a choice per run, not a default
            and r.get("precision") != FP8]  # and so is FP8 (the defaults are settings, not a precision)
    if not rows:
        say(f"no torch-backend row at {workload_name}: the torch defaults are left as they are")
        return
    best = min(rows, key=lambda r: r["latency_ms"]["pipeline"])
    write_entry(TORCH_DEFAULTS, key, {
        **best["settings"], "gpu": gpu, "date": datetime.date.today().isoformat(), "label": best["label"],
        "workload": workload_name, "pipeline_ms": round(best["latency_ms"]["pipeline"], 2),
        "source": f"sd-benchmark, {json_path.parent.name}/{json_path.name}"}, path)
    say(f"torch defaults for {key}: {best['label']} "
        f"({best['latency_ms']['pipeline']:.2f} ms) written to {path}")


def measure(setup: Setup, results: Results, contender, workload: Workload, first: Workload, images_dir: Path) -> None:
    """One contender at one workload, recorded as a row, a skip or a failure."""
    from bench.runner import compare_images, free_memory, load_image, run_contender, save_image, why_skip
    from demo.runtime.report import precision_name
    source, request = setup.source, setup.request
    name = setup.title(workload)
    entry = {"label": contender.label, "workload": name, "what": contender.what}
    reason = why_skip(setup, contender, workload, first)
    if reason:
        say(f"{contender.label} ({name}): skipped: {reason}")
        results.record("skipped", {**entry, "reason": reason})
        return
    say(f"{contender.label} ({name}): {contender.what}")
    row = None
    try:
        row, image = run_contender(setup, contender, workload, first)
    except Exception as exc:  # e.g. a compile error or out of memory: reported, and the others go on
        if setup.verbose:
            traceback.print_exc()
        say(f"{contender.label} ({name}): failed: {one_line(exc)}")
        results.record("failed", {**entry, "reason": one_line(exc)})
    free_memory(setup.device)  # here, where nothing of the contender is referenced any more
    if row is None:
        return
    image_path = images_dir / f"{contender.label}.png"
    save_image(image_path, image)
    psnr, difference = compare_images(load_image(image_path), load_image(images_dir / f"{EAGER}.png"))
    row = {"device": results.data["gpu"], "label": contender.label, "model": source.name, "height": workload.height,
           "width": workload.width, "batch_size": workload.batch, "steps": request.denoising_steps,
           "scheduler": request.scheduler, "seed": request.seed,
           "precision": contender.precision or precision_name(setup.dtype), **entry, **row,
           "backend": contender.backend, "settings": contender.settings_dict(),
           "psnr_vs_eager_db": psnr, "max_pixel_diff_vs_eager": difference, "image": str(image_path),
           "measured": datetime.datetime.now().isoformat(timespec="seconds")}
    if setup.spec.controlnets:
        row["controlnets"] = [{"name": name, "scale": scale} for name, scale in setup.spec.controlnets]
    cache = replace(setup.spec, **contender.spec_fields())
    row.update(cache_interval=cache.cache_interval, cache_threshold=cache.cache_threshold,
               cache_branch=cache.cached_branch)
    uncached = images_dir / f"{contender.uncached_label}.png"
    if contender.own_cache and uncached.is_file():  # what the cache changes in the picture
        against, largest = compare_images(load_image(image_path), load_image(uncached))
        row.update(psnr_vs_uncached_db=against, max_pixel_diff_vs_uncached=largest)
    if contender.reference:  # e.g. INT8 engines against the fp16 ones: the image too
        against, largest = compare_images(load_image(image_path), load_image(images_dir / f"{contender.reference}.png"))
        row.update(reference=contender.reference, psnr_vs_reference_db=against, max_pixel_diff_vs_reference=largest)
    results.record("rows", row)
    say(f"{contender.label} ({name}): pipeline {row['latency_ms']['pipeline']:.2f} ms, UNet "
        f"{row['unet_ms_per_call']:.2f} ms/step, PSNR vs eager {psnr if psnr is not None else '—'}")


def benchmark(flags, chosen: list[Contender]) -> int:
    # The measuring loads torch (seconds): --help and the usage errors (run) answer without it.
    from bench.runner import Setup
    from bench.tables import benchmark_table
    from demo.backends.registry import backend_named
    from demo.runtime.loader import plan_pipeline, quiet
    from demo.runtime.report import device_name, library_versions
    from demo.runtime.spec import reference_spec

    bench, output, engine = flags[BenchmarkFlags], flags[ResultsFlags], flags[EngineFlags]
    # The contenders' shared request, resolved and checked against the model on the reference backend.
    reference = plan_pipeline(reference_spec(spec_from_flags(flags, modes=(TEXT_TO_IMAGE,))),
                              request=request_from_flags(flags), log=quiet)
    source, request, device, dtype = reference.source, reference.request, reference.device, reference.dtype
    for note in request.unused():
        say(f"note: {render_fields(note, flag_name)}")
    workloads = workloads_of(request, bench.extra_shapes, source)
    gpu = device_name(device)
    capability = compute_capability(device)
    engines = backend_named("tensorrt")
    tensorrt = None if engines.why_cannot_build() else f"TensorRT {engines.version()}"
    meta = {"gpu": gpu, "compute_capability": capability, "versions": library_versions(), "tensorrt": tensorrt,
            "model": source.name, "prompt": request.prompt, "negative_prompt": request.negative_prompt,
            "seed": request.seed, "scheduler": request.scheduler, "guidance_scale": request.guidance_scale,
            "runs": bench.runs, "warmup_runs": bench.warmup_runs,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    setup = Setup(spec_from_flags(flags), source, device, dtype, request, engine, bench.runs, bench.warmup_runs,
                  bench.engines_from_ablation, flags[ModelFlags].verbose, say)
    chosen = [resolve_here(c, device, source.family.tuned_key) for c in chosen]
    results = Results(Path(output.results_dir), bench.fresh, gpu, meta)
    say(f"{len(chosen)} contender(s) x {len(workloads)} workload(s) on {gpu}: {', '.join(c.label for c in chosen)}; "
        f"{request.scheduler}, seed {request.seed}")
    for workload in workloads:
        images_dir = setup.images_dir(Path(bench.work_dir), gpu, workload)
        for contender in chosen:
            measure(setup, results, contender, workload, workloads[0], images_dir)
    if output.update_defaults:
        if capability is None:
            say("no GPU here: the torch defaults are left as they are")
        elif source.name == "tiny":
            say("the built-in tiny model does not set the torch defaults: they are left as they are")
        elif setup.spec.controlnets:
            say("a run with ControlNets does not set the torch defaults: they are left as they are")
        else:
            write_defaults(output.defaults_path, results.data, setup.title(workloads[0]),
                           gpu, entry_key(capability, source.family.tuned_key), results.json_path)
    print(benchmark_table(results.data), end="")
    say(f"wrote {results.json_path} and its .md and .png")
    return 0
