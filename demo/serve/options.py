"""How sd-serve listens, batches and stops (ServeOptions), and its checks of them and of the spec it serves: light to
import, so that the command answers its usage errors before torch and PyTriton load (demo.serve.server serves)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import UsageError, at_least, field
from demo.backends import TORCH
from demo.runtime.spec import PipelineSpec

PORTS = ("http_port", "grpc_port", "metrics_port")
MAX_QUEUE_DELAY_MS = 60_000  # Triton's queue delay is an integer of microseconds; beyond a minute it only hurts


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens and batches (the spec says what it serves)."""

    gpus: str | None = None  # e.g. "0,1" (None: every GPU; the CPU where there is none)
    host: str = "127.0.0.1"  # this machine only
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    # 0: a pipeline call takes hundreds of ms, so under load requests queue (and batch) while the pipelines run;
    # a delay would add only latency, to a request that finds a pipeline idle (H100, 2026-11-26).
    max_queue_delay_ms: float = 0.0
    # SIGTERM or SIGINT: how long the requests in flight may run on before they fail (503). With it, stopping takes
    # at most the unloading and Triton's exit more (about 10 s): 10 keeps a stop within a 30 s grace period.
    drain_seconds: float = 10.0
    verbose: bool = False


def check_servable(spec: PipelineSpec, options: ServeOptions) -> None:
    """A UsageError for what a server cannot serve: requests are batched dynamically, so engines need a batch range."""
    at_least("max_batch_size", spec.max_batch_size, 1)
    at_least("batch_size", spec.batch_size, 1)
    if spec.batch_size > spec.max_batch_size:
        raise UsageError(f"{field('batch_size')} must be at most {field('max_batch_size')} ({spec.max_batch_size}), "
                         f"got {spec.batch_size}")
    check_options(options)
    if spec.engine.build_static_batch:
        raise UsageError(f"sd-serve batches requests dynamically: engines need a batch range; drop "
                         f"{field('build_static_batch')}")
    if spec.use_cuda_graph and spec.backend != TORCH:  # an engine's graph replays one batch size (a static batch)
        raise UsageError(f"sd-serve replays CUDA graphs on the torch backend only (a graph per batch size; engines "
                         f"need a batch range): give {field('backend')} {TORCH} or drop {field('use_cuda_graph')}")


def check_options(options: ServeOptions) -> None:
    """A UsageError for a port or time the server cannot use, before anything loads (not a traceback once Triton
    starts, or a port 0 that Triton never answers on)."""
    for name in PORTS:
        port = getattr(options, name)
        if not 1 <= port <= 65535:
            raise UsageError(f"{field(name)} must be 1..65535, got {port}")
    ports = {name: getattr(options, name) for name in PORTS}
    if len(set(ports.values())) != len(ports):
        raise UsageError(f"the ports must differ, got {', '.join(f'{field(k)} {v}' for k, v in ports.items())}")
    delay = options.max_queue_delay_ms
    if not (math.isfinite(delay) and 0 <= delay <= MAX_QUEUE_DELAY_MS):
        raise UsageError(f"{field('max_queue_delay_ms')} must be a finite number from 0 to {MAX_QUEUE_DELAY_MS}, "
                         f"got {delay}")
    if not (math.isfinite(options.drain_seconds) and options.drain_seconds >= 0):
        raise UsageError(f"{field('drain_seconds')} must be a finite number, 0 or more, got {options.drain_seconds}")
