"""Plugin ablation on one GPU, in one run: engines with none of our plugins, each family added in turn, each alone.

CLIP, UNet x N, VAE and pipeline latency per configuration (CONFIGS), and TensorRT's own plugins as the peer.

    sd-ablation --disable-tactic-sources CUDNN [--configs LABEL,...] [--update-defaults]

Every engine is built once, by build-engines in a folder of its own under --work-dir, several at a time
(--parallel-builds, bench/jobs.py): each stage gets only the plugin families the passes find in it, so the
text encoder and the VAE engines are shared by the configurations that differ elsewhere. Then each
configuration runs the same request (the request flags every command takes; the seed and scheduler used are
recorded) --runs times after warm-up; the medians are reported. For every engine the plugin layers TensorRT's
engine inspector lists are counted against what the ONNX passes reported replacing, and every image is
compared with the no-plugin one. Writes JSON, a markdown table and PNG charts into --results-dir; with
--update-defaults, records which plugins measured faster than none on this GPU's compute capability in the
tuned defaults (plugins/tuned_defaults.json, or --defaults-file), which --plugins auto reads.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench.charts import ablation_chart, kernel_chart
from bench.common import ALL, ResultsFlags, log, measuring_parser, slug
from core.atomic import atomic_write_bytes, check_writable_directory, check_writable_file
from core.errors import UsageError, at_least
from demo.backends.tensorrt.options import MAX_OPTIMIZATION_LEVEL
from demo.cli.command import run_command
from demo.cli.flags import EngineFlags, ModelFlags, flag, parse_flags, same_as, summary
from demo.cli.to_spec import request_from_flags, spec_from_flags
from demo.request import TEXT_TO_IMAGE
from models.plugin_set import local_compute_capability
from plugins.contract import ATTENTION_KEYS as ATTENTION
from plugins.contract import OURS, TENSORRT
from plugins.tuned import PLUGINS_AUTO, entry_key, write_entry

PROG = "sd-ablation"
say = partial(log, PROG)
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
# What each configuration shows alone (for --plugins auto): the attention pair is measured as a pair.
ALONE = {"+fMHA/fMHCA": ATTENTION, "LayerNorm alone": ("LayerNorm",), "GroupNorm alone": ("GroupNorm",),
         "SplitGeLU alone": ("SplitGeLU",), "Seq2Spatial alone": ("Seq2Spatial",)}


@dataclass(frozen=True)
class AblationFlags:
    runs: int = flag("timed runs per configuration; medians reported (default: %(default)s)", 5)
    configs: str | None = flag("comma list of configuration labels, in the order to build them (runs and the table "
                               f"keep this order: {', '.join(c[0] for c in CONFIGS)}; default: all)", metavar="LABELS")
    work_dir: str = flag("per-configuration ONNX and engines (default: %(default)s)", "ablation")
    parallel_builds: int = flag("engine builds at a time (default: %(default)s)", 4)
    build_gpus: int = flag("spread the builds over this many GPUs (CUDA_VISIBLE_DEVICES, in turn), so that their "
                           "tactic timing does not share one; the runs use the first (default: %(default)s)", 1)
    build_only: bool = flag("build every configuration's engines, run none", False)
    build_budget_s: float | None = flag("stop building after this many seconds: builds still running are stopped, and "
                                        "their configurations reported as not built (default: no limit). --configs "
                                        "gives the order", metavar="SECONDS")
    # The engine flags that apply to every configuration (the ablation sets the others per job).
    optimization_level: int = same_as(EngineFlags, "optimization_level")
    disable_tactic_sources: str | None = same_as(EngineFlags, "disable_tactic_sources")
    enable_tactic_sources: str | None = same_as(EngineFlags, "enable_tactic_sources")


def build_parser():
    return measuring_parser(PROG, summary(__doc__), AblationFlags)


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)))


def run(flags) -> int:
    ablation = flags[AblationFlags]
    configs = select_configs(ablation.configs)
    check_flags(ablation, flags[ResultsFlags])
    spec_from_flags(flags).check()
    request_from_flags(flags).check_inputs()
    return ablate(flags, configs)


def select_configs(text: str | None) -> list[tuple[str, tuple[str, ...], str]]:
    if not text:
        return list(CONFIGS)
    known = {config[0]: config for config in CONFIGS}
    labels = [label.strip() for label in text.split(",") if label.strip()]
    unknown = [label for label in labels if label not in known]
    if unknown or not labels:
        raise UsageError(f"unknown configuration(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}")
    return [known[label] for label in labels]


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


def check_flags(ablation: AblationFlags, output: ResultsFlags) -> None:
    """What can be checked before the model is resolved (which may generate a built-in one)."""
    at_least("runs", ablation.runs, 1)
    at_least("parallel_builds", ablation.parallel_builds, 1)
    at_least("build_gpus", ablation.build_gpus, 1)  # at most the GPUs here: checked where torch counts them
    if ablation.build_budget_s is not None and ablation.build_budget_s <= 0:
        raise UsageError(f"--build-budget-s must be positive, got {ablation.build_budget_s}")
    if not 0 <= ablation.optimization_level <= MAX_OPTIMIZATION_LEVEL:
        raise UsageError(f"--optimization-level must be 0..{MAX_OPTIMIZATION_LEVEL}, got "
                         f"{ablation.optimization_level}")
    check_writable_directory("results directory", Path(output.results_dir))
    check_writable_directory("work directory", Path(ablation.work_dir))
    if output.update_defaults:
        check_writable_file("tuned-defaults file", output.defaults_path)


def ablate(flags, configs: list[tuple[str, tuple[str, ...], str]]) -> int:
    # The builds and runs load torch (seconds): --help and the usage errors (run) answer without it.
    import torch
    from PIL import Image

    from bench.jobs import BUILT_STAGES, BuildPlan, build_all, config_jobs, export_and_probe
    from bench.runner import compare_images, run_config
    from demo.backends.registry import backend_named
    from demo.runtime.loader import plan_pipeline, quiet
    from demo.runtime.spec import reference_spec

    ablation, output, model = flags[AblationFlags], flags[ResultsFlags], flags[ModelFlags]
    if ablation.build_gpus > max(torch.cuda.device_count(), 1):
        raise UsageError(f"--build-gpus must be 1 to the {torch.cuda.device_count()} GPUs here, "
                         f"got {ablation.build_gpus}")
    # The request every configuration runs, resolved and checked against the model.
    reference = plan_pipeline(reference_spec(spec_from_flags(flags, modes=(TEXT_TO_IMAGE,))),
                              request=request_from_flags(flags), log=quiet)
    source, request = reference.source, reference.request
    work = Path(ablation.work_dir)
    plan = BuildPlan(model.model, work, request.height, request.width, request.batch_size, request.guided,
                     ablation.optimization_level, ablation.disable_tactic_sources, ablation.enable_tactic_sources)
    start = time.perf_counter()
    families = export_and_probe(plan, source, sorted({c for _, plugins, c in configs if plugins}), say)
    jobs = config_jobs(configs, families)
    # In --configs order, so that a --build-budget-s stops the last configurations, not parts of all of them
    order = list(dict.fromkeys(jobs[label][stage] for label, _, _ in configs for stage in BUILT_STAGES))
    build_s, failed_jobs = build_all(plan, order, ablation.parallel_builds, ablation.build_gpus,
                                     ablation.build_budget_s, say)
    failed = {label: "; ".join(failed_jobs[job] for job in jobs[label].values() if job in failed_jobs)
              for label, _, _ in configs if any(job in failed_jobs for job in jobs[label].values())}
    say(f"{len(order)} engines of {len(configs)} configurations ready in {time.perf_counter() - start:.0f} s")
    if ablation.build_only:
        return 0
    rows, images = [], {}
    for label, plugins, convention in sorted(configs, key=CONFIGS.index):
        if label in failed:
            continue
        say(f"running '{label}' ...")
        row = run_config(plan, source, request, ablation.runs, label, plugins, convention, jobs[label])
        row["build_s"] = {stage: build_s.get(job) for stage, job in jobs[label].items()}
        images[label] = row.pop("image")
        Image.fromarray(images[label]).save(work / f"{slug(label)}.png")
        rows.append(row)
        (work / "rows.json").write_text(json.dumps(rows, indent=1))  # what is done so far, for long runs
        say(f"'{label}': pipeline {row['latency_ms']['pipeline']:.2f} ms, UNet {row['latency_ms']['unet']:.2f} ms")
    if not rows:
        print(f"{PROG}: error: no configuration was built, so none ran", file=sys.stderr)
        return 1
    for row in rows:
        row["psnr_vs_none"], row["max_pixel_diff_vs_none"] = compare_images(images[row["label"]], images.get("none"))
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "compute_capability": local_compute_capability(),
            "tensorrt": backend_named("tensorrt").version(),
            "model": source.name, "height": request.height, "width": request.width,
            "batch_size": request.batch_size, "steps": request.denoising_steps, "scheduler": request.scheduler,
            "guidance_scale": request.guidance_scale, "seed": request.seed, "prompt": request.prompt,
            "runs": ablation.runs, "optimization_level": ablation.optimization_level,
            "date": datetime.date.today().isoformat(), "parallel_builds": ablation.parallel_builds,
            "build_budget_s": ablation.build_budget_s, "build_gpus": ablation.build_gpus}
    json_path = write_results(Path(output.results_dir), rows, failed, meta)
    if output.update_defaults:
        update_plugins_auto(output.defaults_path, rows, meta, json_path, source.family.tuned_key)
    return 0


def write_results(results: Path, rows: list[dict], failed: dict, meta: dict) -> Path:
    """The ablation's JSON, markdown table and charts in `results`; the table is printed too."""
    from bench.tables import ablation_table, kernel_table

    gpu, trt_version = meta["gpu"], meta["tensorrt"]
    name = f"ablation-{slug(gpu)}"
    comparisons = kernel_comparisons(rows)
    table = (ablation_table(rows, gpu, trt_version)
             + "".join(f"\n'{label}' not run: {why}\n" for label, why in failed.items())
             + "\n" + kernel_table(rows, comparisons))
    json_path = results / f"{name}.json"
    atomic_write_bytes(json_path, json.dumps({**meta, "rows": rows, "failed": failed,
                                              "kernel_comparisons": comparisons}, indent=1).encode())
    atomic_write_bytes(results / f"{name}.md", table.encode())
    atomic_write_bytes(results / f"{name}.png", ablation_chart(
        rows, f"Plugin ablation, {meta['model']} {meta['width']}x{meta['height']}, {meta['steps']} steps — {gpu}, "
              f"TensorRT {trt_version}"))
    if comparisons:
        atomic_write_bytes(results / f"{name}-kernels.png", kernel_chart(
            comparisons, f"Our plugins against TensorRT's, kernel for kernel, in the UNet\n{gpu}, "
                         f"TensorRT {trt_version}"))
    print(table)
    return json_path


def update_plugins_auto(path: Path, rows: list[dict], meta: dict, json_path: Path,
                        family: str | None = None) -> None:
    """Record the plugins that measured faster alone than none as this compute capability's `--plugins auto` (for
    the family's models where it has a tuned key of its own: models.families Family.tuned_key)."""
    if meta["compute_capability"] is None:
        say("no GPU here: the tuned defaults are left as they are")
        return
    if not any(row["label"] == "none" for row in rows):
        say("no 'none' configuration ran, so nothing was measured against it: the tuned defaults are left as they are")
        return
    plugins = faster_than_none(rows)
    key = entry_key(meta["compute_capability"], family)
    write_entry(PLUGINS_AUTO, key, {
        "plugins": plugins, "gpu": meta["gpu"], "date": meta["date"], "tensorrt": meta["tensorrt"],
        "source": f"sd-ablation, {json_path.parent.name}/{json_path.name}"}, path)
    say(f"--plugins auto for {key}: {', '.join(plugins) or 'none'}, "
        f"written to {path}")
