"""The ablation's engines: one build job per stage and plugin set, built once, several at a time (over one
or more GPUs), and found again by the runs through the very same flags.

A stage gets only the plugin families the passes find in it, so configurations that differ elsewhere share
its engine (the text encoder has no GroupNorm; the VAE no LayerNorm, and its attention is too wide for the
kernels): probes of the text encoder and the VAE, optimized with every plugin, tell which families they have.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

import demo
from bench.common import ALL, slug
from core.errors import UsageError
from demo.backends.registry import backend_named
from demo.backends.tensorrt.options import EngineOptions
from demo.cli.build_engines import BuildFlags
from demo.cli.flags import EngineFlags, ModelFlags, to_argv
from demo.cli.to_spec import options_of
from demo.request import TEXT_TO_IMAGE
from demo.runtime.spec import PipelineSpec, StageOverride
from models.plugin_passes import read_pass_report
from models.stages import STAGE_MODELS
from plugins.contract import OURS

BUILT_STAGES = ("unet", "clip", "vae")
PROBED_STAGES = ("clip", "vae")  # the UNet is taken to have every family (its pass report is checked anyway)


@dataclass(frozen=True)
class Job:
    """One engine to build: a stage with the plugins it gets, in a convention."""

    stage: str
    plugins: tuple[str, ...]
    convention: str

    @property
    def folder(self) -> str:
        return slug(f"{self.stage} {' '.join(self.plugins) or 'none'} {self.convention if self.plugins else ''}")


def job_for(stage: str, plugins: tuple[str, ...], convention: str, families: dict) -> Job:
    """The job for `stage` in a configuration with `plugins`: those of them its probe found (all where unprobed)."""
    kept = tuple(p for p in ALL if p in plugins and p in families.get((stage, convention), ALL))  # in one order
    return Job(stage, kept, convention if kept else OURS)


def config_jobs(configs, families: dict) -> dict[str, dict[str, Job]]:
    """{label: {stage: job}} for configurations given as (label, plugins, convention)."""
    return {label: {stage: job_for(stage, plugins, convention, families) for stage in BUILT_STAGES}
            for label, plugins, convention in configs}


@dataclass(frozen=True)
class BuildPlan:
    """What every engine of one ablation is built for, in its folder under `work`: the model, the request's
    shape, and the builder settings. A job's build-engines command line and the run's spec both come from
    engine_flags(job), so the run finds exactly the engines the build made."""

    model: str
    work: Path
    height: int
    width: int
    batch_size: int = 1
    guided: bool = True
    optimization_level: int = EngineFlags.optimization_level
    disable_tactic_sources: str | None = None
    enable_tactic_sources: str | None = None

    def engine_flags(self, job: Job) -> EngineFlags:
        folder = self.work / job.folder
        return EngineFlags(onnx_dir=str(folder / "onnx"), engine_dir=str(folder / "engine"), build_static_batch=True,
                           optimization_level=self.optimization_level,
                           disable_tactic_sources=self.disable_tactic_sources,
                           enable_tactic_sources=self.enable_tactic_sources,
                           plugins=",".join(job.plugins) or "none", plugin_convention=job.convention)

    def build_flags(self, job: Job) -> BuildFlags:
        return BuildFlags(backend="tensorrt", stages=job.stage, batch_size=self.batch_size, height=self.height,
                          width=self.width, no_guidance=not self.guided)

    def argv(self, job: Job) -> list[str]:
        """build-engines' arguments for a job."""
        return [*to_argv(ModelFlags(model=self.model)), *to_argv(self.build_flags(job)),
                *to_argv(self.engine_flags(job))]

    def config_spec(self, source, plugins: tuple[str, ...], convention: str, jobs: dict[str, Job] | None = None,
                    use_cuda_graph: bool = False) -> PipelineSpec:
        """The spec of a configuration with `plugins` (in `convention`) on its jobs' engines (`jobs`, else those the
        probes in `work` give it): each stage from its own job's folder, with building off (an engine that is not
        there, or not for these settings, is an error, never a build on the GPU being timed)."""
        if jobs is None:
            families = probed_families(source, self.work, convention) if plugins else {}
            jobs = {stage: job_for(stage, plugins, convention, families) for stage in BUILT_STAGES}
        overrides = []
        for stage, job in jobs.items():
            flags = self.engine_flags(job)
            overrides.append(StageOverride(stage, plugins=flags.plugins,
                                           engine=replace(options_of(flags, EngineOptions), build_missing=False)))
        build = self.build_flags(next(iter(jobs.values())))
        return PipelineSpec(model=self.model, backend=build.backend, modes=(TEXT_TO_IMAGE,), stages=tuple(jobs),
                            height=build.height, width=build.width, batch_size=build.batch_size,
                            guided=not build.no_guidance, use_cuda_graph=use_cuda_graph,
                            stage_overrides=tuple(overrides))


def share_raw_export(source_dir: Path, target_dir: Path, stage: str) -> None:
    """Hard-link a plugin-free export (and its manifest) into another job's folder: the raw export does
    not depend on the plugin set, only the optimized ONNX does."""
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in (f"{stage}.onnx", f"{stage}.onnx.json", f"{stage}.onnx.data"):
        if (source_dir / name).exists() and not (target_dir / name).exists():
            os.link(source_dir / name, target_dir / name)


def raw_dir(work: Path, stage: str) -> Path:
    return work / Job(stage, (), OURS).folder / "onnx"


def probe_dir(work: Path, stage: str, convention: str) -> Path:
    return work / f"probe-{stage}-{convention}" / "onnx"


def export_and_probe(plan: BuildPlan, source, conventions: list[str], say: Callable[[str], None] = print) -> dict:
    """Export each stage's raw ONNX once, and run every pass on the text encoder and the VAE in each of
    `conventions` to learn which families they contain. Returns {(stage, convention): families}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = backend_named("tensorrt").default_dtype(device, source.family)
    for stage in BUILT_STAGES:
        say(f"exporting {stage} ONNX ...")
        model = STAGE_MODELS[stage](source)
        model.prepare_onnx(raw_dir(plan.work, stage), device, dtype, log=lambda *_: None)
        for convention in conventions if stage in PROBED_STAGES else ():
            probe = probe_dir(plan.work, stage, convention)
            share_raw_export(raw_dir(plan.work, stage), probe, stage)
            model.prepare_onnx(probe, device, dtype, log=lambda *_: None, plugins=ALL, plugin_convention=convention)
    families = {}
    for convention in conventions:
        families.update(probed_families(source, plan.work, convention))
        for stage in PROBED_STAGES:
            say(f"{stage} ({convention}) has: {', '.join(sorted(families[(stage, convention)])) or 'none'}")
    return families


def probed_families(source, work: Path, convention: str) -> dict:
    """{(stage, convention): families} from the probes export_and_probe left in `work`: the families the
    text encoder's and the VAE's passes replaced; the UNet is taken to have all of them."""
    families = {("unet", convention): set(ALL)}
    for stage in PROBED_STAGES:
        path = STAGE_MODELS[stage](source).optimized_onnx_path(probe_dir(work, stage, convention))
        try:
            report = read_pass_report(path)
        except (OSError, ValueError) as exc:
            raise UsageError(f"no ablation probe of {stage} ({convention}) in {work}: {exc}") from None
        families[(stage, convention)] = {key for key, counts in report.items() if counts["replaced"]}
    return families


def build_all(plan: BuildPlan, jobs: list[Job], parallel_builds: int, build_gpus: int = 1,
              budget_s: float | None = None, say: Callable[[str], None] = print
              ) -> tuple[dict[Job, float], dict[Job, str]]:
    """Build the jobs, `parallel_builds` at a time in the order given, each on the GPU with the fewest builds
    (CUDA_VISIBLE_DEVICES, where `build_gpus` > 1). Returns wall seconds per job, and for those that failed to
    build (e.g. TensorRT's own plugins where they have no kernels for this GPU) or were stopped by `budget_s`
    the reason: their configurations are reported, not run."""
    for job in jobs:
        share_raw_export(raw_dir(plan.work, job.stage), plan.work / job.folder / "onnx", job.stage)
    # The builds import this checkout's packages, installed or not.
    root = Path(demo.__file__).resolve().parent.parent
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    pending = list(jobs)
    running: dict[Job, tuple[subprocess.Popen, float, int]] = {}
    times: dict[Job, float] = {}
    failed: dict[Job, str] = {}
    deadline = time.perf_counter() + budget_s if budget_s else float("inf")
    while pending or running:
        if time.perf_counter() > deadline:
            for process, _, _ in running.values():
                process.kill()
                process.wait()
            for job in [*running, *pending]:
                failed[job] = f"{job.folder} not built within --build-budget-s {budget_s:.0f}"
                say(failed[job])
            break
        if pending and len(running) < parallel_builds:
            job = pending.pop(0)
            busy = [gpu for _, _, gpu in running.values()]
            gpu = min(range(build_gpus), key=busy.count)  # the GPU with the fewest builds
            say(f"building {job.folder} on GPU {gpu} ...")
            command = [sys.executable, "-m", "demo.cli.build_engines", *plan.argv(job)]
            environment = {**os.environ, "PYTHONPATH": path}
            if build_gpus > 1:
                environment["CUDA_VISIBLE_DEVICES"] = str(gpu)
            with open(plan.work / job.folder / "build.log", "w") as log:  # the build writes through its own copy
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
                tail = (plan.work / job.folder / "build.log").read_text().strip().splitlines()[-3:]
                failed[job] = f"{job.folder} failed to build (exit {process.returncode}): {' | '.join(tail)}"
                say(failed[job])
                continue
            say(f"built {job.folder} in {times[job]:.0f} s")
            # Running needs only the engines and the pass reports: free the disk the optimized ONNX
            # takes (1.7 GB for an SD 1.5 UNet, times a dozen configurations).
            for optimized in (plan.work / job.folder / "onnx").glob("*.opt.onnx"):
                optimized.unlink()
    return times, failed
