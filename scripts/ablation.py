"""Plugin ablation on one GPU in one run: engines with none of our plugins, then adding them one family at a
time, then each family alone; CLIP, UNet x N, VAE and pipeline latency per configuration.

    python scripts/ablation.py --model sd1.5-arch --disable-tactic-sources CUDNN

Every engine is built once, by scripts/build_engines.py in a folder of its own under --work-dir, several at
a time (--parallel-builds): each stage gets only the plugin families the passes find in it, so the text
encoder and the VAE engines are shared by the configurations that differ elsewhere. Then each
configuration runs the same request (same seed, scheduler and prompt) --runs times after warm-up; the
medians are reported. For every engine the plugin layers TensorRT's engine inspector lists are counted
against what the ONNX passes reported replacing, and every image is compared with the no-plugin one.
Writes JSON, a markdown table and a PNG chart into --results-dir, and records which plugins measured
faster than none on this GPU's compute capability in results/plugins_auto.json (what --plugins auto uses).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.errors import UsageError  # noqa: E402

PROG = "ablation"
ROOT = Path(__file__).resolve().parent.parent
ATTENTION = ("fMHA", "fMHCA")
ALL = ATTENTION + ("LayerNorm", "GroupNorm", "SplitGeLU", "Seq2Spatial")
OURS, TENSORRT = "sdplugins", "tensorrt"
# (label, plugins, convention): demoDiffusion 8.5's order, each family alone, then the peer: TensorRT
# 8.6's own Stable Diffusion plugins (libnvinfer_plugin) emitted by the same passes.
CONFIGS = (
    ("none", (), OURS),
    ("+fMHA/fMHCA", ATTENTION, OURS),
    ("+LayerNorm", ATTENTION + ("LayerNorm",), OURS),
    ("+GroupNorm", ATTENTION + ("LayerNorm", "GroupNorm"), OURS),
    ("+SplitGeLU", ATTENTION + ("LayerNorm", "GroupNorm", "SplitGeLU"), OURS),
    ("+Seq2Spatial", ALL, OURS),
    ("LayerNorm alone", ("LayerNorm",), OURS),
    ("GroupNorm alone", ("GroupNorm",), OURS),
    ("SplitGeLU alone", ("SplitGeLU",), OURS),
    ("Seq2Spatial alone", ("Seq2Spatial",), OURS),
    ("TensorRT's fMHA_V2/fMHCA", ATTENTION, TENSORRT),
    ("TensorRT's plugins (all six)", ALL, TENSORRT),
    # TensorRT 8.6's fMHA_V2 has no Hopper kernels: there the peer is the other four, against ours.
    ("ours without attention", ALL[2:], OURS),
    ("TensorRT's without attention", ALL[2:], TENSORRT),
)
# Our configuration and its TensorRT-plugin peer: the same families, in the same passes, in either convention.
PEERS = (("+fMHA/fMHCA", "TensorRT's fMHA_V2/fMHCA"), ("+Seq2Spatial", "TensorRT's plugins (all six)"),
         ("ours without attention", "TensorRT's without attention"))
PROFILED_UNET_CALLS = 20  # UNet calls under TensorRT's per-layer profiler, per configuration
# What each configuration shows alone (for --plugins auto): the attention pair is measured as a pair.
ALONE = {"+fMHA/fMHCA": ATTENTION, "LayerNorm alone": ("LayerNorm",), "GroupNorm alone": ("GroupNorm",),
         "SplitGeLU alone": ("SplitGeLU",), "Seq2Spatial alone": ("Seq2Spatial",)}
# NVIDIA demoDiffusion 8.5 (TensorRT 8.5.2, A100, SD 1.5 UNet x 50, 512x512), ms, for the cumulative rows.
PUBLISHED_A100_UNET = {"none": 1282.32, "+fMHA/fMHCA": 1047.26, "+LayerNorm": 979.72, "+GroupNorm": 874.51,
                       "+SplitGeLU": 856.47, "+Seq2Spatial": 805.97}
STAGES = ("clip", "unet", "vae", "pipeline")
BUILT_STAGES = ("unet", "clip", "vae")


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-").lower() or "none"


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import Parser, add_engine_arguments, add_model_arguments, run_command

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--denoising-steps", type=int, default=50)
    p.add_argument("--scheduler", default="DDIM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="a photo of an astronaut riding a horse on mars")
    p.add_argument("--runs", type=int, default=5, help="timed runs per configuration; medians reported (default: 5)")
    p.add_argument("--configs", help="comma list of configuration labels, in the order to build them (runs and the "
                                     f"table keep this order: {', '.join(c[0] for c in CONFIGS)}; default: all)")
    p.add_argument("--work-dir", default="ablation", help="per-configuration ONNX and engines (default: ablation)")
    p.add_argument("--results-dir", default=str(ROOT / "results"), help="where JSON, markdown and PNG go")
    p.add_argument("--parallel-builds", type=int, default=4, help="engine builds at a time (default: 4)")
    p.add_argument("--build-gpus", type=int, default=1,
                   help="spread the builds over this many GPUs (CUDA_VISIBLE_DEVICES, in turn), so that their "
                        "tactic timing does not share one; the runs use the first (default: 1)")
    p.add_argument("--build-only", action="store_true", help="build every configuration's engines, run none")
    p.add_argument("--build-budget-s", type=float,
                   help="stop building after this many seconds: builds still running are stopped, and their "
                        "configurations reported as not built (default: no limit). --configs gives the order")
    add_engine_arguments(p)
    return run_command(PROG, lambda: ablate(p.parse_args(argv)))


def select_configs(text: str | None) -> list[tuple[str, tuple[str, ...], str]]:
    if not text:
        return list(CONFIGS)
    known = {config[0]: config for config in CONFIGS}
    labels = [label.strip() for label in text.split(",") if label.strip()]
    unknown = [label for label in labels if label not in known]
    if unknown or not labels:
        raise UsageError(f"unknown configuration(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}")
    return [known[label] for label in labels]


@dataclass(frozen=True)
class Job:
    """One engine to build: a stage with the plugins it gets. A stage gets only the families the passes
    find in it, so configurations that differ elsewhere share its engine (the text encoder has no
    GroupNorm; the VAE no LayerNorm, and its attention is too wide for the kernels)."""
    stage: str
    plugins: tuple[str, ...]
    convention: str

    @property
    def folder(self) -> str:
        return slug(f"{self.stage} {' '.join(self.plugins) or 'none'} {self.convention if self.plugins else ''}")


def job_for(stage: str, plugins: tuple[str, ...], convention: str, families: dict) -> Job:
    kept = tuple(p for p in ALL if p in plugins and p in families.get((stage, convention), ALL))  # in one order
    return Job(stage, kept, convention if kept else OURS)


def job_argv(args, job: Job, work: Path) -> list[str]:
    """scripts/build_engines.py's arguments for a job; the run parses the same ones, so it finds exactly
    the engines the build made."""
    folder = work / job.folder
    argv = ["--model", args.model, "--backend", "tensorrt", "--stages", job.stage, "--height", str(args.height),
            "--width", str(args.width), "--build-static-batch", "--plugins", ",".join(job.plugins) or "none",
            "--plugin-convention", job.convention, "--onnx-dir", str(folder / "onnx"),
            "--engine-dir", str(folder / "engine"), "--optimization-level", str(args.optimization_level)]
    if args.disable_tactic_sources:
        argv += ["--disable-tactic-sources", args.disable_tactic_sources]
    return argv


def job_settings(args, source, job: Job, work: Path):
    from demo.arguments import engine_settings
    from scripts.build_engines import make_parser

    built = make_parser().parse_args(job_argv(args, job, work))
    return engine_settings(built, source, "tensorrt", 1, args.height, args.width, guided=True)


def share_raw_export(source_dir: Path, target_dir: Path, stage: str) -> None:
    """Hard-link a plugin-free export (and its manifest) into another job's folder: the raw export does
    not depend on the plugin set, only the optimized ONNX does."""
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in (f"{stage}.onnx", f"{stage}.onnx.json", f"{stage}.onnx.data"):
        if (source_dir / name).exists() and not (target_dir / name).exists():
            os.link(source_dir / name, target_dir / name)


def probe_dir(work: Path, stage: str, convention: str) -> Path:
    return work / f"probe-{stage}-{convention}" / "onnx"


def export_and_probe(args, source, configs, work: Path) -> dict:
    """Export each stage's raw ONNX once, and run every pass on the text encoder and the VAE to learn
    which families they contain (per convention). Returns {(stage, convention): families}; the UNet is
    taken to contain all of them (its pass report is checked against the engine anyway)."""
    from demo.backends import device_and_dtype
    from models import STAGE_MODELS

    device, dtype = device_and_dtype("tensorrt")
    conventions = sorted({c for _, plugins, c in configs if plugins})
    for stage in BUILT_STAGES:
        print(f"[ablation] exporting {stage} ONNX ...", flush=True)
        model = STAGE_MODELS[stage](source)
        raw = work / Job(stage, (), OURS).folder / "onnx"
        model.prepare_onnx(raw, device, dtype, log=lambda *_: None)
        for convention in conventions if stage != "unet" else ():
            probe = probe_dir(work, stage, convention)
            share_raw_export(raw, probe, stage)
            model.prepare_onnx(probe, device, dtype, log=lambda *_: None, plugins=ALL, plugin_convention=convention)
    families = {}
    for convention in conventions:
        families.update(probed_families(source, work, convention))
        for stage in ("clip", "vae"):
            print(f"[ablation] {stage} ({convention}) has: {', '.join(sorted(families[(stage, convention)])) or 'none'}",
                  flush=True)
    return families


def config_jobs(configs, families) -> dict[str, dict[str, Job]]:
    return {label: {stage: job_for(stage, plugins, convention, families) for stage in BUILT_STAGES}
            for label, plugins, convention in configs}


def build_all(args, jobs: list[Job], work: Path) -> tuple[dict[Job, float], dict[Job, str]]:
    """Build the jobs, --parallel-builds at a time, in the order given. Returns wall seconds per job, and
    for those that failed to build (e.g. TensorRT's own plugins where they have no kernels for this GPU)
    or were stopped by --build-budget-s the reason: their configurations are reported, not run."""
    raw = {stage: work / Job(stage, (), OURS).folder / "onnx" for stage in BUILT_STAGES}
    for job in jobs:
        share_raw_export(raw[job.stage], work / job.folder / "onnx", job.stage)
    pending = list(jobs)
    running: dict[Job, tuple[subprocess.Popen, float, int]] = {}
    times: dict[Job, float] = {}
    failed: dict[Job, str] = {}
    deadline = time.perf_counter() + args.build_budget_s if args.build_budget_s else float("inf")
    while pending or running:
        if time.perf_counter() > deadline:
            for process, _, _ in running.values():
                process.kill()
                process.wait()
            for job in [*running, *pending]:
                failed[job] = f"{job.folder} not built within --build-budget-s {args.build_budget_s:.0f}"
                print(f"[ablation] {failed[job]}", flush=True)
            break
        if pending and len(running) < args.parallel_builds:
            job = pending.pop(0)
            busy = [gpu for _, _, gpu in running.values()]
            gpu = min(range(args.build_gpus), key=busy.count)  # the GPU with the fewest builds
            print(f"[ablation] building {job.folder} on GPU {gpu} ...", flush=True)
            command = [sys.executable, str(ROOT / "scripts" / "build_engines.py"), *job_argv(args, job, work)]
            environment = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)} if args.build_gpus > 1 else None
            with open(work / job.folder / "build.log", "w") as log:  # the build writes through its own copy
                running[job] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment),
                                time.perf_counter(), gpu)
            continue
        time.sleep(2)
        for job, (process, started, _) in list(running.items()):
            if process.poll() is None:
                continue
            del running[job]
            times[job] = time.perf_counter() - started
            if process.returncode != 0:
                tail = (work / job.folder / "build.log").read_text().strip().splitlines()[-3:]
                failed[job] = f"{job.folder} failed to build (exit {process.returncode}): {' | '.join(tail)}"
                print(f"[ablation] {failed[job]}", flush=True)
                continue
            print(f"[ablation] built {job.folder} in {times[job]:.0f} s", flush=True)
            # Running needs only the engines and the pass reports: free the disk the optimized ONNX
            # takes (1.7 GB for an SD 1.5 UNet, times a dozen configurations).
            for optimized in (work / job.folder / "onnx").glob("*.opt.onnx"):
                optimized.unlink()
    return times, failed


def create_config_stages(args, source, jobs: dict[str, Job], work: Path, log=lambda *_: None,
                         use_cuda_graph: bool = False):
    """A configuration's stages from its jobs' engines, through the same settings the builds used; an
    engine that is not there (or not for those settings) is an error, never a build on the GPU being timed."""
    from dataclasses import replace

    from demo.backends import create_stages, device_and_dtype
    from models import STAGE_MODELS

    device, dtype = device_and_dtype("tensorrt")
    stages = {}
    for stage, job in jobs.items():
        settings = replace(job_settings(args, source, job, work), build_missing=False, use_cuda_graph=use_cuda_graph)
        stages.update(create_stages("tensorrt", [STAGE_MODELS[stage](source)], device, dtype, settings, log=log))
    return stages


def probed_families(source, work: Path, convention: str) -> dict:
    """{(stage, convention): families} from the probes export_and_probe left in `work`: the families the
    text encoder's and the VAE's passes replaced; the UNet is taken to have all of them."""
    from models import STAGE_MODELS
    from models.plugin_passes import read_pass_report

    families = {("unet", convention): set(ALL)}
    for stage in ("clip", "vae"):
        path = STAGE_MODELS[stage](source).optimized_onnx_path(probe_dir(work, stage, convention))
        try:
            report = read_pass_report(path)
        except (OSError, ValueError) as exc:
            raise UsageError(f"no ablation probe of {stage} ({convention}) in {work}: {exc}") from None
        families[(stage, convention)] = {key for key, counts in report.items() if counts["replaced"]}
    return families


def ablation_engine_stages(args, source, plugins: tuple[str, ...], convention: str, work: Path,
                           use_cuda_graph: bool = False) -> dict:
    """The stages of the configuration with `plugins` (in `convention`) from the engines an ablation built in
    `work` (args as the ablation's: model, height, width, optimization_level, disable_tactic_sources)."""
    families = probed_families(source, work, convention) if plugins else {}
    jobs = {stage: job_for(stage, plugins, convention, families) for stage in BUILT_STAGES}
    return create_config_stages(args, source, jobs, work, use_cuda_graph=use_cuda_graph)


def run_config(args, source, label, plugins, convention, jobs: dict[str, Job], work: Path) -> dict:
    import torch

    from demo.backends import device_and_dtype
    from demo.engine_runtime import plugin_counts, time_by_kind
    from demo.pipeline import GenerationRequest, Text2ImagePipeline, to_uint8
    from models.plugin_passes import read_pass_report

    device, dtype = device_and_dtype("tensorrt")
    stages = create_config_stages(args, source, jobs, work)
    pipeline = Text2ImagePipeline(source, stages, args.scheduler, device, dtype)
    request = GenerationRequest([args.prompt], [""], args.height, args.width, args.denoising_steps, 7.5, args.seed)
    images, timings = pipeline.timed_runs(request, warmup_runs=2, runs=args.runs)
    unet_calls = pipeline.unet_calls(args.denoising_steps)
    kinds = {stage: stages[stage].engine.layer_kinds() for stage in jobs}
    # Kernel for kernel: the UNet's layers timed one by one on the last step's inputs, summed per kind
    unet_ms_by_kind = time_by_kind(stages["unet"].engine.layer_times(PROFILED_UNET_CALLS), kinds["unet"])
    layers = {}
    for stage, job in jobs.items():
        found = plugin_counts(kinds[stage])
        report = read_pass_report(stages[stage].model.optimized_onnx_path(work / job.folder / "onnx"))
        reported = {k: v["replaced"] for k, v in report.items() if v["replaced"]}
        layers[stage] = {"engine": dict(found), "passes": reported, "match": dict(found) == reported}
    for stage in stages.values():
        stage.close()
    del stages, pipeline
    torch.cuda.empty_cache()
    return {
        "label": label, "plugins": list(plugins), "convention": convention,
        "engines": {stage: job.folder for stage, job in jobs.items()},
        "latency_ms": {s: statistics.median(t[s] for t in timings) for s in STAGES},
        "latency_ms_runs": timings, "unet_calls": unet_calls,
        "plugin_layers": layers, "unet_ms_by_kind": unet_ms_by_kind, "image": to_uint8(images)[0],
    }


def faster_than_none(rows: list[dict]) -> list[str]:
    """Plugins whose configuration alone ran the pipeline faster than no plugins (median against median)."""
    by_label = {row["label"]: row for row in rows}
    if "none" not in by_label:
        return []
    baseline = by_label["none"]["latency_ms"]["pipeline"]
    chosen = []
    for label, plugins in ALONE.items():
        if label in by_label and by_label[label]["latency_ms"]["pipeline"] < baseline:
            chosen += plugins
    return sorted(chosen)


def markdown_table(rows: list[dict], gpu: str, trt_version: str) -> str:
    lines = [f"Plugin ablation on {gpu}, TensorRT {trt_version}: sd1.5-arch engines, medians (ms); "
             "A100 column: NVIDIA's published demoDiffusion 8.5 UNet x 50 (TensorRT 8.5.2).", "",
             "| configuration | CLIP | UNet x N | VAE | pipeline | vs none | plugin layers (engine = passes) | PSNR vs none | A100 UNet x 50 (published) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    base = rows[0]["latency_ms"]["pipeline"] if rows and rows[0]["label"] == "none" else None
    for row in rows:
        ms = row["latency_ms"]
        counts = sum(sum(stage["engine"].values()) for stage in row["plugin_layers"].values())
        match = all(stage["match"] for stage in row["plugin_layers"].values())
        ratio = f"{base / ms['pipeline']:.3f}x" if base else "—"
        psnr_text = "—" if row["label"] == "none" or row["psnr_vs_none"] is None else f"{row['psnr_vs_none']:.1f} dB"
        published = PUBLISHED_A100_UNET.get(row["label"])
        lines.append(f"| {row['label']} | {ms['clip']:.2f} | {ms['unet']:.2f} | {ms['vae']:.2f} | {ms['pipeline']:.2f} | "
                     f"{ratio} | {counts} ({'yes' if match else 'NO'}) | {psnr_text} | "
                     f"{published if published else '—'} |")
    return "\n".join(lines) + "\n"


def kernel_table(rows: list[dict], comparisons: list[dict]) -> str:
    """The UNet's time per call by layer kind in every configuration, then each plugin family of ours
    against TensorRT's own in the peer configurations (kernel_comparisons), family by family."""
    from demo.engine_runtime import GENERATED, REFORMAT

    kinds = [*ALL, REFORMAT, GENERATED]
    lines = [f"UNet time per call by layer kind (ms; TensorRT's per-layer profiler, mean of {PROFILED_UNET_CALLS} "
             "calls on the last step's inputs; the profiler's events between layers add to the total):", "",
             f"| configuration | {' | '.join(kinds)} | total |", f"| --- |{' ---: |' * (len(kinds) + 1)}"]
    for row in rows:
        ms = row["unet_ms_by_kind"]
        cells = [f"{ms[kind]:.3f}" if kind in ms else "—" for kind in kinds]
        lines.append(f"| {row['label']} | {' | '.join(cells)} | {sum(ms.values()):.3f} |")
    if comparisons:
        lines += ["", "Ours against TensorRT 8.6's own plugins, family by family (ms per UNet call):", "",
                  "| family | ours | TensorRT's | TensorRT's / ours | configurations |", "| --- | ---: | ---: | ---: | --- |"]
        lines += [f"| {c['family']} | {c['ours_ms']:.3f} | {c['tensorrt_ms']:.3f} | {c['tensorrt_ms'] / c['ours_ms']:.2f}x | "
                  f"{c['ours']} / {c['tensorrt']} |" for c in comparisons]
    return "\n".join(lines) + "\n"


def kernel_comparisons(rows: list[dict]) -> list[dict]:
    """Per plugin family, our layers' time against TensorRT's in each peer pair that ran (families both
    engines have)."""
    by_label = {row["label"]: row for row in rows}
    found = []
    for ours, theirs in PEERS:
        if ours in by_label and theirs in by_label:
            mine, other = by_label[ours]["unet_ms_by_kind"], by_label[theirs]["unet_ms_by_kind"]
            found += [{"family": family, "ours": ours, "tensorrt": theirs, "ours_ms": mine[family],
                       "tensorrt_ms": other[family]} for family in ALL if mine.get(family) and other.get(family)]
    return found


def kernel_chart(comparisons: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['family']}\n({c['ours']})" for c in comparisons]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(comparisons)), 4))
    places = range(len(comparisons))
    ax.bar([x - 0.2 for x in places], [c["ours_ms"] for c in comparisons], 0.4, label="ours", color="#4c72b0")
    ax.bar([x + 0.2 for x in places], [c["tensorrt_ms"] for c in comparisons], 0.4, label="TensorRT's", color="#999999")
    ax.set_xticks(list(places), labels, fontsize=8)
    ax.set_ylabel("ms per UNet call (all layers of the family)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["label"] for row in rows][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    for stage, color in (("clip", "#8c9fca"), ("unet", "#4c72b0"), ("vae", "#dd8452")):
        values = [row["latency_ms"][stage] for row in rows][::-1]
        ax.barh(labels, values, left=left, color=color, label=stage.upper() if stage != "unet" else "UNet x N")
        left = [a + b for a, b in zip(left, values)]
    for y, row in enumerate(rows[::-1]):
        ax.text(row["latency_ms"]["pipeline"], y, f" {row['latency_ms']['pipeline']:.1f} ms", va="center", fontsize=8)
    ax.set_xlabel("ms per 512x512 image (median)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8)  # clear of the bars' labels
    ax.set_xlim(0, max(row["latency_ms"]["pipeline"] for row in rows) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ablate(args) -> int:
    import torch
    from PIL import Image

    from core.atomic import atomic_write_bytes
    from demo.logs import configure_library_logging
    from demo.pipeline import image_psnr
    from demo.trt_flavour import version
    from models.plugin_set import AUTO_TABLE, local_compute_capability
    from models.source import resolve_model

    configs = select_configs(args.configs)
    if args.runs < 1:
        raise UsageError(f"--runs must be at least 1, got {args.runs}")
    if args.parallel_builds < 1:
        raise UsageError(f"--parallel-builds must be at least 1, got {args.parallel_builds}")
    if not 1 <= args.build_gpus <= max(torch.cuda.device_count(), 1):
        raise UsageError(f"--build-gpus must be 1 to the {torch.cuda.device_count()} GPUs here, got {args.build_gpus}")
    if args.build_budget_s is not None and args.build_budget_s <= 0:
        raise UsageError(f"--build-budget-s must be positive, got {args.build_budget_s}")
    if args.timing_cache:
        raise UsageError("--timing-cache is not used by the ablation: builds run side by side and each would "
                         "rewrite the file, and TensorRT 8.6.0 refuses caches with Myelin entries")
    configure_library_logging(args.verbose)
    source = resolve_model(args.model)
    work = Path(args.work_dir)
    start = time.perf_counter()
    families = export_and_probe(args, source, configs, work)
    jobs = config_jobs(configs, families)
    # In --configs order, so that a --build-budget-s stops the last configurations, not parts of all of them
    order = list(dict.fromkeys(jobs[label][stage] for label, _, _ in configs for stage in BUILT_STAGES))
    build_s, failed_jobs = build_all(args, order, work)
    failed = {label: "; ".join(failed_jobs[job] for job in jobs[label].values() if job in failed_jobs)
              for label, _, _ in configs if any(job in failed_jobs for job in jobs[label].values())}
    print(f"[ablation] {len(order)} engines of {len(configs)} configurations ready in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    if args.build_only:
        return 0
    gpu = torch.cuda.get_device_name()
    trt_version = version("tensorrt")
    rows, images = [], {}
    for label, plugins, convention in sorted(configs, key=CONFIGS.index):
        if label in failed:
            continue
        print(f"[ablation] running '{label}' ...", flush=True)
        row = run_config(args, source, label, plugins, convention, jobs[label], work)
        row["build_s"] = {stage: build_s.get(job) for stage, job in jobs[label].items()}
        images[label] = row.pop("image")
        Image.fromarray(images[label]).save(work / f"{slug(label)}.png")
        rows.append(row)
        (work / "rows.json").write_text(json.dumps(rows, indent=1))  # what is done so far, for long runs
        print(f"[ablation] '{label}': pipeline {row['latency_ms']['pipeline']:.2f} ms, UNet {row['latency_ms']['unet']:.2f} ms",
              flush=True)
    reference = images.get("none")
    for row in rows:
        image = images[row["label"]]
        row["psnr_vs_none"] = image_psnr(image, reference) if reference is not None else None
        row["max_pixel_diff_vs_none"] = (int(abs(image.astype(int) - reference.astype(int)).max())
                                         if reference is not None else None)

    if not rows:
        print(f"{PROG}: error: no configuration was built, so none ran", file=sys.stderr)
        return 1
    name = f"ablation-{slug(gpu)}"
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": gpu, "compute_capability": local_compute_capability(), "tensorrt": trt_version, "model": source.name,
            "height": args.height, "width": args.width, "steps": args.denoising_steps, "scheduler": args.scheduler,
            "seed": args.seed, "runs": args.runs, "optimization_level": args.optimization_level,
            "date": datetime.date.today().isoformat(), "parallel_builds": args.parallel_builds,
            "build_budget_s": args.build_budget_s, "build_gpus": args.build_gpus}
    comparisons = kernel_comparisons(rows)
    table = (markdown_table(rows, gpu, trt_version) + "".join(f"\n'{label}' not run: {why}\n" for label, why in failed.items())
             + "\n" + kernel_table(rows, comparisons))
    atomic_write_bytes(results / f"{name}.json", json.dumps({**meta, "rows": rows, "failed": failed,
                                                             "kernel_comparisons": comparisons}, indent=1).encode())
    atomic_write_bytes(results / f"{name}.md", table.encode())
    chart(rows, f"Plugin ablation, {source.name} {args.height}x{args.width}, {args.denoising_steps} steps — {gpu}, "
                f"TensorRT {trt_version}", results / f"{name}.png")
    if comparisons:
        kernel_chart(comparisons, f"Our plugins against TensorRT's, kernel for kernel, in the UNet\n{gpu}, "
                                  f"TensorRT {trt_version}", results / f"{name}-kernels.png")
    if any(row["label"] == "none" for row in rows):
        entries = json.loads(AUTO_TABLE.read_text()) if AUTO_TABLE.is_file() else {}
        entries[meta["compute_capability"]] = {
            "plugins": faster_than_none(rows), "gpu": gpu, "date": meta["date"], "tensorrt": trt_version,
            "source": f"scripts/ablation.py, {results.name}/{name}.json"}
        atomic_write_bytes(AUTO_TABLE, (json.dumps(entries, indent=1) + "\n").encode())
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
