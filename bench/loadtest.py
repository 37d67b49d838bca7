"""Load-test sd-serve: requests from --concurrency clients at once until --requests are answered or --duration is up.

    python scripts/loadtest.py --concurrency 8 --requests 200 --denoising-steps 30
    python scripts/loadtest.py --url 127.0.0.1:8001 --protocol grpc --duration 120 --sizes 512x512,768x512

It talks to the one address given (default 127.0.0.1:8000) and to nothing else. Reports throughput, latency
percentiles (p50/p95/p99, from sending a request to its image), errors and the batch sizes the server ran them in;
writes <results-dir>/loadtest-<name>.json and, with matplotlib (the bench extra), loadtest-<name>.png; by default
into loadtest/ in the current directory, never into the curated results/ unless that is named.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.charts import _png
from core.atomic import write_new_set
from core.errors import RunFailure, UsageError, at_least
from demo.cli.client import ClientFlags
from demo.cli.command import run_command
from demo.cli.flags import Parser, RequestFlags, add_flags, flag, parse_flags, same_as
from demo.serve.client import ServeError, connect, connection, generate

PROG = "loadtest"
MAX_DURATION_S = 3600  # every run stops by itself


@dataclass(frozen=True)
class LoadFlags:
    concurrency: int = flag("requests in flight at once, each from its own client (default: %(default)s)", 4)
    requests: int = flag("stop after this many requests (default: %(default)s)", 32)
    duration: float = flag(f"stop sending after this many seconds, at most {MAX_DURATION_S} (default: %(default)s)",
                           600.0, metavar="S")
    sizes: str | None = flag("request sizes in turn, e.g. 512x512,768x512 (height x width; default: the server's)",
                             metavar="HxW,...")
    prompt: str = same_as(RequestFlags, "prompt")
    denoising_steps: int | None = same_as(RequestFlags, "denoising_steps")
    guidance_scale: float | None = same_as(RequestFlags, "guidance_scale")
    seed: int = flag("request i gets seed SEED + i (default: %(default)s)", 0)
    # Not results/: that is the curated archive, which a run adds to only when asked to.
    results_dir: str = flag("where the JSON and the chart go (default: %(default)s, in the current directory)",
                            "loadtest")
    name: str | None = flag("the files' name: loadtest-NAME.json, .png (default: the date and time)", metavar="NAME")


def parse_sizes(text: str | None) -> list[tuple[int, int] | None]:
    """--sizes as (height, width) pairs ([None]: the server's size); a UsageError where one is not HxW."""
    if text is None:
        return [None]
    try:
        sizes = [tuple(int(part) for part in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(size) != 2 for size in sizes):
        raise UsageError(f"--sizes takes height x width pairs like 512x512,768x512; got '{text}'")
    return sizes


@dataclass(frozen=True)
class Sample:
    """One request: when it was sent (s from the start), how long until its image (ms), its size, and the batch its
    pipeline call ran (0: it failed, `error` says why)."""

    sent_s: float
    latency_ms: float
    size: str
    batch_size: int
    error: str | None = None


def percentile(values: list[float], share: float) -> float | None:
    """The `share` (0..1) percentile, nearest rank (None: no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def run_load(flags: LoadFlags, client_flags: ClientFlags, say=print) -> list[Sample]:
    """Send the requests from flags.concurrency threads, each with its own connection; the samples, in order sent."""
    sizes = parse_sizes(flags.sizes)
    connect(client_flags.url, client_flags.protocol)[1].close()  # tritonclient missing: ServeError here, not per thread
    samples: list[Sample] = []
    lock = threading.Lock()
    sent = iter(range(flags.requests))
    start = time.monotonic()
    deadline = start + min(flags.duration, MAX_DURATION_S)

    def worker() -> None:
        with connection(client_flags.url, client_flags.protocol) as (module, client):
            while time.monotonic() < deadline:
                with lock:
                    index = next(sent, None)
                if index is None:
                    return
                size = sizes[index % len(sizes)]
                values = {"prompt": flags.prompt, "seed": flags.seed + index, "denoising_steps": flags.denoising_steps,
                          "guidance_scale": flags.guidance_scale}
                if size is not None:
                    values["height"], values["width"] = size
                sent_at = time.monotonic()
                try:
                    image, batch_size = generate(module, client, values)
                    error, label = None, f"{image.shape[0]}x{image.shape[1]}"
                except ServeError as exc:
                    batch_size, error, label = 0, str(exc), "x".join(map(str, size)) if size else "default"
                sample = Sample(sent_at - start, (time.monotonic() - sent_at) * 1000, label, batch_size, error)
                with lock:
                    samples.append(sample)
                    if len(samples) % max(1, flags.requests // 10) == 0:
                        say(f"[{PROG}] {len(samples)} of {flags.requests} done, "
                            f"{sum(s.error is not None for s in samples)} errors")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(flags.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(samples, key=lambda sample: sample.sent_s)


def summarize(samples: list[Sample], flags: LoadFlags, client_flags: ClientFlags, seconds: float) -> dict:
    """The run as the JSON report holds it."""
    answered = [s for s in samples if s.error is None]
    latencies = [s.latency_ms for s in answered]
    return {
        "url": client_flags.url, "protocol": client_flags.protocol, "date": datetime.datetime.now().isoformat(),
        "concurrency": flags.concurrency, "steps": flags.denoising_steps,
        "guidance_scale": flags.guidance_scale,  # None: not sent, so the served model's own
        "sizes": sorted({s.size for s in samples}), "requests": len(samples), "answered": len(answered),
        "errors": len(samples) - len(answered),
        "error_messages": dict(Counter(s.error for s in samples if s.error is not None).most_common(10)),
        "seconds": round(seconds, 3), "images_per_s": round(len(answered) / seconds, 4) if seconds else None,
        "latency_ms": {name: percentile(latencies, share) for name, share in (("p50", 0.5), ("p95", 0.95),
                                                                               ("p99", 0.99))},
        "batch_sizes": {str(size): count for size, count in sorted(Counter(s.batch_size for s in answered).items())},
        "samples": [asdict(s) for s in samples],
    }


def table(report: dict) -> str:
    latency = report["latency_ms"]
    cells = ", ".join(f"{name} {'-' if value is None else f'{value:.1f}'}" for name, value in latency.items())
    batches = ", ".join(f"{size}: {count}" for size, count in report["batch_sizes"].items()) or "-"
    lines = [f"{report['answered']}/{report['requests']} answered in {report['seconds']:.1f} s "
             f"({report['images_per_s']} images/s) at concurrency {report['concurrency']}, sizes "
             f"{', '.join(report['sizes'])}",
             f"latency ms: {cells}", f"batch sizes seen (requests): {batches}", f"errors: {report['errors']}"]
    lines += [f"  {count} x {message}" for message, count in report["error_messages"].items()]
    return "\n".join(lines)


def chart(report: dict) -> bytes:
    """Latency of each request over the run, and how many requests ran at each batch size."""
    from matplotlib.figure import Figure  # the bench extra's: without it, no chart (run says so)

    figure = Figure(figsize=(10, 4), dpi=110, layout="tight")
    over_time, batches = figure.subplots(1, 2, width_ratios=(3, 1))
    for size in report["sizes"]:
        points = [s for s in report["samples"] if s["size"] == size and s["error"] is None]
        over_time.scatter([s["sent_s"] for s in points], [s["latency_ms"] for s in points], s=8, label=size)
    failed = [s for s in report["samples"] if s["error"] is not None]
    if failed:
        over_time.scatter([s["sent_s"] for s in failed], [s["latency_ms"] for s in failed], s=12, marker="x",
                          color="red", label="error")
    over_time.set_xlabel("sent at (s)")
    over_time.set_ylabel("latency (ms)")
    over_time.set_title(f"{report['url']}: concurrency {report['concurrency']}, {report['steps']} steps, "
                        f"{report['images_per_s']} images/s", fontsize=9)
    over_time.legend(fontsize=8)
    batches.bar(list(report["batch_sizes"]), list(report["batch_sizes"].values()), color="#4c72b0")
    batches.set_xlabel("batch size")
    batches.set_ylabel("requests")
    return _png(figure)


def run(flags) -> int:
    load, client_flags = flags[LoadFlags], flags[ClientFlags]
    at_least("concurrency", load.concurrency, 1)
    at_least("requests", load.requests, 1)
    at_least("duration", load.duration, 0.001)
    parse_sizes(load.sizes)
    name = load.name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    started = time.monotonic()
    try:
        samples = run_load(load, client_flags)
    except ServeError as exc:  # tritonclient missing
        raise RunFailure(str(exc)) from None
    report = summarize(samples, load, client_flags, time.monotonic() - started)
    files = {f"loadtest-{name}.json": json.dumps(report, indent=1).encode()}
    try:
        files[f"loadtest-{name}.png"] = chart(report)
    except ImportError:
        print("note: no chart without matplotlib (pip install -e '.[bench]')", file=sys.stderr)
    if not write_new_set(Path(load.results_dir), files):
        raise RunFailure(f"{', '.join(files)} exist already in {load.results_dir}: give another --name")
    print(table(report))
    for file in files:
        print(f"saved {Path(load.results_dir) / file}")
    return 0 if report["answered"] else 1  # nothing answered: the server is down or refused them all


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        parser = Parser(prog=PROG, description="Load-test sd-serve's txt2img model at one address.")
        add_flags(parser, ClientFlags)
        add_flags(parser, LoadFlags)
        return run(parse_flags(parser, argv))

    return run_command(PROG, body)
