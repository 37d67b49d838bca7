"""sd-loadgen: MLPerf's LoadGen (mlcommons-loadgen) drives sd-serve's txt2img model in MLPerf's Offline or Server
scenario, over loopback, with MLPerf's SDXL settings as the defaults for an SDXL model.

    sd-loadgen --scenario Offline --model sdxl-arch --max-batch-size 8 --target-qps 2.2   # starts sd-serve itself
    sd-loadgen --scenario Server --url 127.0.0.1:8000 --model sdxl-arch --target-qps 2.0  # a server already running

The flags sd-loadgen does not take itself are sd-serve's (checked by sd-serve's own parser before anything starts):
with them it starts `sd-serve` with those flags, its --model and its --height, --width and --scheduler, waits until it
is ready, runs LoadGen and stops it (SIGTERM, so that it drains) however the run ends. Writes into --results-dir
(loadgen/ in the current directory by default) loadgen-<scenario>-<gpu or cpu>-<model>.json, .md and, with
matplotlib, .png, and beside them a folder of that name with LoadGen's own logs (mlperf_log_summary.txt,
mlperf_log_detail.txt), the user.conf it ran with and sd-serve's log. docs/serving.md, "MLPerf's LoadGen".
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from bench.charts import _png
from bench.common import MLPERF_SDXL, MLPERF_SDXL_NEGATIVE_PROMPT, log, one_line, slug
from core.atomic import atomic_write_bytes, check_writable_directory
from core.errors import RunFailure, UsageError, at_least
from demo.cli.client import ClientFlags
from demo.cli.command import run_command
from demo.cli.flags import Parser, add_flags, flag, parse_flags, parse_known_flags, same_as
from demo.cli.serve import FLAG_NAMES as SERVE_FLAG_NAMES
from demo.request import TEXT_TO_IMAGE
from demo.serve.client import ServeError, connection, generate
from demo.serve.schema import MODEL_NAMES

PROG = "sd-loadgen"
SCENARIOS = ("Offline", "Server")
# LoadGen's own mlperf.conf (compiled into it) holds MLPerf's rules per benchmark under this name: the Server
# scenario's latency bound (stable-diffusion-xl.Server.target_latency = 20000 ms, at *.Server's 99th percentile),
# the 600 s minimum duration, Offline's 5000 samples, the seeds. mlcommons/inference, loadgen/mlperf.conf.
MLPERF_MODEL = "stable-diffusion-xl"
# MLPerf's SDXL reference's request (bench.common), with its negative prompt for every sample.
MLPERF_SDXL_REQUEST = {**MLPERF_SDXL, "negative_prompt": MLPERF_SDXL_NEGATIVE_PROMPT}
CAPTIONS = Path(__file__).with_name("captions.txt")
LOADGEN_PACKAGE = "mlcommons-loadgen"
PERCENTILES = ("50.00", "90.00", "99.00")
# The folder's files: LoadGen's logs (their names LoadGen's), what LoadGen read, and the started server's log.
SUMMARY_LOG, DETAIL_LOG, USER_CONF, SERVER_LOG = ("mlperf_log_summary.txt", "mlperf_log_detail.txt", "user.conf",
                                                  "sd-serve.log")
# On SIGTERM sd-serve drains for its --drain-seconds, then stops within about 10 s more (docs/serving.md).
STOP_GRACE_S = 20


@dataclass(frozen=True)
class LoadgenFlags:
    scenario: str = flag("MLPerf's scenario: Offline (every sample at once; samples per second) or Server (samples "
                         "arriving as a Poisson process at --target-qps; each within the latency bound) "
                         "(default: %(default)s)", "Offline", choices=SCENARIOS)
    url: str | None = flag("a running sd-serve's HTTP (or, with --protocol grpc, gRPC) address, e.g. 127.0.0.1:8000 "
                           "(default: start sd-serve with the flags sd-loadgen does not take itself)",
                           metavar="HOST:PORT")
    protocol: str = same_as(ClientFlags, "protocol")
    model: str | None = flag("the model served: the summary's name and, for an SDXL model, MLPerf's SDXL settings as "
                             "the defaults; given to the sd-serve it starts (default there: sd-serve's; with --url: "
                             "unnamed, the server's own settings)", metavar="MODEL")
    target_qps: float | None = flag("Server: the samples per second LoadGen sends; Offline: those it expects, which "
                                    "size its one query (expected x --min-duration-s x 1.1 samples) (default: "
                                    "MLPerf's mlperf.conf, 1)", metavar="QPS")
    min_duration_s: float = flag("the run's shortest duration; MLPerf's official runs take 600 (default: %(default)s)",
                                 60.0, metavar="S")
    min_query_count: int | None = flag("the fewest queries (Offline: samples) LoadGen sends; MLPerf's official SDXL "
                                       "Offline run takes 5000 (default: Offline 1, the duration deciding; Server "
                                       "LoadGen's 100)", metavar="N")
    target_latency_ms: float | None = flag("Server: the latency bound 99%% of samples must meet, whole ms (default: "
                                           "MLPerf's SDXL bound, 20000)", metavar="MS")
    concurrency: int | None = flag("requests in flight at once, each from its own client (default: twice the "
                                   "server's --max-batch-size, so that a batch fills while one runs)", metavar="N")
    height: int | None = flag("the requests' height (default: 1024 for SDXL, as MLPerf; else the server's)")
    width: int | None = flag("the requests' width (default: 1024 for SDXL, as MLPerf; else the server's)")
    denoising_steps: int | None = flag("the requests' steps (default: 20 for SDXL, as MLPerf; else the server's)")
    guidance_scale: float | None = flag("the requests' guidance scale (default: 8 for SDXL, as MLPerf; else the "
                                        "model's own)")
    scheduler: str | None = flag("the requests' scheduler (default: Euler for SDXL, as MLPerf; else the server's)")
    negative_prompt: str | None = flag("the requests' negative prompt (default: MLPerf's for SDXL; else none)")
    prompts: str | None = flag("the Query Sample Library's captions, one a line (default: the shipped "
                               f"bench/{CAPTIONS.name}; MLPerf's are 5000 COCO captions)", metavar="FILE")
    ready_timeout_s: float = flag("how long the sd-serve it starts may take to be ready (default: %(default)s)",
                                  1800.0, metavar="S")
    results_dir: str = flag("where the summary and LoadGen's logs go (default: %(default)s, in the current "
                            "directory)", "loadgen")


def build_parser() -> Parser:
    # No abbreviations: an abbreviated sd-serve flag (--max-batch) must not be taken for one of these.
    parser = Parser(prog=PROG, allow_abbrev=False,
                    description="MLPerf's LoadGen drives sd-serve's txt2img model (Offline or Server); flags it does "
                                "not take are sd-serve's, for the server it then starts.")
    add_flags(parser, LoadgenFlags)
    return parser


def read_prompts(path: Path) -> list[str]:
    try:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts {path}: cannot read it ({exc.__class__.__name__})") from None
    if not prompts:
        raise UsageError(f"--prompts {path}: no captions in it")
    return prompts


def check_flags(flags: LoadgenFlags) -> None:
    """One line for a value LoadGen or the requests cannot take, before anything starts."""
    for name in ("target_qps", "target_latency_ms", "min_duration_s", "ready_timeout_s", "guidance_scale"):
        value = getattr(flags, name)
        if value is not None and not math.isfinite(value):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if flags.target_qps is not None and flags.target_qps <= 0:
        raise UsageError(f"--target-qps must be above 0, got {flags.target_qps}")
    if flags.target_latency_ms is not None:  # LoadGen's mlperf.conf keys take whole milliseconds
        at_least("target_latency_ms", flags.target_latency_ms, 1)
    if flags.target_latency_ms is not None and flags.scenario != "Server":
        raise UsageError("--target-latency-ms bounds the Server scenario's latency; Offline has none")
    at_least("min_duration_s", flags.min_duration_s, 0)
    at_least("ready_timeout_s", flags.ready_timeout_s, 1)
    for name in ("min_query_count", "concurrency", "denoising_steps"):
        if getattr(flags, name) is not None:
            at_least(name, getattr(flags, name), 1)
    for name in ("height", "width"):
        value = getattr(flags, name)
        if value is not None and (value < 8 or value % 8):
            raise UsageError(f"--{name} must be a multiple of 8, at least 8, got {value}")


def request_settings(flags: LoadgenFlags, sdxl: bool) -> dict:
    """The fields every request sends (None: left out, the server's own), MLPerf's SDXL ones where not given."""
    defaults = MLPERF_SDXL_REQUEST if sdxl else {}
    return {name: getattr(flags, name) if getattr(flags, name) is not None else defaults.get(name)
            for name in MLPERF_SDXL_REQUEST}


def user_conf(flags: LoadgenFlags, samples: int) -> str:
    """LoadGen's user.conf: what this run sets over MLPerf's mlperf.conf (LoadGen reads both, mlperf.conf first)."""
    scenario = f"{MLPERF_MODEL}.{flags.scenario}"
    lines = [f"{MLPERF_MODEL}.*.performance_sample_count_override = {samples}",
             f"{scenario}.min_duration = {round(flags.min_duration_s * 1000)}"]
    min_queries = flags.min_query_count or (1 if flags.scenario == "Offline" else None)
    if min_queries is not None:
        lines.append(f"{scenario}.min_query_count = {min_queries}")
    if flags.target_qps is not None:
        lines.append(f"{scenario}.target_qps = {flags.target_qps:g}")
    if flags.target_latency_ms is not None:
        lines.append(f"{scenario}.target_latency = {round(flags.target_latency_ms)}")
    return "\n".join(lines) + "\n"


def official_minimums(scenario: str) -> dict:
    """MLPerf's own settings for SDXL in this scenario, as LoadGen's mlperf.conf holds them."""
    import mlperf_loadgen

    settings = mlperf_loadgen.TestSettings()
    settings.scenario = getattr(mlperf_loadgen.TestScenario, scenario)
    settings.FromConfig("", MLPERF_MODEL, scenario, 0)  # 0: mlperf.conf alone
    official = {"min_duration_s": settings.min_duration_ms / 1000, "min_query_count": settings.min_query_count}
    if scenario == "Server":
        official.update(target_latency_ms=settings.server_target_latency_ns / 1e6,
                        target_latency_percentile=settings.server_target_latency_percentile)
    return official


@dataclass
class Tally:
    """What the System Under Test saw: samples answered with an image of the right shape, the failures by message,
    and the batch sizes the server ran the answered ones in."""

    issued: int = 0
    answered: int = 0
    errors: Counter = field(default_factory=Counter)
    batch_sizes: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def done(self) -> int:
        return self.answered + sum(self.errors.values())


class SystemUnderTest:
    """LoadGen's SUT: each sample of each query becomes one txt2img request to sd-serve, sent by one of
    `concurrency` threads (each with its own connection), and is completed with LoadGen once its image is back and
    checked (shape, dtype) or its request failed (counted as an error, which makes the run fail)."""

    def __init__(self, url: str, protocol: str, prompts: list[str], request: dict, concurrency: int):
        self.url, self.protocol, self.prompts, self.request = url, protocol, prompts, request
        self.samples: queue.Queue = queue.Queue()
        self.tally = Tally()
        self.stopping = threading.Event()  # completes what is left unsent (Ctrl-C), so that LoadGen ends at once
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(concurrency)]

    def __enter__(self) -> SystemUnderTest:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        # Every sample is complete unless the run was interrupted: then those in flight are the server's to drain.
        self.stopping.set()
        for _ in self.threads:
            self.samples.put(None)
        deadline = time.monotonic() + 5
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def issue_queries(self, query_samples) -> None:  # LoadGen's thread: hand over, return at once
        with self.tally.lock:
            self.tally.issued += len(query_samples)
        for sample in query_samples:
            self.samples.put(sample)

    def flush_queries(self) -> None:
        pass

    def expected_shape(self) -> tuple | None:
        height, width = self.request.get("height"), self.request.get("width")
        return None if height is None or width is None else (height, width, 3)

    def _work(self) -> None:
        """One thread's samples until the end (None). Every sample is completed with LoadGen, whatever its request
        raised: a thread that died with one would leave LoadGen waiting for it for ever."""
        opened = False
        try:
            with connection(self.url, self.protocol) as (module, client):
                opened = True
                self._answer(lambda sample: self._send(module, client, sample))
        except Exception as exc:  # noqa: BLE001 -- no client for this thread: its samples fail, LoadGen still ends
            if opened:  # the samples were answered (or LoadGen itself failed): nothing left to complete
                raise
            reason = f"no client: {one_line(exc)}"
            self._answer(lambda _: reason)

    def _answer(self, send) -> None:
        import mlperf_loadgen

        while True:
            sample = self.samples.get()
            if sample is None:
                return
            try:
                error = "stopped before it was sent" if self.stopping.is_set() else send(sample)
            except Exception as exc:  # noqa: BLE001 -- not a ServeError (those are answers): still a failed sample
                error = one_line(exc)
            with self.tally.lock:
                if error:
                    self.tally.errors[error] += 1
                else:
                    self.tally.answered += 1
            mlperf_loadgen.QuerySamplesComplete([mlperf_loadgen.QuerySampleResponse(sample.id, 0, 0)])

    def _send(self, module, client, sample) -> str | None:
        """The request of one sample: its caption, its own fixed seed (the sample's index); None or why it failed."""
        values = {**{k: v for k, v in self.request.items() if v is not None},
                  "prompt": self.prompts[sample.index], "seed": sample.index}
        try:
            image, batch_size = generate(module, client, values)
        except ServeError as exc:
            return str(exc)
        expected = self.expected_shape()
        if image.dtype.name != "uint8" or image.ndim != 3 or image.shape[2] != 3 or (
                expected and image.shape != expected):
            wanted = list(expected or ["H", "W", 3])
            return f"an image of shape {list(image.shape)} {image.dtype.name}, not {wanted} uint8"
        with self.tally.lock:
            self.tally.batch_sizes[batch_size] += 1
        return None


def run_loadgen(sut: SystemUnderTest, settings_conf: Path, scenario: str, out_dir: Path, say=print) -> None:
    """LoadGen's test (PerformanceOnly) on `sut`, its logs into out_dir. LoadGen runs in a thread of its own so that
    this one answers Ctrl-C (which then completes what is left unsent); progress every 15 s."""
    import mlperf_loadgen as lg

    settings = lg.TestSettings()
    settings.scenario = getattr(lg.TestScenario, scenario)
    settings.mode = lg.TestMode.PerformanceOnly
    if settings.FromConfig(str(settings_conf), MLPERF_MODEL, scenario, 1) != 0:
        raise RunFailure(f"LoadGen could not read {settings_conf}")
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(out_dir)
    log_settings.log_output.copy_summary_to_stdout = False
    log_settings.enable_trace = False
    count = len(sut.prompts)
    handles = lg.ConstructSUT(sut.issue_queries, sut.flush_queries), lg.ConstructQSL(count, count, _noop, _noop)
    # Its end is an Event, not Thread.is_alive(): a join that a signal interrupts leaves Python 3.11's thread marked
    # as stopped while LoadGen runs on (and destroying LoadGen's SUT under it crashed the process).
    finished = threading.Event()
    test = threading.Thread(target=_in_thread_of_its_own(lg.StartTestWithLogSettings, finished),
                            args=(*handles, settings, log_settings), daemon=True)
    started = time.monotonic()
    try:
        test.start()
        while not finished.wait(timeout=15):
            tally = sut.tally
            say(f"[{PROG}] {scenario}: {tally.done} of {tally.issued} samples issued so far done, "
                f"{sum(tally.errors.values())} failed, {time.monotonic() - started:.0f} s")
    finally:
        if not finished.is_set():  # interrupted: the samples left complete unsent; Offline's LoadGen then ends
            sut.stopping.set()
            finished.wait(timeout=5)
        if finished.is_set():
            lg.DestroyQSL(handles[1])
            lg.DestroySUT(handles[0])
        else:  # the Server scenario's schedule runs on: LoadGen must not be destroyed under it
            _loadgen_left_running.set()


def _in_thread_of_its_own(function, finished: threading.Event):
    """`function` for a thread: SIGINT and SIGTERM blocked in it and in the threads it starts (LoadGen's), so that they
    reach the main thread, where Python handles them; `finished` set at its end."""
    def run(*args):
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
        try:
            function(*args)
        finally:
            finished.set()

    return run


def _noop(_indices) -> None:
    """LoadGen's load and unload of samples: a caption needs no loading."""


# Set where an interrupted LoadGen still runs at the end: the process then exits without the interpreter's teardown,
# which LoadGen's thread, calling back into it, would crash (a segfault was seen).
_loadgen_left_running = threading.Event()


def read_detail_log(path: Path) -> dict:
    """LoadGen's results from mlperf_log_detail.txt (one `:::MLLOG {json}` record a line): key -> value."""
    values = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(":::MLLOG "):
            try:
                record = json.loads(line[len(":::MLLOG "):])
            except json.JSONDecodeError:
                continue
            values[record.get("key")] = record.get("value")
    return values


def invalid_reasons(detail: dict) -> list[str]:
    """Why LoadGen says INVALID, in its words: the constraints it found unmet, its recommendation, early stopping."""
    reasons = [text for key, text in (("result_perf_constraints_met", "performance constraints (the latency bound) "
                                       "not met"),
                                      ("result_min_duration_met", "min duration not met"),
                                      ("result_min_queries_met", "min queries not met"),
                                      ("early_stopping_met", "early stopping not met")) if detail.get(key) is False]
    if (detail.get("result_invalid_reason") or "").strip():
        reasons.append(detail["result_invalid_reason"].strip())
    if detail.get("early_stopping_met") is False and detail.get("early_stopping_result"):
        reasons.append(" ".join(detail["early_stopping_result"].replace("*", "").split()))
    return reasons


def summarize(detail: dict, tally: Tally, scenario: str, request: dict, context: dict) -> dict:
    """The run as the JSON summary holds it."""
    per_s = detail.get("result_samples_per_second" if scenario == "Offline" else "result_completed_samples_per_sec")
    issued = (detail.get("generated_query_count") or 0) * (detail.get("generated_samples_per_query") or 0)
    latency = {f"p{name.split('.')[0]}": _ms(detail.get(f"result_{name}_percentile_latency_ns"))
               for name in PERCENTILES}
    latency.update(min=_ms(detail.get("result_min_latency_ns")), max=_ms(detail.get("result_max_latency_ns")),
                   mean=_ms(detail.get("result_mean_latency_ns")))
    errors = sum(tally.errors.values())
    loadgen_result = detail.get("result_validity", "no result")
    settings = {
        "target_qps": detail.get("effective_target_qps"),
        "min_duration_s": _s(detail.get("effective_min_duration_ms")),
        "min_query_count": detail.get("effective_min_query_count"),
        "min_sample_count": detail.get("effective_min_sample_count"),
        "samples_per_query": detail.get("effective_samples_per_query"),
        "performance_sample_count": detail.get("effective_performance_sample_count"),
        "seeds": {name: detail.get(f"effective_{name}") for name in ("qsl_rng_seed", "sample_index_rng_seed",
                                                                     "schedule_rng_seed")},
        **({"target_latency_ms": _ms(detail.get("effective_target_latency_ns")),
            "target_latency_percentile": detail.get("effective_target_latency_percentile")}
           if scenario == "Server" else {}),
        "request": request, "concurrency": context.pop("concurrency"),
        "max_batch_size": context.pop("max_batch_size"), "prompts": context.pop("prompts"),
    }
    official = context.pop("official")
    short_of = [name for name in ("min_duration_s", "min_query_count")
                if (settings["min_duration_s" if name == "min_duration_s" else "min_sample_count"] or 0)
                < official[name]]
    if scenario == "Server" and (settings["target_latency_ms"] is None
                                 or settings["target_latency_ms"] > official["target_latency_ms"]):
        short_of.append("target_latency_ms")  # a looser bound than MLPerf's: a VALID that an official run is not
    return {
        "scenario": scenario, "mode": "PerformanceOnly", "model": context.pop("model"),
        "valid": loadgen_result == "VALID" and errors == 0,
        "loadgen_result": loadgen_result, "invalid_reasons": invalid_reasons(detail) if loadgen_result != "VALID"
        else [],
        "samples_per_s": per_s,
        "scheduled_samples_per_s": detail.get("result_scheduled_samples_per_sec") if scenario == "Server" else None,
        "latency_ms": latency,
        "samples_issued": issued, "samples_answered": tally.answered, "samples_failed": errors,
        "error_messages": dict(tally.errors.most_common(10)),
        "batch_sizes": {str(size): count for size, count in sorted(tally.batch_sizes.items())},
        "overlatency_queries": detail.get("result_overlatency_query_count"),
        "settings": settings,
        "official": {**official, "met": not short_of,
                     "note": "an official MLPerf run needs MLPerf's minimums (" + ", ".join(
                         f"{name} {value:g}" for name, value in official.items() if name.startswith("min_")) + (
                         f"; target_latency_ms {official['target_latency_ms']:g} at most" if scenario == "Server"
                         else "") +
                     "), its 5000 COCO captions and its accuracy run (FID and CLIP); this one "
                     + ("meets those minimums" if not short_of else f"is short of {', '.join(short_of)}")},
        **context,
    }


def _ms(ns) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)


def _s(ms) -> float | None:
    return None if ms is None else ms / 1000


def table(report: dict) -> str:
    """The summary as markdown: the result, then the settings it ran with."""
    latency = report["latency_ms"]
    cell = lambda value: "—" if value is None else f"{value:.1f}"  # noqa: E731
    settings = report["settings"]
    verdict = "VALID" if report["valid"] else f"INVALID: {'; '.join(report['invalid_reasons']) or 'failed samples'}"
    bound = (f"{settings['target_latency_ms']:g} ms at p{settings['target_latency_percentile'] * 100:g}"
             if report["scenario"] == "Server" else "—")
    request = ", ".join(f"{name} {value}" for name, value in settings["request"].items() if value is not None)
    lines = [f"**sd-loadgen {report['scenario']}, {report['model']} on {report['gpu']}, backend {report['backend']}** "
             f"({report['date']})", "",
             "| scenario | samples/s | p50 ms | p90 ms | p99 ms | latency bound | samples | failed | result |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
             f"| {report['scenario']} | {report['samples_per_s']} | {cell(latency['p50'])} | {cell(latency['p90'])} "
             f"| {cell(latency['p99'])} | {bound} | {report['samples_issued']} | {report['samples_failed']} "
             f"| {verdict} |", "",
             f"- requests: {request or 'the server defaults'}; {settings['prompts']['count']} captions "
             f"({settings['prompts']['file']}), sample i seeded i",
             f"- LoadGen: target QPS {settings['target_qps']}, min duration {settings['min_duration_s']:g} s, min "
             f"samples {settings['min_sample_count']}, samples per query {settings['samples_per_query']}; "
             f"concurrency {settings['concurrency']} against --max-batch-size {settings['max_batch_size']}",
             f"- batch sizes seen (samples): "
             f"{', '.join(f'{size}: {count}' for size, count in report['batch_sizes'].items()) or '—'}",
             f"- {report['official']['note']}",
             f"- versions: {', '.join(f'{name} {value}' for name, value in report['versions'].items())}",
             f"- command: `{report['command']}`"]
    lines += [f"- failed: {count} x {message}" for message, count in report["error_messages"].items()]
    return "\n".join(lines)


def chart(report: dict) -> bytes:
    """LoadGen's latency percentiles against the Server scenario's bound."""
    from matplotlib.figure import Figure  # the bench extra's: without it, no chart (run says so)

    figure = Figure(figsize=(6, 3.5), dpi=110, layout="tight")
    axes = figure.subplots()
    names = [name for name in ("p50", "p90", "p99") if report["latency_ms"][name] is not None]
    axes.bar(names, [report["latency_ms"][name] / 1000 for name in names], color="#4c72b0")
    bound = report["settings"].get("target_latency_ms")
    if bound:
        axes.axhline(bound / 1000, color="red", linestyle="--", label=f"bound {bound / 1000:g} s")
        axes.legend(fontsize=8)
    axes.set_ylabel("latency (s)")
    axes.set_title(f"{report['model']}, {report['scenario']}: {report['samples_per_s']} samples/s, "
                   f"{'VALID' if report['valid'] else 'INVALID'} ({report['gpu']})", fontsize=9)
    return _png(figure)


@contextmanager
def started_server(serve_argv: list[str], http_port: int, drain_seconds: float, log_path: Path,
                   timeout_s: float, say=print) -> Iterator[None]:
    """sd-serve with these arguments, in a session of its own (a Ctrl-C at the terminal reaches this process only),
    until it answers ready; stopped on the way out however the block ends: SIGTERM (it drains), then SIGKILL to its
    session past its grace period."""
    root = str(Path(__file__).resolve().parent.parent)  # the checkout's, when not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-c", "import sys; from demo.cli.entry import sd_serve; sys.exit(sd_serve())",
               *serve_argv]
    say(f"[{PROG}] starting sd-serve {shlex.join(serve_argv)} (its log: {log_path})")
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env, preexec_fn=_stop_with_parent)
    try:
        wait_ready(process, http_port, log_path, timeout_s, say)
        yield
    finally:
        stop_server(process, drain_seconds, say)


def answers_ready(http_port: int) -> bool:
    """Whether a Triton server on this machine's port answers ready."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _stop_with_parent() -> None:
    """Linux, in the child: SIGTERM (a drain) when sd-loadgen dies however it ends, so that no server outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_ready(process: subprocess.Popen, http_port: int, log_path: Path, timeout_s: float, say=print) -> None:
    started = time.monotonic()
    next_note = started + 15
    while True:
        status = process.poll()
        if status is not None:
            last = (log_path.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
            reason = last.removeprefix("sd-serve: error: ")
            if status == 2:
                raise UsageError(f"sd-serve refused its flags: {reason}")
            raise RunFailure(f"sd-serve exited {status} before it was ready: {reason} (its log: {log_path})")
        if answers_ready(http_port):
            say(f"[{PROG}] sd-serve ready in {time.monotonic() - started:.0f} s")
            return
        now = time.monotonic()
        if now - started > timeout_s:
            raise RunFailure(f"sd-serve was not ready within --ready-timeout-s {timeout_s:g} (its log: {log_path})")
        if now >= next_note:
            say(f"[{PROG}] waiting for sd-serve to be ready ({now - started:.0f} s)")
            next_note = now + 15
        time.sleep(0.5)


def stop_server(process: subprocess.Popen, drain_seconds: float, say=print) -> None:
    if process.poll() is None:
        say(f"[{PROG}] stopping sd-serve")
        process.send_signal(signal.SIGTERM)  # the process itself, not its group: it drains and stops its helpers
        try:
            process.wait(drain_seconds + STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            say(f"[{PROG}] sd-serve did not stop within {drain_seconds + STOP_GRACE_S:g} s: killing it")
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever of its session is left
    except ProcessLookupError:
        pass
    process.wait()


def server_max_batch_size(url: str, protocol: str) -> int:
    """The txt2img model's max_batch_size, as Triton reports its config."""
    with connection(url, protocol) as (_, client):
        try:
            config = client.get_model_config(MODEL_NAMES[TEXT_TO_IMAGE])
        except Exception as exc:  # noqa: BLE001 -- tritonclient's errors: nothing there, or no such model
            raise RunFailure(f"--url {url}: no sd-serve txt2img model answers there "
                             f"({(str(exc).splitlines() or [type(exc).__name__])[0]})") from None
    return int(config["max_batch_size"] if isinstance(config, dict) else config.config.max_batch_size)


def gpu_name() -> str:
    """The GPU the server runs on (this machine's first: the server is on loopback), or the CPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def versions(tensorrt: bool) -> dict:
    from demo.runtime.report import library_versions

    found = {**library_versions(), "loadgen": importlib.metadata.version(LOADGEN_PACKAGE)}
    if tensorrt:
        for package in ("tensorrt", "tensorrt-rtx-cu13"):
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                pass
    return found


def is_sdxl(model: str | None) -> bool:
    if model is None:
        return False
    from models.families import SDXL
    from models.source import resolve_model

    return resolve_model(model).family is SDXL


def serve_plan(own: LoadgenFlags, serve_args: list[str], sdxl: bool):
    """sd-serve's flags for the server to start (sd-loadgen's --model, --height, --width and --scheduler among
    them), checked by sd-serve's parser and checks: (argv, its ServeFlags, spec)."""
    from demo.cli.serve import ServeFlags, serving_plan
    from demo.cli.serve import build_parser as serve_parser

    argv = list(serve_args)
    for name in ("model", "height", "width", "scheduler"):
        value = getattr(own, name)
        if name != "model" and value is None and sdxl:
            value = MLPERF_SDXL_REQUEST[name]
        if value is not None:
            argv += [f"--{name}", str(value)]
    flags = parse_flags(serve_parser(), argv)
    spec, _ = serving_plan(flags)
    return argv, flags[ServeFlags], spec


def run(own: LoadgenFlags, serve_args: list[str], argv: list[str]) -> int:
    check_flags(own)
    try:
        import mlperf_loadgen  # noqa: F401 -- here, before anything starts
    except ImportError:
        raise UsageError(f"needs MLPerf's LoadGen: pip install -e '.[serve]' ({LOADGEN_PACKAGE})") from None
    try:
        with connection("127.0.0.1:1", own.protocol):  # tritonclient there (a client connects only to send)
            pass
    except ServeError as exc:
        raise UsageError(str(exc)) from None
    if own.url and serve_args:
        raise UsageError(f"--url targets a running server: sd-serve's flags ({' '.join(serve_args)}) cannot reach "
                         "it; drop them or --url")
    prompts_file = Path(own.prompts) if own.prompts else CAPTIONS
    prompts = read_prompts(prompts_file)
    results = Path(own.results_dir)
    check_writable_directory("--results-dir", results)
    sdxl = is_sdxl(own.model)
    request = request_settings(own, sdxl)
    plan = None if own.url else serve_plan(own, serve_args, sdxl)
    model = own.model or (plan[2].model if plan else "served")
    gpu = gpu_name()
    stem = f"loadgen-{slug(own.scenario)}-{'cpu' if gpu == 'cpu' else slug(gpu)}-{slug(Path(model).name)}"
    run_dir = results / stem
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / USER_CONF).write_text(user_conf(own, len(prompts)))
    for stale in (SUMMARY_LOG, DETAIL_LOG):  # never a summary of an earlier run
        (run_dir / stale).unlink(missing_ok=True)
    if plan:
        serve_argv, serve_flags, spec = plan
        if answers_ready(serve_flags.http_port):  # it would be measured in place of the server started
            raise UsageError(f"--http-port {serve_flags.http_port}: a server answers there already; drive it with "
                             f"--url 127.0.0.1:{serve_flags.http_port} or give another --http-port")
        port = serve_flags.grpc_port if own.protocol == "grpc" else serve_flags.http_port
        url, max_batch = f"127.0.0.1:{port}", serve_flags.max_batch_size
        server = started_server(serve_argv, serve_flags.http_port, serve_flags.drain_seconds, run_dir / SERVER_LOG,
                                own.ready_timeout_s)
        tensorrt = spec.backend != "torch"
    else:
        url, server, max_batch, tensorrt = own.url, None, None, False
    with server or _nothing():
        max_batch = max_batch or server_max_batch_size(url, own.protocol)
        concurrency = own.concurrency or 2 * max_batch
        log(PROG, f"{own.scenario} on {url}: {len(prompts)} captions, {concurrency} requests in flight, "
                  f"{', '.join(f'{k} {v}' for k, v in request.items() if v is not None) or 'the server defaults'}")
        with SystemUnderTest(url, own.protocol, prompts, request, concurrency) as sut:
            run_loadgen(sut, run_dir / USER_CONF, own.scenario, run_dir)
    detail_path = run_dir / DETAIL_LOG
    if not detail_path.exists():
        raise RunFailure(f"LoadGen wrote no {DETAIL_LOG} into {run_dir}")
    context = {"gpu": gpu, "model": model, "backend": spec.backend if plan else "the running server's",
               "concurrency": concurrency, "max_batch_size": max_batch,
               "prompts": {"file": str(prompts_file), "count": len(prompts)},
               "official": official_minimums(own.scenario), "url": url, "versions": versions(tensorrt),
               "command": shlex.join([PROG, *argv]), "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "logs": {"summary": str(run_dir / SUMMARY_LOG), "detail": str(detail_path)}}
    report = summarize(read_detail_log(detail_path), sut.tally, own.scenario, request, context)
    saved = save_summary(results, stem, report)
    print(table(report))
    for path in saved:
        print(f"saved {path}")
    return 0 if report["samples_answered"] and not report["samples_failed"] else 1


def save_summary(results: Path, stem: str, report: dict) -> list[Path]:
    """The summary's JSON, markdown and (with matplotlib) chart, each written whole; without matplotlib an earlier
    run's chart of this name is removed, so that no chart of another run stands beside this summary."""
    files = {f"{stem}.json": json.dumps(report, indent=1).encode(), f"{stem}.md": (table(report) + "\n").encode()}
    try:
        files[f"{stem}.png"] = chart(report)
    except ImportError:
        print("note: no chart without matplotlib (pip install -e '.[bench]')", file=sys.stderr)
        (results / f"{stem}.png").unlink(missing_ok=True)
    for name, data in files.items():
        atomic_write_bytes(results / name, data)
    return [results / name for name in files]


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def body() -> int:
        flags, serve_args = parse_known_flags(build_parser(), argv)
        return run(flags[LoadgenFlags], serve_args, argv)

    status = run_command(PROG, body, SERVE_FLAG_NAMES)
    if _loadgen_left_running.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
