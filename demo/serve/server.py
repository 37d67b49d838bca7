"""sd-serve's server: the text-to-image, image-to-image and inpainting pipelines of one PipelineSpec behind Triton
Inference Server (PyTriton), models txt2img, img2img and inpaint (those the model can run), one loaded pipeline per
device, each in a process of its own (workers.py), requests batched dynamically. The command is demo.cli.serve.

Everything is prepared (engines built or loaded, LoRAs fused, graphs captured and compiled at every batch size) before
Triton starts, so /v2/health/ready answers only then. Each request is answered on its own: its image, or Triton's error
with one line (400 for a bad request, 500 for a failed run, 503 while stopping; triton_model.py). SIGTERM or SIGINT:
new requests are refused, those in flight finish (or fail once drain_seconds are up), the process exits 143 / 130.
Needs the `serve` extra (docs/serving.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.client
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image

from core.errors import RunFailure, UsageError, field, render_fields
from demo.request import INPAINTING, TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline, plan_pipeline, to_stderr
from demo.runtime.plan import resolve_request
from demo.runtime.spec import PipelineSpec
from demo.serve.batching import ServedPipeline, run_requests
from demo.serve.options import PORTS, ServeOptions, check_servable
from demo.serve.schema import (
    BAD_REQUEST,
    BATCH_SIZE,
    ERROR,
    ERROR_CODE,
    FAILED,
    IMAGE,
    MODEL_NAMES,
    UNAVAILABLE,
    RequestRejected,
    inputs_of,
    parse_request,
)
from demo.serve.workers import SERVER_SWITCH_INTERVAL_S, WorkerPool, start_workers

PROG = "sd-serve"
# Stopping, Triton waits this long for clients to close their HTTP connections (idle keep-alive ones too), every
# request being answered by then, while the models unload (stop_triton): 2.3 s for three on the 2-core CPU machine.
TRITON_EXIT_TIMEOUT_S = 5
# A pipeline call's answer once its process is ended (a drain cut short).
CUT_OFF_TIMEOUT_S = 10


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


def port_lock_path(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"sd-serve-port-{port}.lock"


@contextlib.contextmanager
def claim_ports(options: ServeOptions) -> Iterator[None]:
    """Within: this process's claim on its ports, an exclusive lock per port in the temporary folder, which the system
    releases however the process ends. Two servers started together on the same ports each found them free, prepared,
    and then the second one's PyTriton took the first one's Triton for its own (and unloaded its models at exit);
    now the second one is refused here, before anything loads. Then check_ports_free, for other programs."""
    with contextlib.ExitStack() as stack:
        for name in PORTS:
            port = getattr(options, name)
            if not stack.enter_context(port_lock(port_lock_path(port))):
                raise UsageError(f"{field(name)} {port}: another sd-serve on this machine has it")
        check_ports_free(options)
        yield


@contextlib.contextmanager
def port_lock(path: Path) -> Iterator[bool]:
    """Within: whether this process holds the lock file `path` (False: another one does). The file is removed at the
    end, so that ports once served leave no files behind; a lock taken on a file that was removed meanwhile is taken
    again on the new one. Read-only, and created only where missing: a lock file another user made stays usable (flock
    needs no write access, and a sticky /tmp may refuse O_CREAT on others' files)."""
    while True:
        try:
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                descriptor = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(f"cannot open the port lock {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            yield False
            return
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(descriptor).st_ino:
            break
        os.close(descriptor)  # its holder removed it as we opened it
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still locked: whoever opened it meanwhile sees it gone, and takes a new one
        os.close(descriptor)


def check_ports_free(options: ServeOptions) -> None:
    """A UsageError now for an address or port Triton could not listen on, rather than its timeout later."""
    for name in PORTS:
        port = getattr(options, name)
        with socket.socket(socket.AF_INET6 if ":" in options.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Triton binds
            try:
                probe.bind((options.host, port))
            except OSError as exc:
                raise UsageError(f"{field(name)} {port} on {options.host}: cannot listen ({exc.strerror or exc})") \
                    from None



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
    buffers sized): text-to-image at every batch size up to the spec's max_batch_size, the largest first (a stage's
    CUDA graphs share one memory pool, and a smaller batch's capture reuses what the largest's freed), each image mode
    at 1 (its requests run alone). Runs in the device's own process (workers.py)."""
    pipeline = load_pipeline(spec, device, progress=progress)
    served = ServedPipeline(pipeline)
    warm = resolve_request(Request("", denoising_steps=1, seed=0), spec, pipeline.source, pipeline.loras)
    gray = Image.new("RGB", (warm.width, warm.height), (128, 128, 128))
    warm = replace(warm, control_images=(gray,) * len(spec.controlnets) or None)
    batch = spec.max_batch_size
    if TEXT_TO_IMAGE in pipeline.plan.modes:
        for size in range(batch, 0, -1):
            progress(f"[{PROG}] {device}: text-to-image warm-up at batch {size}/{batch} ...")
            served([warm] * size)
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
    with claim_ports(options):
        devices = serving_devices(options.gpus)
        plan = plan_pipeline(spec, devices[0], progress=progress)  # what checks requests here; nothing loads here
        for note in startup_notes(plan, options, devices):
            progress(f"note: {render_fields(note, name)}")
        triton_api = import_pytriton()
        check_python_backend()
        progress(f"[{PROG}] model {plan.source.name}, backend {plan.backend.name} ({plan.backend_reason}), on "
                 f"{', '.join(map(str, devices))}")
        spec = plan.spec
        workers = start_workers(devices, lambda device: functools.partial(prepare_device, spec, device),
                                options.verbose)
        progress(f"[{PROG}] prepared: {', '.join(f'{worker.device} in process {worker.pid}' for worker in workers)}")
        sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)  # this process's threads now mostly hand batches on
        try:
            signum, signalled = serve_forever(triton_api, Server(WorkerPool(workers), plan, options.verbose),
                                              plan.modes, spec.max_batch_size, options)
        finally:
            for worker in workers:
                worker.close()
    progress(f"[{PROG}] stopped in {time.monotonic() - signalled:.1f} s")  # the signal to the process's end, all of it
    return 128 + signum


def startup_notes(plan, options: ServeOptions, devices: list[torch.device]) -> list[str]:
    """What the server says before it prepares anything: the plan's notes, the options that change nothing in this
    run, and, without a GPU, that Triton's CUDA lines are no fault."""
    spec, notes = plan.spec, list(plan.notes)
    if not plan.backend.capabilities.artifacts and spec.batch_size != PipelineSpec.batch_size:
        notes.append(f"{field('batch_size')} unused by the {plan.backend.name} backend")  # the engines' optimum
    if options.max_queue_delay_ms and (spec.max_batch_size == 1 or TEXT_TO_IMAGE not in plan.modes):
        why = (f"{field('max_batch_size')} is 1" if spec.max_batch_size == 1 else
               f"model '{plan.source.name}' serves image requests only, each run alone")
        notes.append(f"{field('max_queue_delay_ms')} unused: no request waits for others to batch with ({why})")
    if all(device.type == "cpu" for device in devices):
        notes.append("no CUDA GPU here: the two lines Triton logs about CUDA as it starts (\"Unable to allocate "
                     "pinned system memory\", \"CudaDriverHelper has not been initialized\") are expected on such a "
                     "machine and harmless")
    return notes


class Server:
    """What Triton calls: an inference callable per model, which its instances (one per device) share, each
    answering a batch of requests on a device's pipeline lent by the pool; and how many batches it is answering, for
    a stop to wait for."""

    def __init__(self, pool, plan, verbose: bool):
        self.pool, self.plan, self.verbose = pool, plan, verbose
        self._ids = itertools.count(1)
        self._batches = itertools.count(1)
        self._lock = threading.Lock()  # the counters, shared by the instances' threads
        self._changed = threading.Condition()  # the batches in flight and the stop, below
        self._in_flight = 0
        self._stopping: str | None = None  # why new batches are refused
        self._cut_off: str | None = None  # why the batches still running failed

    def callable_for(self, mode: str):
        return lambda requests: self.answer(mode, requests)

    def answer(self, mode: str, requests) -> list[dict]:
        """Triton's batch of requests, each answered on its own (outputs_of, failure): refused while the server stops;
        an exception of the server's own fails each request with one line, its traceback in the server's log."""
        with self._changed:
            if self._stopping:
                return [failure(self._stopping, UNAVAILABLE) for _ in requests]
            self._in_flight += 1
        try:
            return self._answer(mode, requests)
        except Exception as exc:  # noqa: BLE001 -- never PyTriton's traceback for an answer
            traceback.print_exception(exc, file=sys.stderr)
            return [failure(f"the server failed this request ({type(exc).__name__}; its log says more)", FAILED)
                    for _ in requests]
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def _answer(self, mode: str, requests) -> list[dict]:
        parsed = []
        for request in requests:
            try:
                parsed.append(parse_request(request.data, self.plan, mode))
            except RequestRejected as exc:
                parsed.append(exc)
        with self.pool.lend() as served:
            outcomes = run_requests(parsed, served, on_failure=self._failed)
        cut_off = self._cut_off
        for outcome in outcomes:
            if cut_off and outcome.request is not None and outcome.error is not None:
                outcome.error = cut_off  # not the pipeline process's end, which the stop caused
        calls = sorted({outcome.call for outcome in outcomes if outcome.call is not None})
        with self._lock:
            ids = [next(self._ids) for _ in outcomes]
            batch_ids = {call: next(self._batches) for call in calls}
        for request_id, outcome in zip(ids, outcomes):
            self._log(request_id, outcome, batch_ids.get(outcome.call), served.device)
        return [outputs_of(outcome, UNAVAILABLE if cut_off else FAILED) for outcome in outcomes]

    def stop_accepting(self, reason: str) -> None:
        """From now on every batch is refused with `reason` (UNAVAILABLE)."""
        with self._changed:
            self._stopping = reason

    def drain(self, seconds: float) -> bool:
        """Waits up to `seconds` for the batches in flight; whether they all finished."""
        with self._changed:
            return self._changed.wait_for(lambda: self._in_flight == 0, timeout=seconds)

    def cut_off(self, reason: str) -> None:
        """The batches in flight fail with `reason` (UNAVAILABLE): the devices' processes are ended, which ends
        their pipeline calls."""
        self._cut_off = reason
        for worker in self.pool.workers:
            worker.kill()

    def _failed(self, exc: BaseException) -> None:
        if self.verbose:
            traceback.print_exception(exc, file=sys.stderr)

    def _log(self, request_id: int, outcome, batch_id: int | None, device) -> None:
        """One line per request: its id, shape, the pipeline call it ran in (the server's count of them) and how many
        requests that call ran, the call's ms and the pipeline's own (the rest: the hand-off to the device's process
        and back)."""
        request = outcome.request
        what = "" if request is None else (f" {request.height}x{request.width} steps {request.denoising_steps} "
                                           f"seed {request.seed}")
        if outcome.error is not None:
            line = f"request {request_id}{what} failed: {outcome.error}"
        else:
            line = (f"request {request_id}{what}: call {batch_id}, a batch of {outcome.batch_size}, on {device}, "
                    f"{outcome.milliseconds:.1f} ms (pipeline {outcome.pipeline_milliseconds:.1f} ms)")
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def outputs_of(outcome, failed_code: str) -> dict:
    """A request's outputs: its image, or its error (a rejected request's BAD_REQUEST, else `failed_code`)."""
    if outcome.error is not None:
        return failure(outcome.error, BAD_REQUEST if outcome.request is None else failed_code)
    return {IMAGE: outcome.image[None], BATCH_SIZE: np.array([[outcome.batch_size]], np.int32),
            ERROR: np.array([[b""]], np.bytes_), ERROR_CODE: np.array([[b""]], np.bytes_)}


def failure(line: str, code: str) -> dict:
    """A failed request's outputs: the error and its Triton code, which triton_model.py answers it with. The image is
    a 1x1 placeholder, never sent: a zero-size one broke PyTriton's serialization of the whole batch ("memoryview:
    cannot cast view with zeros in shape or strides"), failing the good requests batched with a bad one."""
    return {IMAGE: np.zeros((1, 1, 1, 3), np.uint8), BATCH_SIZE: np.zeros((1, 1), np.int32),
            ERROR: np.array([[line.encode()]], np.bytes_), ERROR_CODE: np.array([[code.encode()]], np.bytes_)}


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


def bind_model(triton, mode: str, infer_funcs: list, max_batch_size: int, max_queue_delay_ms: float,
               controlnets: int = 0) -> str:
    """`mode`'s model bound on `triton` (its inputs schema.inputs_of's, with `controlnets` control images; its outputs
    the image and the batch size), a Triton instance per inference function, batched dynamically; returns the
    model's name."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    triton.bind(
        model_name=MODEL_NAMES[mode],
        infer_func=infer_funcs,
        inputs=[Tensor(name=item.name, dtype=item.dtype, shape=item.shape, optional=item.optional)
                for item in inputs_of(mode, controlnets)],
        outputs=[Tensor(name=IMAGE, dtype=np.uint8, shape=(-1, -1, 3)),
                 Tensor(name=BATCH_SIZE, dtype=np.int32, shape=(1,))],
        config=ModelConfig(max_batch_size=max_batch_size, batcher=DynamicBatcher(
            max_queue_delay_microseconds=int(max_queue_delay_ms * 1000))),
    )
    return MODEL_NAMES[mode]


def answer_errors_alone(model_store: Path, names) -> None:
    """Each bound model's Python model made triton_model.py, which answers each failed request with Triton's error of
    its own code and its one line, over PyTriton's proxy model (renamed pytriton_model.py, which it imports).
    PyTriton writes the model store at bind; Triton loads it as it starts."""
    for name in names:
        version = model_store / name / "1"
        (version / "model.py").rename(version / "pytriton_model.py")
        shutil.copyfile(Path(__file__).with_name("triton_model.py"), version / "model.py")


def stop_triton(triton, options: ServeOptions, names) -> None:
    """Triton stopped, its models unloaded on the way: once stopping, it takes no new HTTP connections, waits up to its
    exit timeout for those open to close (a client's idle keep-alive one too), and then gets only what is left of that
    timeout to unload its models; left with none, it aborted ("Exit timeout expired", then "terminate called ...") and
    the process lived 30 s. So as soon as it stops taking connections, the models are unloaded through gRPC (which it
    still serves); requests on connections still open get the models' 503 until then."""
    deadline = time.monotonic() + TRITON_EXIT_TIMEOUT_S
    unloading = threading.Thread(target=unload_once_stopping, args=(triton, options, names, deadline), daemon=True)
    unloading.start()
    triton.stop()  # removes PyTriton's workspace
    unloading.join(max(0.0, deadline - time.monotonic()))


def local_host(host: str) -> str:
    """Where this machine reaches an address Triton listens on."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def takes_http_connections(host: str, port: int) -> bool:
    """Whether Triton answers a new HTTP connection; the connection is closed after, so that no stop waits for it."""
    connection = http.client.HTTPConnection(host, port, timeout=1)
    try:
        connection.request("GET", "/v2/health/live")
        return connection.getresponse().status == 200
    except OSError:  # refused, reset, closed unanswered: stopping
        return False
    finally:
        connection.close()


def unload_once_stopping(triton, options: ServeOptions, names, deadline: float) -> None:
    """The models unloaded through gRPC once Triton takes no more HTTP connections (its stop has begun), before
    `deadline`; where it is gone by then, nothing."""
    import tritonclient.grpc
    from pytriton.client.auth import create_auth_headers

    host = local_host(options.host)
    while takes_http_connections(host, options.http_port):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    headers = create_auth_headers(triton.get_access_token(), "grpc")
    client = tritonclient.grpc.InferenceServerClient(f"[{host}]:{options.grpc_port}" if ":" in host else
                                                     f"{host}:{options.grpc_port}")
    try:
        for name in names:
            client.unload_model(name, headers=headers, client_timeout=max(0.1, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            index = client.get_model_repository_index(headers=headers, as_json=True).get("models", [])
            if all(model.get("state") not in ("READY", "UNLOADING") for model in index if model["name"] in names):
                return
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 -- Triton ended first (it unloads them itself when no connection is open)
        pass
    finally:
        client.close()


def serve_forever(triton_api, server: Server, modes, max_batch_size: int, serve: ServeOptions) -> tuple[int, float]:
    """Start Triton with a model for each of `modes` bound to the pipelines, then wait for SIGTERM or SIGINT (handled
    here: a process started in the background ignores SIGINT) or for Triton to die. Stopping: new requests are
    refused, those in flight finish or, past serve.drain_seconds, fail; the models are unloaded and Triton stopped.
    Returns the signal and when it came (time.monotonic)."""
    from pytriton.utils.workspace import Workspace

    put_triton_libraries_first()
    received: list[tuple[int, float]] = []
    stop = threading.Event()

    def on_signal(signum, _frame):
        received.append((signum, time.monotonic()))
        # Not stop.set() here: the handler runs in the main thread, which may hold stop's lock inside stop.wait(), and
        # set() would wait on it for ever (seen: a SIGTERM that sd-serve never answered).
        threading.Thread(target=stop.set, daemon=True).start()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    gpus = any(worker.device.type == "cuda" for worker in server.pool.workers)
    config = triton_api.TritonConfig(http_address=serve.host, grpc_address=serve.host, metrics_address=serve.host,
                                     http_port=serve.http_port, grpc_port=serve.grpc_port,
                                     metrics_port=serve.metrics_port, exit_timeout_secs=TRITON_EXIT_TIMEOUT_S,
                                     allow_gpu_metrics=gpus)  # without a GPU: no NVML, DCGM error lines
    workspace = Workspace()  # in ~/.cache/pytriton, as PyTriton makes it; made here to know its model store
    # The model written into a local model store before Triton starts, which loads it then: /v2/health/ready answers
    # only once the model is there (by default PyTriton loads it into a running server, ready before it is).
    policy = triton_api.TritonLifecyclePolicy(launch_triton_on_startup=False, local_model_store=True)
    triton = triton_api.Triton(config=config, workspace=workspace, triton_lifecycle_policy=policy)
    try:
        controlnets = len(server.plan.spec.controlnets)
        names = [bind_model(triton, mode, [server.callable_for(mode) for _ in server.pool.workers],  # one per device
                            max_batch_size, serve.max_queue_delay_ms, controlnets) for mode in modes]
        answer_errors_alone(workspace.model_store_path, names)
        check_ports_free(serve)  # again: another program may have taken one while the pipelines were prepared
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
        signal_name = signal.Signals(received[0][0]).name
        server.stop_accepting(f"sd-serve is stopping ({signal_name}); send the request again elsewhere or later")
        progress(f"[{PROG}] {signal_name}: refusing new requests, finishing those in flight (at most "
                 f"{serve.drain_seconds:g} s)")
        if not server.drain(serve.drain_seconds):
            progress(f"[{PROG}] requests still running after {serve.drain_seconds:g} s: failing them")
            server.cut_off(f"sd-serve stopped ({signal_name}) before this request finished: it waits "
                           f"{serve.drain_seconds:g} s for those in flight")
            server.drain(CUT_OFF_TIMEOUT_S)
    except BaseException:
        triton.stop()  # removes PyTriton's workspace
        raise
    stop_triton(triton, serve, names)
    return received[0]
