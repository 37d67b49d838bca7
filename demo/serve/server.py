"""sd-serve: the text-to-image, image-to-image and inpainting pipelines behind Triton Inference Server (PyTriton),
models txt2img, img2img and inpaint (those the model can run), one set of stages per GPU, each in a process of its own
(workers.py), requests batched dynamically.

    sd-serve --model tiny                                  # the CPU where there is no GPU; 127.0.0.1:8000
    sd-serve --model sd1.5-arch --gpus 0,1 --max-batch-size 4

Everything is prepared (engines built or loaded, LoRAs fused, graphs captured and compiled at every batch size) before
Triton starts, so /v2/health/ready answers only then. SIGTERM or SIGINT: new requests are refused, those in flight
finish, the process exits 143 / 130 within 30 s. Needs the `serve` extra (docs/serving.md).
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass, replace
from pathlib import Path

from demo.cli.generate import DemoFlags, LoraFlags, read_loras
from demo.settings import EngineFlags, ModelFlags, RequestFlags, TorchFlags, at_least, changed, flag, same_as

PROG = "sd-serve"
# Triton waits this long for requests in flight at a stop, so that with its own exit the process is gone in 30 s.
DRAIN_SECONDS = 20


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
    # 0: a pipeline call takes hundreds of ms, so under load requests queue (and batch) while the pipelines run;
    # a delay would add only latency, to a request that finds a pipeline idle (H100, 2026-11-26).
    max_queue_delay_ms: float = flag("how long a request may wait for others to batch with when a pipeline is idle "
                                     "(default: %(default)s)", 0.0)


def build_parser():
    from demo.arguments import Parser
    from demo.settings import add_flags

    p = Parser(prog=PROG, description="Serve Stable Diffusion through Triton Inference Server: models txt2img, img2img "
                                      "and inpaint (an inpainting model: inpaint only), one set of stages per GPU, "
                                      "dynamic batching. --height, --width and --scheduler are what text-to-image "
                                      "requests that leave them out get; engines are built for that size.")
    add_flags(p, ModelFlags)
    add_flags(p, ServeFlags, "serving")
    add_flags(p, LoraFlags, "LoRA")
    add_flags(p, EngineFlags, "ONNX and TensorRT engines")
    add_flags(p, TorchFlags, "PyTorch backend")
    return p


def serving_devices(text: str | None) -> list:
    """The devices --gpus names (default: every GPU, else the CPU)."""
    import torch

    from core.errors import UsageError

    count = torch.cuda.device_count()
    if text is None:
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--gpus takes GPU numbers like 0,1; got '{text}'") from None
    if count == 0:
        raise UsageError("--gpus: there is no CUDA GPU here; leave --gpus out to serve on the CPU")
    bad = [i for i in ids if not 0 <= i < count]
    if bad or len(set(ids)) != len(ids):
        raise UsageError(f"--gpus {text}: this machine has GPUs 0..{count - 1}, each named once")
    return [torch.device("cuda", i) for i in ids]


def check_ports_free(flags: ServeFlags) -> None:
    """A UsageError now for an address or port Triton could not listen on, rather than its timeout later."""
    from core.errors import UsageError

    ports = {"--http-port": flags.http_port, "--grpc-port": flags.grpc_port, "--metrics-port": flags.metrics_port}
    if len(set(ports.values())) != len(ports):
        raise UsageError(f"the ports must differ, got {', '.join(f'{k} {v}' for k, v in ports.items())}")
    for option, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in flags.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Triton binds
            try:
                probe.bind((flags.host, port))
            except OSError as exc:
                raise UsageError(f"{option} {port} on {flags.host}: cannot listen ({exc.strerror or exc})") from None


def import_pytriton():
    """pytriton.triton (Triton, TritonConfig), or a UsageError saying how to install it."""
    from core.errors import UsageError

    try:
        import pytriton.triton
    except ImportError:
        raise UsageError("needs PyTriton: pip install -e '.[serve]' (docs/serving.md)") from None
    return pytriton.triton


def check_python_backend(python: str = sys.executable) -> None:
    """Triton's Python-backend stub embeds this interpreter isolated from PYTHONPATH (as `python -I` runs), and
    PyTriton's proxy inside it imports numpy and zmq: where those are on PYTHONPATH only (`pip install --target`, the
    GPU box, 2026-11-26), every model fails to load once Triton starts. A UsageError before the pipelines load."""
    from core.errors import UsageError

    probe = subprocess.run([python, "-I", "-c", "import numpy, zmq"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise UsageError(f"Triton's Python backend runs {python} without PYTHONPATH, and there it cannot import numpy "
                         f"and zmq (PyTriton's proxy needs them): install PyTriton's dependencies into {sys.prefix} "
                         "itself (docs/serving.md)")


def engine_limits(settings, source):
    """What the served engines can run, as a request check (UsageError, flags named as in the CLI): their size, or
    any the engines' multiple allows; guided batches only (their UNet profile is for two rows per image)."""
    from core.errors import UsageError
    from demo.arguments import check_engine_image_size

    profile = settings.profile

    def check(request: RequestFlags) -> None:
        if not request.guided:
            raise UsageError(f"--guidance-scale {request.guidance_scale}: the served engines run guided batches only "
                             "(more than 1)")
        check_engine_image_size(source, request.height, request.width)
        for option, value, (low, _, high) in (("--height", request.height, profile.height),
                                              ("--width", request.width, profile.width)):
            if not low <= value <= high:
                taken = str(low) if low == high else f"{low}..{high}"
                raise UsageError(f"{option} {value}: the served engines take {taken} (engines built with "
                                 "--build-dynamic-shape take any size)")

    return check


class Server:
    """What Triton calls: an inference callable per model, which its instances (one per device) share, each
    answering a batch of requests on a device's pipeline lent by the pool."""

    def __init__(self, pool, source, defaults: RequestFlags, check, verbose: bool):
        self.pool, self.source, self.defaults, self.check = pool, source, defaults, check
        self.verbose = verbose
        self._ids = itertools.count(1)
        self._batches = itertools.count(1)
        self._lock = threading.Lock()  # the counters, shared by the instances' threads

    def callable_for(self, mode: str):
        return lambda requests: self.answer(mode, requests)

    def answer(self, mode: str, requests) -> list[dict]:
        """Triton's batch of requests, answered: raises only where all of them failed (Triton then fails each one
        with the message); otherwise a failed request's `error` output says why (PyTriton fails a batch only whole)."""
        import numpy as np

        from demo.serve.batching import run_requests
        from demo.serve.schema import BATCH_SIZE, ERROR, IMAGE, RequestRejected, parse_request

        parsed = []
        for request in requests:
            try:
                parsed.append(parse_request(request.data, self.source, self.defaults, self.check, mode))
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
            import traceback

            traceback.print_exception(exc, file=sys.stderr)

    def _log(self, request_id: int, outcome, batch_id: int | None, device) -> None:
        """One line per request: its id, shape, the batch it ran in (the server's count of pipeline calls), the
        call's ms and the pipeline's own (the rest: the hand-off to the device's process and back)."""
        request = None if outcome.request is None else outcome.request.flags
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


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare_device(flags, source, request: RequestFlags, device, backend: str, settings, modes) -> object:
    """The device's prepared ServedPipeline, a pipeline for each of `modes` over one set of stages (the VAE encoder
    too: image-to-image's): stages built or loaded (engines: as `settings` say), LoRAs fused, and warm-up calls (CUDA
    graphs captured, torch.compile compiled, engine buffers sized): text-to-image at every batch size up to
    --max-batch-size, each image mode at 1 (its requests run alone). Runs in the device's own process (workers.py)."""
    import torch
    from PIL import Image

    from demo.arguments import torch_settings
    from demo.backends import create_stages, device_and_dtype
    from demo.logs import configure_library_logging
    from demo.memory import check_memory
    from demo.pipeline import INPAINTING, TEXT_TO_IMAGE, make_pipeline, make_scheduler
    from demo.serve.batching import ServedPipeline
    from demo.serve.schema import Request
    from models import STAGE_MODELS, image_to_image_stages
    from models.lora import check_loras, model_targets

    configure_library_logging(flags[ModelFlags].verbose)  # a spawned process: the server's settings are not here
    engine, batch = flags[EngineFlags], flags[ServeFlags].max_batch_size
    loras = read_loras(flags[LoraFlags], backend, engine.build_enable_refit)
    if loras:
        check_loras(loras, model_targets(source))
    _, dtype = device_and_dtype(backend)
    check_memory(source, batch, request.height, request.width, device, dtype)
    accel = torch_settings(engine, flags[TorchFlags], device, source)[0] if backend == "torch" else None
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        models = [STAGE_MODELS[name](source) for name in image_to_image_stages(source)]
        stages = create_stages(backend, models, device, dtype, settings, log=lambda *_: None, progress=progress,
                               torch_settings=accel)
        pipelines = {mode: make_pipeline(source, stages, request.scheduler, device, dtype, mode) for mode in modes}
        next(iter(pipelines.values())).set_loras(loras)  # into the stages, which they share
    served = ServedPipeline(pipelines, device, functools.partial(make_scheduler, source=source))
    warm = replace(request, denoising_steps=1, seed=0)
    if TEXT_TO_IMAGE in modes:
        for size in range(1, batch + 1):
            progress(f"[{PROG}] {device}: text-to-image warm-up at batch {size}/{batch} ...")
            served([Request(warm)] * size)
    gray = Image.new("RGB", (warm.width, warm.height), (128, 128, 128))
    half = Image.new("L", gray.size)  # repaint the left half
    half.paste(255, (0, 0, warm.width // 2, warm.height))
    for mode in (mode for mode in modes if mode != TEXT_TO_IMAGE):
        progress(f"[{PROG}] {device}: {mode} warm-up ...")
        served([Request(warm, gray, half if mode == INPAINTING else None, strength=1.0)])  # its one step runs
    return served


def run(flags) -> int:
    from core.errors import UsageError
    from demo.arguments import engine_settings
    from demo.backends import select_backend
    from demo.logs import configure_library_logging
    from demo.pipeline import check_request, resolve_request
    from demo.serve.schema import served_modes
    from demo.serve.workers import SERVER_SWITCH_INTERVAL_S, WorkerPool, start_workers
    from demo.settings import TORCH_USES_ENGINE_FLAGS

    model, serve, engine = flags[ModelFlags], flags[ServeFlags], flags[EngineFlags]
    configure_library_logging(model.verbose)
    if not model.verbose:  # PyTriton logs each failed batch's traceback; the request's log line says why it failed
        logging.getLogger("pytriton").setLevel(logging.ERROR)

    at_least("--max-batch-size", serve.max_batch_size, 1)
    at_least("--opt-batch-size", serve.opt_batch_size, 1)
    if serve.opt_batch_size > serve.max_batch_size:
        raise UsageError(f"--opt-batch-size must be at most --max-batch-size ({serve.max_batch_size}), got "
                         f"{serve.opt_batch_size}")
    at_least("--max-queue-delay-ms", serve.max_queue_delay_ms, 0)
    check_ports_free(serve)
    devices = serving_devices(serve.gpus)
    backend, reason = select_backend(serve.backend)
    source = model.resolve()
    # What requests that leave them out get (the served size, scheduler), checked as flags: they are this command's.
    defaults = resolve_request(RequestFlags(height=serve.height, width=serve.width, scheduler=serve.scheduler), source)
    modes = served_modes(source)
    check_request(replace(defaults, batch_size=serve.max_batch_size), source, modes[0])  # inpainting models: inpaint
    defaults = replace(defaults, seed=None)  # a request's own, or a random one
    settings, check = None, lambda _: None
    if backend == "torch":
        unused = changed(engine, ignore=TORCH_USES_ENGINE_FLAGS) + [name for name in changed(serve)
                                                                   if name == "--opt-batch-size"]
    else:
        if engine.build_static_batch or engine.use_cuda_graph:
            raise UsageError("sd-serve batches requests dynamically: engines need a batch range; drop "
                             "--build-static-batch and --use-cuda-graph")
        settings = engine_settings(engine, source, backend, serve.opt_batch_size, defaults.height, defaults.width,
                                   guided=True, max_batch=serve.max_batch_size)
        check = engine_limits(settings, source)
        unused = changed(flags[TorchFlags])
    if unused:
        print(f"note: {', '.join(unused)} unused by the {backend} backend", file=sys.stderr)
    triton_api = import_pytriton()
    check_python_backend()
    progress(f"[{PROG}] model {source.name}, backend {backend} ({reason}), on {', '.join(map(str, devices))}")
    workers = start_workers(devices, lambda device: functools.partial(
        prepare_device, flags, source, defaults, device, backend, settings, modes), model.verbose)
    progress(f"[{PROG}] prepared: {', '.join(f'{worker.device} in process {worker.pid}' for worker in workers)}")
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)  # this process's threads now mostly hand batches on
    try:
        return serve_forever(triton_api, Server(WorkerPool(workers), source, defaults, check, model.verbose),
                             modes, serve)
    finally:
        for worker in workers:
            worker.close()


def put_triton_libraries_first() -> None:
    """LD_LIBRARY_PATH, for the Triton processes this one starts, led by where they must find their libraries: the
    libpython this interpreter runs on (Triton's Python-backend stub would load the system's), then PyTriton's bundled
    ones (libcudart among them). PyTriton looks for those beside site-packages only: installed anywhere else (`pip
    install --target`, PYTHONPATH; the GPU box, 2026-11-26) it takes itself for an editable install, and tritonserver
    cannot start."""
    import pytriton

    bundled = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    libraries = [sysconfig.get_config_var("LIBDIR"), str(bundled) if bundled.is_dir() else None,
                 os.environ.get("LD_LIBRARY_PATH")]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libraries))


def bind_model(triton, mode: str, infer_funcs: list, max_batch_size: int, max_queue_delay_ms: float) -> str:
    """`mode`'s model bound on `triton` (its inputs schema.inputs_of's; its outputs the image, the batch size and the
    error), a Triton instance per inference function, batched dynamically; returns the model's name."""
    import numpy as np
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    from demo.serve.schema import BATCH_SIZE, ERROR, IMAGE, MODEL_NAMES, inputs_of

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


def serve_forever(triton_api, server: Server, modes, serve: ServeFlags) -> int:
    """Start Triton with a model for each of `modes` bound to the pipelines, then wait for SIGTERM or SIGINT (handled
    here: a process started in the background ignores SIGINT) or for Triton to die; stop it, draining the requests in
    flight, and return the exit status (128 + the signal)."""
    from core.errors import RunFailure

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
                            serve.max_batch_size, serve.max_queue_delay_ms) for mode in modes]
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


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import run_command
    from demo.settings import parse_flags

    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv)))
