"""sd-serve's server: the text-to-image, image-to-image and inpainting pipelines of one PipelineSpec behind Triton
Inference Server (PyTriton), models txt2img, img2img and inpaint (those the model can run), one loaded pipeline per
device, each in a process of its own (workers.py), requests batched dynamically. The command is demo.cli.serve.

Everything is prepared (engines built or loaded, LoRAs fused, graphs captured and compiled at every batch size) before
Triton starts, so /v2/health/ready answers only then. SIGTERM or SIGINT: new requests are refused, those in flight
finish, the process exits 143 / 130 within 30 s. Needs the `serve` extra (docs/serving.md).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from core.errors import RunFailure, UsageError, at_least, field
from demo.request import INPAINTING, TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline, plan_pipeline, to_stderr
from demo.runtime.spec import PipelineSpec
from demo.serve.batching import ServedPipeline, run_requests
from demo.serve.schema import BATCH_SIZE, ERROR, IMAGE, MODEL_NAMES, RequestRejected, inputs_of, parse_request
from demo.serve.workers import SERVER_SWITCH_INTERVAL_S, WorkerPool, start_workers

PROG = "sd-serve"
# Triton waits this long for requests in flight at a stop, so that with its own exit the process is gone in 30 s.
DRAIN_SECONDS = 20


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
    verbose: bool = False


def serving_devices(text: str | None) -> list[torch.device]:
    """The devices `gpus` names (default: every GPU, else the CPU)."""
    count = torch.cuda.device_count()
    if text is None:
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"{field('gpus')} takes GPU numbers like 0,1; got '{text}'") from None
    if count == 0:
        raise UsageError(f"{field('gpus')}: there is no CUDA GPU here; leave {field('gpus')} out to serve on the CPU")
    bad = [i for i in ids if not 0 <= i < count]
    if bad or len(set(ids)) != len(ids):
        raise UsageError(f"{field('gpus')} {text}: this machine has GPUs 0..{count - 1}, each named once")
    return [torch.device("cuda", i) for i in ids]


def check_servable(spec: PipelineSpec, options: ServeOptions) -> None:
    """A UsageError for what a server cannot serve: requests are batched dynamically, so engines need a batch range."""
    at_least("max_batch_size", spec.max_batch_size, 1)
    at_least("batch_size", spec.batch_size, 1)
    if spec.batch_size > spec.max_batch_size:
        raise UsageError(f"{field('batch_size')} must be at most {field('max_batch_size')} ({spec.max_batch_size}), "
                         f"got {spec.batch_size}")
    at_least("max_queue_delay_ms", options.max_queue_delay_ms, 0)
    if spec.engine.build_static_batch or spec.use_cuda_graph:
        raise UsageError(f"sd-serve batches requests dynamically: engines need a batch range; drop "
                         f"{field('build_static_batch')} and {field('use_cuda_graph')}")


def check_ports_free(options: ServeOptions) -> None:
    """A UsageError now for an address or port Triton could not listen on, rather than its timeout later."""
    ports = {field(name): getattr(options, name) for name in ("http_port", "grpc_port", "metrics_port")}
    if len(set(ports.values())) != len(ports):
        raise UsageError(f"the ports must differ, got {', '.join(f'{k} {v}' for k, v in ports.items())}")
    for option, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in options.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Triton binds
            try:
                probe.bind((options.host, port))
            except OSError as exc:
                raise UsageError(f"{option} {port} on {options.host}: cannot listen ({exc.strerror or exc})") from None



def import_pytriton():
    """pytriton.triton (Triton, TritonConfig), or a UsageError saying how to install it."""
    try:
        import pytriton.triton
    except ImportError:
        raise UsageError("needs PyTriton: pip install -e '.[serve]' (docs/serving.md)") from None
    return pytriton.triton


def check_python_backend(python: str = sys.executable) -> None:
    """Triton's Python-backend stub embeds this interpreter isolated from PYTHONPATH (as `python -I` runs), and
    PyTriton's proxy inside it imports numpy and zmq: where those are on PYTHONPATH only (`pip install --target`),
    every model fails to load once Triton starts. A UsageError before the pipelines load."""
    probe = subprocess.run([python, "-I", "-c", "import numpy, zmq"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise UsageError(f"Triton's Python backend runs {python} without PYTHONPATH, and there it cannot import numpy "
                         f"and zmq (PyTriton's proxy needs them): install PyTriton's dependencies into {sys.prefix} "
                         "itself (docs/serving.md)")



def progress(message: str) -> None:
    to_stderr(message)


def prepare_device(spec: PipelineSpec, device: torch.device) -> ServedPipeline:
    """The device's served pipeline, loaded for `spec` (a pipeline for each of its modes over one set of stages):
    stages built or loaded, LoRAs fused, and warm-up calls (CUDA graphs captured, torch.compile compiled, engine
    buffers sized): text-to-image at every batch size up to the spec's max_batch_size, each image mode at 1 (its
    requests run alone). Runs in the device's own process (workers.py)."""
    pipeline = load_pipeline(spec, device, progress=progress)
    served = ServedPipeline(pipeline)
    warm = pipeline.plan.resolve(Request("", denoising_steps=1, seed=0))
    batch = spec.max_batch_size
    if TEXT_TO_IMAGE in pipeline.plan.modes:
        for size in range(1, batch + 1):
            progress(f"[{PROG}] {device}: text-to-image warm-up at batch {size}/{batch} ...")
            served([warm] * size)
    gray = Image.new("RGB", (warm.width, warm.height), (128, 128, 128))
    half = Image.new("L", gray.size)  # repaint the left half
    half.paste(255, (0, 0, warm.width // 2, warm.height))
    for mode in (mode for mode in pipeline.plan.modes if mode != TEXT_TO_IMAGE):
        progress(f"[{PROG}] {device}: {mode} warm-up ...")
        mask = half if mode == INPAINTING else None
        served([replace(warm, image=gray, mask=mask, strength=1.0)])  # its one step runs
    return served


def serve(spec: PipelineSpec, options: ServeOptions, name: Callable[[str], str] = str) -> int:
    """Serve `spec` until SIGTERM or SIGINT; returns the exit status (128 + the signal). `name` names fields in
    notes (a command's flags)."""
    if not options.verbose:  # PyTriton logs each failed batch's traceback; the request's log line says why it failed
        logging.getLogger("pytriton").setLevel(logging.ERROR)
    check_servable(spec, options)
    check_ports_free(options)
    devices = serving_devices(options.gpus)
    plan = plan_pipeline(spec, devices[0], progress=progress)  # what checks requests here; nothing loads here
    unused = plan.unused + (["batch_size"] if not plan.backend.capabilities.artifacts
                            and spec.batch_size != PipelineSpec.batch_size else [])  # the engines' optimum
    if unused:
        progress(f"note: {', '.join(map(name, unused))} unused by the {plan.backend.name} backend")
    triton_api = import_pytriton()
    check_python_backend()
    progress(f"[{PROG}] model {plan.source.name}, backend {plan.backend.name} ({plan.backend_reason}), on "
             f"{', '.join(map(str, devices))}")
    spec = plan.spec
    workers = start_workers(devices, lambda device: functools.partial(prepare_device, spec, device), options.verbose)
    progress(f"[{PROG}] prepared: {', '.join(f'{worker.device} in process {worker.pid}' for worker in workers)}")
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)  # this process's threads now mostly hand batches on
    try:
        return serve_forever(triton_api, Server(WorkerPool(workers), plan, options.verbose), plan.modes,
                             spec.max_batch_size, options)
    finally:
        for worker in workers:
            worker.close()


class Server:
    """What Triton calls: an inference callable per model, which its instances (one per device) share, each
    answering a batch of requests on a device's pipeline lent by the pool."""

    def __init__(self, pool, plan, verbose: bool):
        self.pool, self.plan, self.verbose = pool, plan, verbose
        self._ids = itertools.count(1)
        self._batches = itertools.count(1)
        self._lock = threading.Lock()  # the counters, shared by the instances' threads

    def callable_for(self, mode: str):
        return lambda requests: self.answer(mode, requests)

    def answer(self, mode: str, requests) -> list[dict]:
        """Triton's batch of requests, answered: raises only where all of them failed (Triton then fails each one
        with the message); otherwise a failed request's `error` output says why (PyTriton fails a batch only whole)."""
        parsed = []
        for request in requests:
            try:
                parsed.append(parse_request(request.data, self.plan, mode))
            except RequestRejected as exc:
                parsed.append(exc)
        with self.pool.lend() as served:
            outcomes = run_requests(parsed, served, on_failure=self._failed)
        calls = sorted({outcome.call for outcome in outcomes if outcome.call is not None})
        with self._lock:
            ids = [next(self._ids) for _ in outcomes]
            batch_ids = {call: next(self._batches) for call in calls}
        for request_id, outcome in zip(ids, outcomes):
            self._log(request_id, outcome, batch_ids.get(outcome.call), served.device)
        if all(outcome.error for outcome in outcomes):
            raise RequestFailed("; ".join(dict.fromkeys(outcome.error for outcome in outcomes)))
        no_image = np.zeros((1, 0, 0, 3), np.uint8)
        return [{IMAGE: no_image if outcome.image is None else outcome.image[None],
                 BATCH_SIZE: np.array([[outcome.batch_size]], np.int32),
                 ERROR: np.array([[(outcome.error or "").encode()]], np.bytes_)} for outcome in outcomes]

    def _failed(self, exc: BaseException) -> None:
        if self.verbose:
            traceback.print_exception(exc, file=sys.stderr)

    def _log(self, request_id: int, outcome, batch_id: int | None, device) -> None:
        """One line per request: its id, shape, the batch it ran in (the server's count of pipeline calls), the
        call's ms and the pipeline's own (the rest: the hand-off to the device's process and back)."""
        request = outcome.request
        what = "" if request is None else (f" {request.height}x{request.width} steps {request.denoising_steps} "
                                           f"seed {request.seed}")
        if outcome.error is not None:
            line = f"request {request_id}{what} failed: {outcome.error}"
        else:
            line = (f"request {request_id}{what}: batch {batch_id} of {outcome.batch_size} on {device}, "
                    f"{outcome.milliseconds:.1f} ms (pipeline {outcome.pipeline_milliseconds:.1f} ms)")
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)


class RequestFailed(Exception):
    """Every request of a Triton batch failed; the message says why (Triton returns it as each one's error)."""



def put_triton_libraries_first() -> None:
    """LD_LIBRARY_PATH, for the Triton processes this one starts, led by where they must find their libraries: the
    libpython this interpreter runs on (Triton's Python-backend stub would load the system's), then PyTriton's bundled
    ones (libcudart among them). PyTriton looks for those beside site-packages only: installed anywhere else (`pip
    install --target`, PYTHONPATH) it takes itself for an editable install, and tritonserver
    cannot start."""
    import pytriton

    bundled = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    libraries = [sysconfig.get_config_var("LIBDIR"), str(bundled) if bundled.is_dir() else None,
                 os.environ.get("LD_LIBRARY_PATH")]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libraries))



def bind_model(triton, mode: str, infer_funcs: list, max_batch_size: int, max_queue_delay_ms: float) -> str:
    """`mode`'s model bound on `triton` (its inputs schema.inputs_of's; its outputs the image, the batch size and the
    error), a Triton instance per inference function, batched dynamically; returns the model's name."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    triton.bind(
        model_name=MODEL_NAMES[mode],
        infer_func=infer_funcs,
        inputs=[Tensor(name=item.name, dtype=item.dtype, shape=item.shape, optional=item.optional)
                for item in inputs_of(mode)],
        outputs=[Tensor(name=IMAGE, dtype=np.uint8, shape=(-1, -1, 3)),
                 Tensor(name=BATCH_SIZE, dtype=np.int32, shape=(1,)),
                 Tensor(name=ERROR, dtype=np.bytes_, shape=(1,))],
        config=ModelConfig(max_batch_size=max_batch_size, batcher=DynamicBatcher(
            max_queue_delay_microseconds=int(max_queue_delay_ms * 1000))),
    )
    return MODEL_NAMES[mode]



def serve_forever(triton_api, server: Server, modes, max_batch_size: int, serve: ServeOptions) -> int:
    """Start Triton with a model for each of `modes` bound to the pipelines, then wait for SIGTERM or SIGINT (handled
    here: a process started in the background ignores SIGINT) or for Triton to die; stop it, draining the requests in
    flight, and return the exit status (128 + the signal)."""
    put_triton_libraries_first()
    received: list[int] = []
    stop = threading.Event()

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    config = triton_api.TritonConfig(http_address=serve.host, grpc_address=serve.host, metrics_address=serve.host,
                                   http_port=serve.http_port, grpc_port=serve.grpc_port,
                                   metrics_port=serve.metrics_port, exit_timeout_secs=DRAIN_SECONDS)
    # The model written into a local model store before Triton starts, which loads it then: /v2/health/ready answers
    # only once the model is there (by default PyTriton loads it into a running server, ready before it is).
    triton = triton_api.Triton(config=config, triton_lifecycle_policy=triton_api.TritonLifecyclePolicy(
        launch_triton_on_startup=False, local_model_store=True))
    try:
        names = [bind_model(triton, mode, [server.callable_for(mode) for _ in server.pool.workers],  # one per device
                            max_batch_size, serve.max_queue_delay_ms) for mode in modes]
        try:
            triton.run()
        except Exception as exc:  # noqa: BLE001 -- PyTriton's start-up failures (a timeout, a dead server) as one line
            raise RunFailure(f"Triton did not start: {exc}") from None
        progress(f"[{PROG}] ready: models {', '.join(names)} on http://{serve.host}:{serve.http_port}, gRPC "
                 f"{serve.host}:{serve.grpc_port}, metrics http://{serve.host}:{serve.metrics_port}/metrics")
        while not stop.wait(1.0):
            if not triton.is_alive():
                raise RunFailure("Triton stopped by itself (run with --verbose for the reason)")
            for worker in server.pool.workers:
                if not worker.alive():
                    raise RunFailure(f"the pipeline process for {worker.device} exited")
        progress(f"[{PROG}] {signal.Signals(received[0]).name}: refusing new requests, finishing those in flight")
        started = time.monotonic()
    finally:
        triton.stop()  # waits for the requests in flight; removes PyTriton's workspace
    progress(f"[{PROG}] stopped in {time.monotonic() - started:.1f} s")
    return 128 + received[0]
