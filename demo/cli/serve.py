"""sd-serve: Stable Diffusion behind Triton Inference Server (demo.serve.server): models txt2img, img2img and inpaint
(those the model can run), one pipeline per GPU, each in a process of its own, requests batched dynamically.

    sd-serve --model tiny                                  # the CPU where there is no GPU; 127.0.0.1:8000
    sd-serve --model sd1.5-arch --gpus 0,1 --max-batch-size 4
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import NoReturn

from demo.cli.command import flag_name, run_command
from demo.cli.flags import (
    ControlNetFlags,
    DemoFlags,
    LoraFlags,
    ModelFlags,
    Parser,
    PrecisionFlags,
    RequestFlags,
    add_flags,
    add_pipeline_flags,
    flag,
    parse_flags,
    same_as,
)
from demo.cli.to_spec import spec_from_flags
from demo.runtime.spec import PipelineSpec
from demo.serve.options import ServeOptions, check_servable

PROG = "sd-serve"
# The spec's batch_size is the engines' optimum here (--opt-batch-size).
FLAG_NAMES = {"batch_size": "--opt-batch-size"}


@dataclass(frozen=True)
class ServeFlags:
    backend: str = same_as(DemoFlags, "backend")
    gpus: str | None = flag("GPUs to serve on, one pipeline each, e.g. 0,1 (default: every GPU; the CPU where there "
                            "is none)", metavar="IDS")
    height: int | None = same_as(RequestFlags, "height")
    width: int | None = same_as(RequestFlags, "width")
    scheduler: str | None = same_as(RequestFlags, "scheduler")
    host: str = flag("address the endpoints listen on (default: %(default)s, this machine only)", "127.0.0.1")
    http_port: int = flag("Triton's HTTP port (default: %(default)s)", 8000)
    grpc_port: int = flag("Triton's gRPC port (default: %(default)s)", 8001)
    metrics_port: int = flag("Triton's Prometheus metrics port (default: %(default)s)", 8002)
    max_batch_size: int = flag("most requests one pipeline call runs (default: %(default)s)", 8)
    # 1: on engines tuned for 4, a call of one request ran 4% slower than the CLI's on batch-1 engines (two H100s,
    # 2026-11-26), and the CLI's engines (tuned for 1, taking up to 4) then serve --max-batch-size 4 as they are.
    opt_batch_size: int = flag("the batch size engines are tuned for (TensorRT's profile optimum), 1 to "
                               "--max-batch-size (default: %(default)s: calls of one request run as on the CLI's "
                               "engines; a larger one favours full batches)", 1)
    max_queue_delay_ms: float = flag("how long a request may wait for others to batch with when a pipeline is idle "
                                     "(default: %(default)s)", 0.0)
    drain_seconds: float = flag("on SIGTERM or SIGINT, how long the requests in flight may run on before they fail "
                                "(default: %(default)s; the process then exits within about 10 s more)", 10.0)


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="Serve Stable Diffusion through Triton Inference Server: models txt2img, img2img "
                                      "and inpaint (an inpainting model: inpaint only), one set of stages per GPU, "
                                      "dynamic batching. --height, --width and --scheduler are what text-to-image "
                                      "requests that leave them out get; engines are built for that size.")
    add_flags(p, ModelFlags)
    add_flags(p, PrecisionFlags)
    add_flags(p, ServeFlags, "serving")
    add_flags(p, LoraFlags, "LoRA")
    add_flags(p, ControlNetFlags, "ControlNet", description="each request then brings control_image_<i>, one per "
              "ControlNet in this order (docs/serving.md)")
    add_pipeline_flags(p)
    return p


def serving_plan(flags) -> tuple[PipelineSpec, ServeOptions]:
    """What sd-serve's flags ask it to serve and how, checked (a UsageError where they cannot be served), before
    anything loads."""
    serve_flags = flags[ServeFlags]
    spec = spec_from_flags(flags, backend=serve_flags.backend, height=serve_flags.height, width=serve_flags.width,
                           scheduler=serve_flags.scheduler, batch_size=serve_flags.opt_batch_size,
                           max_batch_size=serve_flags.max_batch_size, guided=True)
    options = ServeOptions(gpus=serve_flags.gpus, host=serve_flags.host, http_port=serve_flags.http_port,
                           grpc_port=serve_flags.grpc_port, metrics_port=serve_flags.metrics_port,
                           max_queue_delay_ms=serve_flags.max_queue_delay_ms,
                           drain_seconds=serve_flags.drain_seconds, verbose=spec.verbose)
    spec.check()
    check_servable(spec, options)
    return spec, options


def run(flags) -> NoReturn:
    spec, options = serving_plan(flags)
    # The server loads torch and PyTriton (seconds): the usage errors above answer without them.
    from demo.serve.server import serve

    status = serve(spec, options, name=lambda field: flag_name(field, FLAG_NAMES))
    # Stopped: Triton, its workspace and the pipelines' processes are gone, and the stop's duration is printed. The
    # interpreter's own teardown (torch, PyTriton) took 4.4 s more on the 2-core CPU machine: exit now instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)), FLAG_NAMES)
