"""Offline throughput: images per second for one model at several batch sizes, the way a server would run them.

    sd-throughput [PROMPT] --model sdxl-arch --mlperf --batch-sizes 1,2,4,8 [--overlap both] [--batches 3]

Per batch size: one pipeline, loaded and made ready for that batch (torch.compile compiling, a CUDA graph per stage
captured; engines built or found), timed apart as load s and ready s; --warmup-batches batches, then --batches batches
timed as one stream (demo.pipelines.stream), from the first call to the last batch's pixels on the host: images per
second, ms per image, and per batch the text encoders', the UNet's (per step) and the VAE's times, with the peak of
torch.cuda.max_memory_allocated over that mode's batches. --overlap on runs the stream with the next batch's text
encoding beside the current loop and each decode beside the next loop, off one batch after the other, both (the default)
each on the same loaded pipeline, so the table says what overlapping wins. A batch whose memory floor exceeds what is
free, or that runs out of memory, is reported as not fitting in one line; the sweep goes on. --mlperf takes MLPerf
Inference's SDXL settings where the request flags leave them unset: 20 Euler steps, guidance 8, 1024x1024.

Engines (--backend tensorrt, tensorrt-rtx): built for batches 1 to --max-batch-size (default: the largest of
--batch-sizes; with --build-static-batch or --use-cuda-graph, exactly each batch); a batch size above it is refused
before any work. Writes, into --results-dir, after every batch size: throughput-<gpu>.json (rows of earlier runs for
other settings, batch sizes or workloads kept; --fresh drops them), throughput-<gpu>.md, and throughput-<gpu>.png
(images/s against batch size), naming the GPU, software, command and date.
"""

from __future__ import annotations

import datetime
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from bench.common import MLPERF_SDXL, ResultsFlags, earlier_entries, log, measuring_parser, ms, one_line, slug
from core.atomic import atomic_write_bytes, check_writable_directory
from core.errors import UsageError, at_least, field, render_fields
from demo.backends import FLAVOURS
from demo.cli.command import flag_name, out_of_memory, run_command
from demo.cli.flags import DemoFlags, EngineFlags, RequestFlags, add_pipeline_flags, flag, parse_flags, same_as, summary
from demo.cli.to_spec import request_from_flags, spec_from_flags
from demo.request import TEXT_TO_IMAGE

PROG = "sd-throughput"
say = partial(log, PROG)
# MLPerf Inference's SDXL offline results per GPU (NVIDIA's: TensorRT, the UNet in FP8, the VAE in INT8), images/s:
# what a run of MLPerf's settings on an SDXL model is set against. Both are SXM systems' (700 W a GPU): the PCIe and
# NVL cards of the same names (torch names them so) run at far less power and are set against neither.
MLPERF_OFFLINE = {"H200": (2.37, "v5.0"), "H100": (2.04, "v4.1")}
NOT_SXM = ("PCIe", "NVL")
OVERLAP_MODES = {"on": (True,), "off": (False,), "both": (True, False)}
KINDS = ("rows", "did_not_fit", "failed")  # measured rows, then batch sizes with the reason there is no row
STAGES = ("clip", "unet", "vae")


@dataclass(frozen=True)
class ThroughputFlags:
    backend: str = same_as(DemoFlags, "backend")
    batch_sizes: tuple[int, ...] = flag("images per pipeline call, one measurement each (default: 1,2,4,8)",
                                        (1, 2, 4, 8), metavar="B,B,...", comma_separated=True)
    batches: int = flag("timed batches per batch size (default: %(default)s)", 3)
    warmup_batches: int = flag("untimed batches first, after getting ready (default: %(default)s)", 1)
    overlap: str = flag("on: the next batch's text encoding beside the current loop and each decode beside the next "
                        "loop (CUDA streams; a CPU runs them in order); off: one batch after the other; both: each, "
                        "on the same pipeline (default: %(default)s)", "both", choices=tuple(OVERLAP_MODES))
    max_batch_size: int | None = flag("engines: the largest batch they are built for (default: the largest of "
                                      "--batch-sizes); a larger batch size is refused", None)
    mlperf: bool = flag(f"MLPerf SDXL's settings where unset: {MLPERF_SDXL['denoising_steps']} "
                        f"{MLPERF_SDXL['scheduler']} steps, guidance {MLPERF_SDXL['guidance_scale']:g}, "
                        f"{MLPERF_SDXL['width']}x{MLPERF_SDXL['height']}", False)
    fresh: bool = flag("drop rows an earlier run left in the results JSON", False)


def build_parser():
    parser = measuring_parser(PROG, summary(__doc__), ThroughputFlags)
    add_pipeline_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv), f"{PROG} {shlex.join(argv)}"))


def check_flags(flags) -> None:
    """What the flags say alone, before the model is resolved."""
    thr, output = flags[ThroughputFlags], flags[ResultsFlags]
    for size in thr.batch_sizes:
        at_least("batch_sizes", size, 1)
    at_least("batches", thr.batches, 1)
    at_least("warmup_batches", thr.warmup_batches, 0)
    if thr.max_batch_size is not None:
        at_least("max_batch_size", thr.max_batch_size, 1)
    if flags[RequestFlags].batch_size != RequestFlags.batch_size:
        raise UsageError(f"{field('batch_size')}: {PROG} measures the sizes {field('batch_sizes')} gives")
    if output.update_defaults or output.defaults_file:
        raise UsageError(f"{field('update_defaults')}: {PROG} measures throughput; it records no tuned defaults "
                         "(sd-benchmark does)")
    if thr.backend in FLAVOURS:  # the engines' range, before anything is planned (auto: once it is resolved)
        engine_batch_range(thr, True, static_engines(flags[EngineFlags]))
    check_writable_directory("results directory", Path(output.results_dir))


def static_engines(engine: EngineFlags) -> bool:
    """Whether engines are built for exactly each batch (graphs replay one shape)."""
    return engine.build_static_batch or bool(engine.use_cuda_graph)


def mlperf_request(request, on: bool):
    """The request with MLPerf SDXL's settings where unset (`on`); a UsageError where a flag gives another."""
    if not on:
        return request
    for name, value in MLPERF_SDXL.items():
        given = getattr(request, name)
        if given is not None and given != value:
            raise UsageError(f"{field(name)} {given}: {field('mlperf')} runs MLPerf's {value}; leave it unset")
    return replace(request, **MLPERF_SDXL)


def engine_batch_range(thr: ThroughputFlags, engines: bool, static: bool) -> int | None:
    """The spec's max_batch_size for the sweep: None on the torch backend and for static engines (each batch its own);
    else --max-batch-size, a UsageError where a batch size is above it."""
    if not engines or static:
        return None
    largest = thr.max_batch_size or max(thr.batch_sizes)
    above = [size for size in thr.batch_sizes if size > largest]
    if above:
        raise UsageError(f"{field('batch_sizes')} {','.join(map(str, above))}: above {field('max_batch_size')} "
                         f"{largest}, the largest batch the engines are built for")
    return largest


def runs_mlperf(source, request) -> bool:
    """Whether the run is MLPerf's SDXL benchmark's: an SDXL model, MLPerf's steps, scheduler, guidance and size."""
    return source.family.name == "sdxl" and all(getattr(request, name) == value for name, value in MLPERF_SDXL.items())


def mlperf_yardstick(gpu: str, rows: list[dict]) -> tuple[float, str] | None:
    """MLPerf's published offline images/s on this GPU and what it was (None: the rows are not of MLPerf's
    settings, or MLPerf has no figure of ours for the GPU)."""
    if not any(row.get("mlperf_settings") for row in rows):
        return None
    for name, (value, version) in MLPERF_OFFLINE.items():
        if name in gpu and not any(form in gpu for form in NOT_SXM):
            return value, f"MLPerf Inference {version} SDXL offline, NVIDIA {name} (TensorRT, UNet FP8, VAE INT8)"
    return None


def why_serial(plan) -> str | None:
    """Why the stream runs its batches in order whatever --overlap says (None: it can overlap them)."""
    if plan.device.type != "cuda":
        return "no GPU here: the stream runs its batches in order (serial rows only)"
    why = plan.backend.why_serial(plan.base.settings.values())
    return None if why is None else f"{why}: the stream runs its batches in order (serial rows only)"


def overlap_modes(overlap: str, plan) -> tuple[bool, ...]:
    """The stream's modes to measure: --overlap's, serial alone where nothing can overlap."""
    return OVERLAP_MODES[overlap] if why_serial(plan) is None else (False,)


def run(flags, command: str) -> int:
    check_flags(flags)
    thr = flags[ThroughputFlags]
    spec = spec_from_flags(flags, backend=thr.backend, modes=(TEXT_TO_IMAGE,))
    spec.check()
    request = mlperf_request(request_from_flags(flags), thr.mlperf)
    request.check_inputs()
    return sweep(flags, spec, request, command)


def setup_label(plan) -> str:
    """What a row's pipeline runs as, without the overlap: the backend, precision, plugins, options, the VAE's
    precision and the step cache where set."""
    from demo.runtime.report import run_precision

    described = plan.backend.describe(plan.base.settings[plan.source.family.denoiser_stage])
    parts = [plan.backend.name, run_precision(plan.spec.precision, plan.dtype),
             "plugins " + "+".join(described.plugins) if described.plugins else "no plugins", *described.options]
    if plan.source.vae_precision:
        parts.append(f"VAE {plan.source.vae_precision}")
    if plan.spec.cache_interval > 1:
        parts.append(f"step cache every {plan.spec.cache_interval}")
    if plan.spec.cache_threshold > 0:
        parts.append(f"adaptive cache {plan.spec.cache_threshold:g}")
    return ", ".join(parts)


def sweep(flags, spec, request, command: str) -> int:
    # The measuring loads torch (seconds): --help and the usage errors answer without it.
    from demo.backends.registry import backend_named
    from demo.runtime.loader import plan_pipeline, quiet
    from demo.runtime.report import device_name, library_versions

    thr, output = flags[ThroughputFlags], flags[ResultsFlags]
    sizes = list(dict.fromkeys(thr.batch_sizes))
    first = plan_pipeline(replace(spec, batch_size=min(sizes)), request=replace(request, batch_size=min(sizes)),
                          log=quiet)
    engines = first.backend.name in FLAVOURS
    max_batch = engine_batch_range(thr, engines, engines and static_engines(flags[EngineFlags]))
    if thr.max_batch_size is not None and max_batch is None:
        say(f"note: {render_fields(field('max_batch_size'), flag_name)} unused: "
            + ("each batch size gets engines of exactly its batch" if engines else "the torch backend takes any batch"))
    if why_serial(first) is not None:
        say(f"note: {why_serial(first)}")
    for note in first.notes + first.request.unused():
        say(f"note: {render_fields(note, flag_name)}")
    request, device = first.request, first.device
    tensorrt = backend_named("tensorrt")
    gpu = device_name(device)
    results = ThroughputResults(Path(output.results_dir), thr.fresh, gpu, {
        "gpu": gpu, "versions": library_versions(), "tensorrt": None if tensorrt.why_cannot_build()
        else f"TensorRT {tensorrt.version()}", "command": command,
        "date": datetime.datetime.now().isoformat(timespec="seconds")})
    workload = (f"{first.source.name}, {request.width}x{request.height}, {request.denoising_steps} "
                f"{request.scheduler} steps, guidance {request.guidance_scale:g}")
    setup = setup_label(first)
    say(f"{workload} on {gpu}: {setup}; batch sizes {','.join(map(str, sizes))}, {thr.batches} timed batch(es) "
        f"after {thr.warmup_batches} warm-up, overlap {thr.overlap}")
    for size in sizes:
        base = {"workload": workload, "setup": setup, "batch_size": size, "command": command,
                "mlperf_settings": runs_mlperf(first.source, request),
                "measured": datetime.datetime.now().isoformat(timespec="seconds")}
        for kind, entry in measure_batch(replace(spec, batch_size=size, max_batch_size=max_batch),
                                         replace(request, batch_size=size), thr, first, base):
            results.record(kind, entry)
    print(throughput_table(results.data), end="")
    say(f"wrote {results.json_path} and its .md and .png")
    return 0


def measure_batch(spec, request, thr: ThroughputFlags, first, base: dict) -> list[tuple[str, dict]]:
    """One batch size: per overlap mode its row or why there is none ("did_not_fit", "failed": a mode's, with its
    overlap); or why the batch size has none at all (it does not load, or fails getting ready). `first`: the sweep's
    plan (its source, device and dtype are every batch size's)."""
    import torch

    from bench.runner import free_memory, memory_row, sync
    from demo.pipelines.timer import StageTimer
    from demo.runtime.loader import load_pipeline, quiet
    from demo.runtime.memory import check_memory
    from models.stages import stage_batch

    size, device = request.batch_size, first.device
    cuda = device.type == "cuda"
    try:
        check_memory(first.source, size, request.height, request.width, device, first.dtype)
    except UsageError as exc:
        reason = exc.render(flag_name)
        say(f"batch {size}: does not fit: {reason}")
        return [("did_not_fit", {**base, "reason": reason})]
    pipeline = None
    try:
        if cuda:
            free_before = torch.cuda.mem_get_info(device)[0]
        say(f"batch {size}: loading")
        start = time.perf_counter()
        pipeline = load_pipeline(spec, device, log=quiet, progress=say)
        loaded = {"load_s": time.perf_counter() - start}
        request = pipeline.request(request)  # checked against what was loaded: an engine's batch range among it
        say(f"batch {size}: getting ready (compiling, capturing) ...")
        start = time.perf_counter()
        for name, stage in pipeline.stages.items():
            stage.prepare(stage_batch(name, size, request.guided), request.height, request.width)
        sync(device)
        loaded.update(ready_s=time.perf_counter() - start, **pipeline.stats())
        loaded.pop("substitution", None)
        unet_calls = pipeline.unet_calls(request)
        calls = [[replace(request, seed=request.seed + index)] for index in range(thr.warmup_batches + thr.batches)]

        def one_mode(overlap: bool, mode: str) -> dict:
            if cuda:  # each row's peak is its own mode's: the serial row's is not the overlapped one's before it
                torch.cuda.reset_peak_memory_stats(device)
            if thr.warmup_batches:
                say(f"batch {size}, {mode}: {thr.warmup_batches} warm-up batch(es)")
                pipeline.run_stream(calls[:thr.warmup_batches], overlap)
            say(f"batch {size}, {mode}: {thr.batches} timed batch(es), {thr.batches * size} images ...")
            timers = [StageTimer(device) for _ in range(thr.batches)]
            sync(device)
            start = time.perf_counter()
            pipeline.run_stream(calls[thr.warmup_batches:], overlap, timers,
                                done=lambda index: say(f"batch {size}, {mode}: {index + 1}/{thr.batches} done"))
            wall = time.perf_counter() - start
            per_batch = [timer.milliseconds() for timer in timers]
            latency = {stage: statistics.median(t.get(stage, 0.0) for t in per_batch) for stage in STAGES}
            row = {**base, "label": f"{base['setup']} · {mode}", "overlap": overlap, "backend": pipeline.backend.name,
                   **loaded, "batches": thr.batches, "warmup_batches": thr.warmup_batches,
                   "images": thr.batches * size, "wall_s": wall, "images_per_s": thr.batches * size / wall,
                   "ms_per_image": wall * 1e3 / (thr.batches * size), "unet_calls": unet_calls,
                   "latency_ms": latency, "unet_ms_per_step": latency["unet"] / unet_calls,
                   "latency_ms_batches": per_batch}
            if cuda:
                row.update(memory_row(device, free_before))
            say(f"batch {size}, {mode}: {row['images_per_s']:.3f} images/s ({row['ms_per_image']:.2f} ms an image); "
                f"per batch CLIP {latency['clip']:.2f} ms, UNet {row['unet_ms_per_step']:.2f} ms a step, VAE "
                f"{latency['vae']:.2f} ms")
            return row

        entries = []
        for overlap in overlap_modes(thr.overlap, first):
            mode = "overlapped" if overlap else "serial"
            try:
                entries.append(("rows", one_mode(overlap, mode)))
            except Exception as exc:  # this mode alone: the overlapped stream holds two batches at once, and the
                # serial one (what sd-serve runs) may fit where it did not
                kind = "did_not_fit" if out_of_memory(exc) else "failed"
                say(f"batch {size}, {mode}: {'ran out of memory' if kind == 'did_not_fit' else 'failed'}: "
                    f"{one_line(exc)}")
                entries.append((kind, {**base, "label": f"{base['setup']} · {mode}", "overlap": overlap,
                                       "reason": one_line(exc)}))
                sync(device)  # nothing of this mode's still queued on a lane when the next one starts
                free_memory(device)
        return entries
    except Exception as exc:  # out of memory, a compile error: reported, and the sweep goes on
        kind = "did_not_fit" if out_of_memory(exc) else "failed"
        say(f"batch {size}: {'ran out of memory' if kind == 'did_not_fit' else 'failed'}: {one_line(exc)}")
        return [(kind, {**base, "reason": one_line(exc)})]
    finally:
        if pipeline is not None:
            pipeline.close()
        free_memory(device)


class ThroughputResults:
    """The throughput JSON, markdown and chart of one GPU, rewritten after every batch size; rows are keyed by
    workload, label and batch size, and an earlier run's rows for others are kept (unless `fresh`)."""

    def __init__(self, directory: Path, fresh: bool, gpu: str, meta: dict):
        self.directory = directory
        self.stem = f"throughput-{slug(gpu)}"
        self.json_path = directory / f"{self.stem}.json"
        self.data = {**meta, **earlier_entries(self.json_path, fresh, gpu, KINDS, PROG)}

    @staticmethod
    def _key(entry: dict) -> tuple:
        return entry["workload"], entry["setup"], entry["batch_size"], entry.get("overlap")

    def record(self, kind: str, entry: dict) -> None:
        """A row (or a batch size, or one mode of it, that did not fit or failed), in place of an earlier run's for
        the same key: a batch size's failure (no overlap) replaces its entries in either mode, a mode's row or
        failure that mode's entries and the batch size's failure."""
        def same(other: dict) -> bool:
            key, theirs = self._key(entry), self._key(other)
            return key[:3] == theirs[:3] and ("overlap" not in entry or "overlap" not in other or key[3] == theirs[3])

        for other_kind in KINDS:
            self.data[other_kind] = [e for e in self.data[other_kind] if not same(e)]
        self.data[kind].append(entry)
        self.write()

    def write(self) -> None:
        from bench.charts import throughput_chart

        atomic_write_bytes(self.json_path, (json.dumps(self.data, indent=1) + "\n").encode())
        atomic_write_bytes(self.directory / f"{self.stem}.md", throughput_table(self.data).encode())
        if self.data["rows"]:
            rows = self.data["rows"]
            yardsticks = {row["workload"]: mlperf_yardstick(self.data["gpu"], [row]) for row in rows}
            atomic_write_bytes(self.directory / f"{self.stem}.png", throughput_chart(rows, yardsticks))


def _gib(value) -> str:
    return "—" if value is None else f"{value / 2**30:.2f}"


def _s(value) -> str:
    return "—" if value is None else f"{value:.1f}"


def throughput_table(data: dict) -> str:
    """The results as markdown: per workload, each setup's rows by batch size, the overlap's gain where both modes
    ran, then the batch sizes that did not fit or failed."""
    software = f"{data['versions'].get('torch', '?')}; {data.get('tensorrt') or 'no TensorRT'}"
    parts = [f"Throughput on {data['gpu']} ({software}), last run {data['date']}: `{data['command']}`. Images/s: "
             "the timed batches' images over their wall time, from the first call to the last pixels on the host; "
             "CLIP, UNet / step and VAE: medians per batch (overlapped: each on its own CUDA stream, beside the "
             "others' work); ready s: compiling and capturing before any batch; vs serial: images/s against the "
             "same setup one batch after the other; peak: torch.cuda.max_memory_allocated over "
             "that mode's batches."]
    workloads: dict[str, list[dict]] = {}
    for row in data.get("rows", []):
        workloads.setdefault(row["workload"], []).append(row)
    for title, rows in workloads.items():
        serial = {(r["setup"], r["batch_size"]): r for r in rows if not r["overlap"]}
        lines = [f"**{title}**", "",
                 "| setup | batch | images/s | ms / image | vs serial | CLIP / batch | UNet / step | VAE / batch "
                 "| load s | ready s | peak GiB |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in sorted(rows, key=lambda r: (r["label"], r["batch_size"])):
            other = serial.get((row["setup"], row["batch_size"])) if row["overlap"] else None
            gain = f"{row['images_per_s'] / other['images_per_s']:.3f}x" if other else "—"
            latency = row["latency_ms"]
            lines.append(f"| {row['label']} | {row['batch_size']} | {row['images_per_s']:.3f} "
                         f"| {ms(row['ms_per_image'])} | {gain} | {ms(latency['clip'])} "
                         f"| {ms(row['unet_ms_per_step'])} | {ms(latency['vae'])} | {_s(row.get('load_s'))} "
                         f"| {_s(row.get('ready_s'))} | {_gib(row.get('peak_allocated_bytes'))} |")
        best = max(rows, key=lambda r: r["images_per_s"])
        lines += ["", f"Best: {best['images_per_s']:.3f} images/s at batch {best['batch_size']} ({best['label']})."]
        yardstick = mlperf_yardstick(data["gpu"], rows)
        if yardstick:
            lines[-1] += (f" {yardstick[1]}: {yardstick[0]:.2f} images/s; the best here is "
                          f"{best['images_per_s'] / yardstick[0]:.2f}x that.")
        parts.append("\n".join(lines))
    for kind in KINDS[1:]:
        for entry in data.get(kind, []):
            parts.append(f"{entry['workload']}, {entry.get('label', entry['setup'])}, batch {entry['batch_size']}: "
                         f"{kind.replace('_', ' ')}: {entry['reason']}")
    return "\n\n".join(parts) + "\n"
