"""Benchmark every contender on one GPU, in one process, on the same request.

Contenders: diffusers' own modules, the strongest PyTorch peer (channels-last + torch.compile
reduce-overhead), our torch backend at its best and with each toggle off, TensorRT with and without our plugins.

    python scripts/benchmark.py --model sd1.5-arch [--contenders LABEL,...] [--extra-shapes] [--runs 5]

Same prompt, seed, DDIM scheduler and guidance 7.5 for everyone; 512x512, batch 1, 50 steps by default
(--extra-shapes adds 1.5x the size, batch 1, and batch 4). Per contender: load, then get ready (torch.compile
compiling and CUDA-graph capture, engine builds), timed apart; --warmup-runs untimed runs; --runs timed runs,
whose CLIP, UNet, VAE and pipeline medians are reported, with the peak of torch.cuda.max_memory_allocated
(reset per contender), device memory in use, and the image's PSNR and largest pixel difference against
diffusers-eager's. A contender that cannot run here is reported as skipped, one that fails as failed, each
with its one-line reason; the others go on.

Writes, into --results-dir (file names carry a GPU slug), after every contender: benchmark-<gpu>.json (rows in
the shape scripts/report_gpus.py merges; rows already there for other contenders or workloads are kept,
--fresh drops them), benchmark-<gpu>.md and benchmark-<gpu>.png. On a GPU it then records the fastest
torch-backend combination measured at the first workload in the torch defaults table (results/torch_defaults.json),
which the torch backend's flags default to on this compute capability (--no-defaults: leave the table alone).

Engines: plugin-free engines for the first workload live in --onnx-dir / --engine-dir (so engines that
scripts/build_engines.py built with the same flags are reused); with plugins in <dir>-plugins, other
workloads in <dir>[-plugins]-<W>x<H>-b<batch>. Build them ahead with build_engines.py (--build-static-batch and
the same --disable-tactic-sources and --optimization-level) when a build would not fit a session, or run
those scripts/ablation.py built (--engines-from-ablation).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.errors import UsageError  # noqa: E402

PROG = "benchmark"
ROOT = Path(__file__).resolve().parent.parent
SCHEDULER, GUIDANCE = "DDIM", 7.5
STAGES = ("clip", "unet", "vae", "pipeline")
EAGER = "diffusers-eager"  # the reference every image is compared with
DEFAULTS = "ours-defaults"


@dataclass(frozen=True)
class Contender:
    label: str
    what: str
    backend: str = "torch"  # or "tensorrt"
    settings: object = None  # demo.torch_accel.TorchSettings, for the torch backend
    plugins: tuple[str, ...] = ()  # for engines


def contenders() -> dict[str, Contender]:
    """Every named contender. DEFAULT_CONTENDERS run unless --contenders says otherwise."""
    from demo.torch_accel import TorchSettings
    from models.plugin_set import PLUGIN_KEYS

    every = tuple(sorted(PLUGIN_KEYS))
    ours = TorchSettings(every, channels_last=True, cuda_graph=True, compile="default")
    named = [
        Contender(EAGER, "diffusers' modules as they are (our pipeline, plain torch stages)", settings=TorchSettings()),
        Contender("diffusers-channels-last", "diffusers' modules in channels-last memory",
                  settings=TorchSettings(channels_last=True)),
        Contender("diffusers-compile", "diffusers + channels-last + torch.compile(mode=\"reduce-overhead\")",
                  settings=TorchSettings(channels_last=True, compile="reduce-overhead")),
        Contender("ours", "torch backend: all plugins, channels-last, CUDA graphs, compile default", settings=ours),
        Contender("ours-no-plugins", "ours without plugins", settings=replace(ours, plugins=())),
        Contender("ours-no-channels-last", "ours without channels-last", settings=replace(ours, channels_last=False)),
        Contender("ours-no-cuda-graph", "ours without CUDA graphs", settings=replace(ours, cuda_graph=False)),
        Contender("ours-no-compile", "ours without torch.compile", settings=replace(ours, compile="none")),
        Contender("ours-max-autotune", "ours, compile max-autotune-no-cudagraphs",
                  settings=replace(ours, compile="max-autotune-no-cudagraphs")),
        # Settings resolved on the machine that runs it: what the torch backend does there by default.
        Contender(DEFAULTS, "torch backend with its defaults for this GPU (the torch defaults table)"),
    ]
    for family, keys in (("attention", ("fMHA", "fMHCA")), ("groupnorm", ("GroupNorm",)), ("layernorm", ("LayerNorm",)),
                         ("splitgelu", ("SplitGeLU",)), ("seq2spatial", ("Seq2Spatial",))):
        named.append(Contender(f"ours-no-{family}", f"ours without {'/'.join(keys)}",
                               settings=replace(ours, plugins=tuple(k for k in every if k not in keys))))
    named += [Contender("tensorrt", "TensorRT engines, CUDA graphs", "tensorrt"),
              Contender("tensorrt-plugins", "TensorRT engines with all our plugins, CUDA graphs", "tensorrt",
                        plugins=every)]
    return {c.label: c for c in named}


DEFAULT_CONTENDERS = (EAGER, "diffusers-compile", "ours", "ours-no-plugins", "ours-no-channels-last",
                      "ours-no-cuda-graph", "ours-no-compile", "tensorrt", "tensorrt-plugins")


def select_contenders(text: str | None) -> list[Contender]:
    """--contenders: a comma list of labels, `all`, or `ours+KEY+KEY` (ours with exactly those plugins;
    `ours+none` for none). diffusers-eager always runs first when chosen: every image is compared with it."""
    from models.plugin_set import parse_plugin_set

    known = contenders()
    labels = [label.strip() for label in (text or ",".join(DEFAULT_CONTENDERS)).split(",") if label.strip()]
    if labels == ["all"]:
        labels = list(known)
    chosen, unknown = [], []
    for label in labels:
        if label in known:
            chosen.append(known[label])
        elif label.startswith("ours+") and label != "ours+auto":
            try:
                plugins = parse_plugin_set(label.removeprefix("ours+").replace("+", ","))
            except UsageError:
                unknown.append(label)
                continue
            chosen.append(Contender(label, f"ours with plugins {', '.join(plugins) or 'none'}",
                                    settings=replace(known["ours"].settings, plugins=plugins)))
        else:
            unknown.append(label)
    if unknown or not chosen:
        raise UsageError(f"unknown contender(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}, "
                         "all, or ours+<plugin>+<plugin>")
    if len({c.label for c in chosen}) != len(chosen):
        raise UsageError("--contenders names a contender twice")
    return sorted(chosen, key=lambda c: c.label != EAGER)


@dataclass(frozen=True)
class Workload:
    height: int
    width: int
    batch: int

    def title(self, model: str, steps: int) -> str:
        return f"{model}, {self.width}x{self.height}, batch {self.batch}, {steps} steps"

    def slug(self) -> str:
        return f"{self.width}x{self.height}-b{self.batch}"


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def say(message: str) -> None:
    print(f"[{PROG}] {message}", flush=True)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import Parser, run_command

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sd1.5-arch", help="as demo_diffusion takes it (default: sd1.5-arch)")
    p.add_argument("--verbose", action="store_true", help="show library logs, and tracebacks of failures")
    p.add_argument("--height", type=int, default=512, help="image height (default: 512)")
    p.add_argument("--width", type=int, default=512, help="image width (default: 512)")
    p.add_argument("--batch-size", type=int, default=1, help="images per run (default: 1)")
    p.add_argument("--denoising-steps", type=int, default=50, help="DDIM steps (default: 50)")
    p.add_argument("--extra-shapes", action="store_true",
                   help="also 1.5x the height and width at batch 1, and batch 4 at the first size")
    p.add_argument("--prompt", default="a photo of an astronaut riding a horse on mars")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=5, help="timed runs per contender; medians reported (default: 5)")
    p.add_argument("--warmup-runs", type=int, default=1, help="untimed runs after getting ready (default: 1)")
    p.add_argument("--contenders", help=f"comma list (default: {','.join(DEFAULT_CONTENDERS)}); `all`; "
                                        "ours+<plugin>+... for ours with exactly those plugins")
    p.add_argument("--results-dir", default=str(ROOT / "results"), help="JSON, markdown and chart (default: results)")
    p.add_argument("--work-dir", default="output/benchmark", help="images per contender (default: output/benchmark)")
    p.add_argument("--fresh", action="store_true", help="drop rows an earlier run left in the results JSON")
    p.add_argument("--no-defaults", action="store_true", help="do not update the torch defaults table")
    p.add_argument("--defaults-table", help="the torch defaults table to update (default: results/torch_defaults.json)")
    g = p.add_argument_group("engines (as scripts/build_engines.py takes them)")
    g.add_argument("--onnx-dir", default="onnx", help="ONNX of the plugin-free engines (default: onnx)")
    g.add_argument("--engine-dir", default="engine", help="plugin-free engines (default: engine)")
    g.add_argument("--timing-cache", help="timing cache file, read and updated by builds")
    g.add_argument("--disable-tactic-sources", metavar="NAMES", help="e.g. CUDNN where cuDNN is missing")
    g.add_argument("--optimization-level", type=int, default=3, help="TensorRT builder level 0-5 (default: 3)")
    g.add_argument("--engines-from-ablation", metavar="DIR",
                   help="run the TensorRT contenders on the engines scripts/ablation.py built in its --work-dir DIR "
                        "(its 'none' and '+Seq2Spatial' configurations, with the same --optimization-level and "
                        "--disable-tactic-sources) instead of building; a missing engine fails the contender")
    return run_command(PROG, lambda: benchmark(p.parse_args(argv)))


def check_arguments(args) -> None:
    """What can be checked before the model is resolved (which may generate a built-in one)."""
    from demo.arguments import check_writable_directory, check_writable_file

    for flag, value, low in (("--runs", args.runs, 1), ("--warmup-runs", args.warmup_runs, 0),
                             ("--denoising-steps", args.denoising_steps, 1), ("--batch-size", args.batch_size, 1)):
        if value < low:
            raise UsageError(f"{flag} must be at least {low}, got {value}")
    if not 0 <= args.optimization_level <= 5:
        raise UsageError(f"--optimization-level must be 0..5, got {args.optimization_level}")
    check_writable_directory("results directory", Path(args.results_dir))
    check_writable_directory("work directory", Path(args.work_dir))
    if args.defaults_table:
        check_writable_file("defaults table", Path(args.defaults_table))
    if args.engines_from_ablation and not Path(args.engines_from_ablation).is_dir():
        raise UsageError(f"--engines-from-ablation: no such directory: {args.engines_from_ablation}")


def workloads_of(args, source) -> list[Workload]:
    from demo.arguments import check_image_size

    workloads = [Workload(args.height, args.width, args.batch_size)]
    if args.extra_shapes:
        workloads += [Workload(args.height * 3 // 2 // 8 * 8, args.width * 3 // 2 // 8 * 8, 1),
                      Workload(args.height, args.width, 4)]
    for workload in workloads:
        check_image_size(source, workload.height, workload.width)
    return list(dict.fromkeys(workloads))


def resolve_defaults(contender: Contender, device) -> Contender:
    """ours-defaults with the settings the torch backend takes by default here (unresolved where they cannot run)."""
    from demo.torch_accel import resolve_torch_settings

    try:
        settings, source = resolve_torch_settings(device=device)
    except UsageError as exc:
        return replace(contender, what=f"{contender.what}: {exc}")
    return replace(contender, settings=settings, what=f"torch backend defaults here: {settings.describe()} ({source})")


def why_skip(contender: Contender, device) -> str | None:
    """Why a contender cannot run here (None: it can), decided before anything is loaded."""
    from demo.torch_accel import check_torch_settings
    from demo.trt_flavour import current_cc, why_cannot_run
    from plugins import trt_plugins

    if contender.backend == "torch":
        if contender.settings is None:
            return contender.what
        try:
            check_torch_settings(contender.settings, device)
        except UsageError as exc:
            return str(exc)
        return None
    reason = why_cannot_run(contender.backend, current_cc())
    if reason is None and contender.plugins and trt_plugins.status() != "built":
        reason = trt_plugins.status()
    return reason


# ---- running one contender --------------------------------------------------------------------------------

def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device) -> None:
    import torch

    gc.collect()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # compiled code and cudagraph trees of the last contender
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def engine_dirs(args, contender: Contender, workload: Workload, first: Workload) -> tuple[Path, Path]:
    suffix = ("-plugins" if contender.plugins else "") + ("" if workload == first else f"-{workload.slug()}")
    return Path(args.onnx_dir + suffix), Path(args.engine_dir + suffix)


def load_stages(args, contender, source, workload, first, device, dtype) -> tuple[dict, dict]:
    """The contender's stages, and what getting them took: load (and engine build) seconds."""
    from demo.backends import create_stages
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES

    models = [STAGE_MODELS[name](source) for name in TEXT_TO_IMAGE_STAGES]
    quiet = (lambda *_: None) if not args.verbose else print
    start = time.perf_counter()
    if contender.backend == "torch":
        stages = create_stages("torch", models, device, dtype, log=quiet, progress=say,
                               torch_settings=contender.settings)
        return stages, {"load_s": time.perf_counter() - start,
                        "substitution": {name: s.substitution.as_dict() for name, s in stages.items()
                                         if s.substitution is not None}}
    if args.engines_from_ablation:
        from scripts.ablation import ablation_engine_stages

        built = argparse.Namespace(model=args.model, height=workload.height, width=workload.width,
                                   optimization_level=args.optimization_level,
                                   disable_tactic_sources=args.disable_tactic_sources)
        say(f"{contender.label}: engines from the ablation in {args.engines_from_ablation}")
        stages = ablation_engine_stages(built, source, contender.plugins, "sdplugins", Path(args.engines_from_ablation),
                                        use_cuda_graph=True)
        return stages, {"load_s": time.perf_counter() - start, "build_s": None, "engines_reused": True,
                        "engine_device_memory_bytes": max(stage.engine.device_memory_size for stage in stages.values()),
                        "engine_dir": args.engines_from_ablation}
    from demo.arguments import engine_settings

    onnx_dir, engine_dir = engine_dirs(args, contender, workload, first)
    flags = argparse.Namespace(
        optimization_level=args.optimization_level, build_static_batch=True, build_dynamic_shape=False,
        use_cuda_graph=True, onnx_dir=str(onnx_dir), engine_dir=str(engine_dir), timing_cache=args.timing_cache,
        target_cc=None, disable_tactic_sources=args.disable_tactic_sources, force_onnx_export=False,
        force_onnx_optimize=False, force_engine_build=False, plugins=",".join(contender.plugins) or "none",
        plugin_convention="sdplugins")
    settings = engine_settings(flags, source, contender.backend, workload.batch, workload.height, workload.width,
                               guided=True)
    say(f"{contender.label}: engines in {engine_dir} (ONNX in {onnx_dir})")
    stages = create_stages(contender.backend, models, device, dtype, settings, log=quiet, progress=say)
    stats = settings.stats
    built = any(stat["onnx_bytes"] is not None for stat in stats.values())
    return stages, {
        "load_s": time.perf_counter() - start,
        "build_s": sum((stat["onnx_s"] or 0.0) + stat["engine_s"] for stat in stats.values()) if built else None,
        "engines_reused": not built, "engine_bytes": sum(stat["engine_bytes"] for stat in stats.values()),
        "engine_device_memory_bytes": max(stage.engine.device_memory_size for stage in stages.values()),
        "engine_dir": str(engine_dir),
    }


def run_contender(args, contender, source, workload, first, device, dtype) -> tuple[dict, "object"]:
    """One contender at one workload: (the row's measurements, the image of its last run)."""
    import torch

    from demo.pipeline import GenerationRequest, Text2ImagePipeline, to_uint8
    from models import stage_batch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        free_before = torch.cuda.mem_get_info(device)[0]
    stages, row = load_stages(args, contender, source, workload, first, device, dtype)
    try:
        pipeline = Text2ImagePipeline(source, stages, SCHEDULER, device, dtype)
        request = GenerationRequest([args.prompt] * workload.batch, [""] * workload.batch, workload.height,
                                    workload.width, args.denoising_steps, GUIDANCE, args.seed)
        say(f"{contender.label}: getting ready (compiling, capturing) ...")
        start = time.perf_counter()
        for name, stage in stages.items():
            stage.prepare(stage_batch(name, workload.batch, True), workload.height, workload.width)
        _sync(device)
        row["ready_s"] = time.perf_counter() - start
        if contender.backend == "torch":
            settings = contender.settings
            first_calls = sum(s.prepare_seconds["first_calls"] for s in stages.values())
            row["compile_s"] = first_calls if settings.compile != "none" else None
            captures = sum(s.prepare_seconds["capture"] for s in stages.values())
            row["capture_s"] = captures if settings.cuda_graph else None
        else:
            row["capture_s"] = row["ready_s"]
        images, timings = pipeline.timed_runs(request, args.warmup_runs, args.runs,
                                              say=lambda line: say(f"{contender.label}: {line}"))
        row["unet_calls"] = pipeline.unet_calls(args.denoising_steps)
        row["latency_ms"] = {stage: statistics.median(t[stage] for t in timings) for stage in STAGES}
        row["latency_ms_runs"] = timings
        row["unet_ms_per_call"] = row["latency_ms"]["unet"] / row["unet_calls"]
        if cuda:
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            row["device_used_bytes"] = free_before - torch.cuda.mem_get_info(device)[0]
        return row, to_uint8(images)
    finally:
        for stage in stages.values():
            if hasattr(stage, "close"):  # engines: contexts, graphs, streams
                stage.close()


# ---- results ------------------------------------------------------------------------------------------------

def compare_images(image, reference) -> dict:
    import numpy as np

    from demo.pipeline import image_psnr

    if reference is None:
        return {"psnr_vs_eager_db": None, "max_pixel_diff_vs_eager": None}
    difference = int(np.abs(image.astype(int) - reference.astype(int)).max())
    psnr = image_psnr(image, reference)
    return {"psnr_vs_eager_db": None if psnr == float("inf") else round(psnr, 3), "max_pixel_diff_vs_eager": difference}


def save_image(path: Path, pixels) -> None:
    from PIL import Image

    from core.atomic import atomic_write_bytes

    buffer = io.BytesIO()
    Image.fromarray(pixels.reshape(-1, *pixels.shape[2:]) if pixels.ndim == 4 else pixels).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())


def load_image(path: Path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path)) if path.is_file() else None


def _ms(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _s(value) -> str:
    return "—" if value is None else f"{value:.1f}"


def _gib(value) -> str:
    return "—" if value is None else f"{value / 2**30:.2f}"


def markdown(results: dict) -> str:
    parts = [f"Benchmark on {results['gpu']} ({results['versions'].get('torch', '?')}; "
             f"{results.get('tensorrt') or 'no TensorRT'}): {SCHEDULER}, guidance {GUIDANCE}, seed {results['seed']}, "
             f"medians of {results['runs']} runs after {results['warmup_runs']} warm-up run(s); ms. PSNR and max Δ "
             f"(0-255) against {EAGER}'s image; ready s: compiling (compile s), capturing (capture s) and engine "
             "builds (build s) before any run; peak: torch.cuda.max_memory_allocated; in use: device memory held "
             "at the end, engines' own included."]
    workloads = {}
    for row in results.get("rows", []):
        workloads.setdefault((row["model"], row["height"], row["width"], row["batch_size"], row["steps"]), []).append(row)
    for (model, height, width, batch, steps), rows in workloads.items():
        eager = next((r for r in rows if r["label"] == EAGER), None)
        lines = [f"**{model}, {width}x{height}, batch {batch}, {steps} steps**", "",
                 "| contender | CLIP | UNet / step | VAE | pipeline | vs eager | compile s | capture s | build s "
                 "| peak GiB | in use GiB | PSNR dB | max Δ |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in sorted(rows, key=lambda r: r["latency_ms"]["pipeline"]):
            ms = row["latency_ms"]
            speedup = f"{eager['latency_ms']['pipeline'] / ms['pipeline']:.2f}x" if eager else "—"
            psnr = row.get("psnr_vs_eager_db")
            psnr_text = ("identical" if row.get("max_pixel_diff_vs_eager") == 0 else
                         "—" if psnr is None else f"{psnr:.1f}")
            lines.append(f"| {row['label']} | {_ms(ms['clip'])} | {_ms(row['unet_ms_per_call'])} | {_ms(ms['vae'])} "
                         f"| {_ms(ms['pipeline'])} | {speedup} | {_s(row.get('compile_s'))} | {_s(row.get('capture_s'))} "
                         f"| {_s(row.get('build_s'))} | {_gib(row.get('peak_allocated_bytes'))} "
                         f"| {_gib(row.get('device_used_bytes'))} | {psnr_text} "
                         f"| {'—' if row.get('max_pixel_diff_vs_eager') is None else row['max_pixel_diff_vs_eager']} |")
        parts.append("\n".join(lines))
    for kind in Results.KINDS[1:]:
        for entry in results.get(kind, []):
            parts.append(f"{entry['label']} ({entry['workload']}) {kind}: {entry['reason']}")
    parts.append("Contenders: " + "; ".join(f"{row['label']}: {row['what']}" for row in
                                            {r["label"]: r for r in results.get("rows", [])}.values()))
    return "\n\n".join(parts) + "\n"


def chart(json_path: Path) -> bytes | None:
    """scripts/report_gpus.py's stacked chart of the rows as it reads them (None: no rows yet)."""
    from scripts.report_gpus import chart_png, merge, read_report

    return chart_png(merge(read_report(json_path, json_path.name), with_published=False))


class Results:
    """The results JSON, markdown and chart of one GPU, rewritten after every contender. Besides rows, skips
    and failures it keeps "discarded" entries: rows found invalid after the run (the reason says why), until
    their contender is measured again."""

    KINDS = ("rows", "skipped", "failed", "discarded")

    def __init__(self, args, gpu: str, meta: dict):
        self.directory = Path(args.results_dir)
        self.stem = f"benchmark-{gpu_slug(gpu)}"
        self.json_path = self.directory / f"{self.stem}.json"
        self.data = {**meta, **{kind: [] for kind in self.KINDS}}
        if not args.fresh and self.json_path.is_file():
            try:
                earlier = json.loads(self.json_path.read_text())
            except ValueError:
                say(f"{self.json_path} is not JSON: starting afresh")
                earlier = {}
            if earlier.get("gpu") == gpu:
                for kind in self.KINDS:
                    self.data[kind] = list(earlier.get(kind, []))

    @staticmethod
    def _key(entry: dict) -> tuple:
        return entry["label"], entry["workload"]

    def record(self, kind: str, entry: dict) -> None:
        """Put a row (or a skip or failure) in, replacing what an earlier run left for its contender and workload."""
        for other in self.KINDS:
            self.data[other] = [e for e in self.data[other] if self._key(e) != self._key(entry)]
        self.data[kind].append(entry)
        self.write()

    def write(self) -> None:
        from core.atomic import atomic_write_bytes

        data = dict(self.data)
        if not data["rows"]:
            del data["rows"]  # scripts/report_gpus.py takes a file without rows for no report and skips it
        atomic_write_bytes(self.json_path, (json.dumps(data, indent=1) + "\n").encode())
        atomic_write_bytes(self.directory / f"{self.stem}.md", markdown(self.data).encode())
        if self.data["rows"]:
            atomic_write_bytes(self.directory / f"{self.stem}.png", chart(self.json_path))


def write_defaults(table: Path, results: dict, workload_name: str, gpu: str, capability: str, json_path: Path) -> None:
    """Record the fastest torch-backend combination measured at `workload_name` for this compute capability."""
    from core.atomic import atomic_write_bytes

    rows = [r for r in results["rows"] if r["workload"] == workload_name and r["backend"] == "torch"]
    if not rows:
        say(f"no torch-backend row at {workload_name}: the defaults table is left as it is")
        return
    best = min(rows, key=lambda r: r["latency_ms"]["pipeline"])
    entries = json.loads(table.read_text()) if table.is_file() else {}
    entries[capability] = {
        **best["settings"], "gpu": gpu, "date": datetime.date.today().isoformat(), "label": best["label"],
        "workload": workload_name, "pipeline_ms": round(best["latency_ms"]["pipeline"], 2),
        "source": f"scripts/benchmark.py, {json_path.parent.name}/{json_path.name}"}
    atomic_write_bytes(table, (json.dumps(entries, indent=1) + "\n").encode())
    say(f"torch defaults for compute capability {capability}: {best['label']} "
        f"({best['latency_ms']['pipeline']:.2f} ms) written to {table}")


def benchmark(args) -> int:
    import torch

    from demo.backends import device_and_dtype
    from demo.logs import configure_library_logging
    from demo.report import device_name, library_versions
    from demo.torch_accel import TORCH_DEFAULTS_TABLE
    from models.plugin_set import local_compute_capability
    from models.source import resolve_model

    chosen = select_contenders(args.contenders)
    check_arguments(args)
    source = resolve_model(args.model)
    workloads = workloads_of(args, source)
    configure_library_logging(args.verbose)
    device, dtype = device_and_dtype("torch")
    gpu = device_name(device)
    capability = local_compute_capability() if device.type == "cuda" else None
    try:
        from demo.trt_flavour import version

        tensorrt = f"TensorRT {version('tensorrt')}"
    except UsageError:
        tensorrt = None
    meta = {"gpu": gpu, "compute_capability": capability, "versions": library_versions(), "tensorrt": tensorrt,
            "model": source.name, "prompt": args.prompt, "seed": args.seed, "scheduler": SCHEDULER,
            "guidance_scale": GUIDANCE, "runs": args.runs, "warmup_runs": args.warmup_runs,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    chosen = [resolve_defaults(c, device) if c.label == DEFAULTS else c for c in chosen]
    results = Results(args, gpu, meta)
    work = Path(args.work_dir)
    say(f"{len(chosen)} contender(s) x {len(workloads)} workload(s) on {gpu}: {', '.join(c.label for c in chosen)}")
    for workload in workloads:
        name = workload.title(source.name, args.denoising_steps)
        images_dir = work / f"{gpu_slug(gpu)}-{source.name}-{workload.slug()}-{args.denoising_steps}steps"
        reference = load_image(images_dir / f"{EAGER}.png")
        for contender in chosen:
            entry = {"label": contender.label, "workload": name, "what": contender.what}
            reason = why_skip(contender, device)
            if reason:
                say(f"{contender.label} ({name}): skipped: {reason}")
                results.record("skipped", {**entry, "reason": reason})
                continue
            say(f"{contender.label} ({name}): {contender.what}")
            row = None
            try:
                row, image = run_contender(args, contender, source, workload, workloads[0], device, dtype)
            except Exception as exc:  # e.g. a compile error or out of memory: reported, and the others go on
                if args.verbose:
                    traceback.print_exc()
                say(f"{contender.label} ({name}): failed: {one_line(exc)}")
                results.record("failed", {**entry, "reason": one_line(exc)})
            _free(device)  # here, where nothing of the contender is referenced any more
            if row is None:
                continue
            save_image(images_dir / f"{contender.label}.png", image)
            if contender.label == EAGER:
                reference = load_image(images_dir / f"{EAGER}.png")
            row = {"device": gpu, "label": contender.label, "model": source.name, "height": workload.height,
                   "width": workload.width, "batch_size": workload.batch, "steps": args.denoising_steps,
                   "precision": "fp16" if dtype == torch.float16 else "fp32", **entry, **row,
                   "backend": contender.backend,
                   "settings": (contender.settings.as_dict() if contender.settings is not None
                                else {"plugins": list(contender.plugins), "cuda_graph": True}),
                   **compare_images(load_image(images_dir / f"{contender.label}.png"), reference),
                   "image": str(images_dir / f"{contender.label}.png"),
                   "measured": datetime.datetime.now().isoformat(timespec="seconds")}
            results.record("rows", row)
            say(f"{contender.label} ({name}): pipeline {row['latency_ms']['pipeline']:.2f} ms, UNet "
                f"{row['unet_ms_per_call']:.2f} ms/step, PSNR vs eager "
                f"{row['psnr_vs_eager_db'] if row['psnr_vs_eager_db'] is not None else '—'}")
    if capability and not args.no_defaults:
        if source.name == "tiny":
            say("the built-in tiny model does not set the torch defaults: the table is left as it is")
        else:
            write_defaults(Path(args.defaults_table) if args.defaults_table else TORCH_DEFAULTS_TABLE, results.data,
                           workloads[0].title(source.name, args.denoising_steps), gpu, capability, results.json_path)
    print(markdown(results.data), end="")
    say(f"wrote {results.json_path} and its .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
