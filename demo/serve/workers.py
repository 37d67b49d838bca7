"""One process per served device. Two pipelines in one process share its interpreter lock: on two H100s
(2026-11-26) a batch of 4 took 830 ms with both GPUs busy against 679 ms with one, and two GPUs gave 1.47x one GPU's
throughput. Each device's pipeline is prepared and run in a process of its own; the server's process keeps a
DeviceWorker per device, which Triton calls as it would the pipeline, and waits on a pipe without holding the lock.
Images cross in shared memory, not through the pipe (see _send). Triton's instances take whichever worker is free,
the first one listed when several are (WorkerPool)."""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from multiprocessing import shared_memory
from typing import Callable, Iterator, Sequence

import numpy as np

from core.errors import RunFailure, UsageError


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the one that started it dies (SIGKILL included), so that no
    pipeline outlives its server, however it ended."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _sendable(exc: BaseException) -> BaseException:
    """`exc` where it survives pickling (its type then decides how the server reports it), else a RuntimeError
    with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 -- any exception that cannot cross the pipe
        return RuntimeError(f"{type(exc).__name__}: {exc}")


SHARED_MEMORY_DIR = "/dev/shm"
# The server process's interpreter switch interval (Python's default: 5 ms). A thread back from a pipe or a syscall
# waits up to that long for the lock while another thread of the server runs Python; a batch's hand-off makes some
# ten such waits. At 0.5 ms a batch of four 512x512 images arrived in 8.6 ms instead of 50 with one busy thread
# (results/serve-gpus/transfer-cpu-2026-11-26/).
SERVER_SWITCH_INTERVAL_S = 0.0005


class _OutOfBandPickler(pickle.Pickler):
    """Protocol 5 with every numpy array's bytes out of band: pickle takes only a C- or Fortran-ordered array's that
    way and copies any other (a permuted view, say) into the stream; such an array is made C-ordered first. On an
    H100 (2026-11-26) the server's images, permuted views then, crossed in the pipe: a batch of four 512x512 images
    took 28.6 ms to hand back."""

    def reducer_override(self, obj):
        if isinstance(obj, np.ndarray) and not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            return np.ascontiguousarray(obj).__reduce_ex__(5)
        return NotImplemented


def _send(connection, value) -> None:
    """`value` to the other process, its arrays' bytes (pickle's out-of-band buffers) in one shared memory segment
    that the receiver copies out and unlinks. Why: a pipe moves 64 KiB per read, and the reading thread takes the
    interpreter lock back after each: with another thread busy in the server's process (PyTriton's, the other GPU's),
    a batch of four 512x512 images took 90 ms to arrive instead of 12 (results/serve-gpus/transfer-cpu-2026-11-26/).
    In the pipe where shared memory lacks the room: a segment larger than its free space would kill the writer
    (SIGBUS) instead of failing."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _OutOfBandPickler(stream, protocol=5, buffer_callback=buffers.append).dump(value)
    payload = stream.getvalue()
    views = [buffer.raw() for buffer in buffers]
    sizes = tuple(view.nbytes for view in views)
    if not views:
        connection.send((payload, None, ()))
        return
    if not _room_for(sum(sizes)):
        connection.send((pickle.dumps(value, protocol=5), None, ()))  # the arrays in the pipe after all
        return
    segment = shared_memory.SharedMemory(create=True, size=sum(sizes))
    offset = 0
    for view in views:
        segment.buf[offset:offset + view.nbytes] = view
        offset += view.nbytes
    segment.close()  # the receiver unlinks it; if the server dies first, multiprocessing's resource tracker does
    connection.send((payload, segment.name, sizes))


def _room_for(size: int) -> bool:
    try:
        stat = os.statvfs(SHARED_MEMORY_DIR)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= 2 * size  # room to spare: the server's PyTriton uses it too


def _receive_value(connection):
    """What _send sent (EOFError/OSError where the pipe is closed)."""
    payload, name, sizes = connection.recv()
    if name is None:
        return pickle.loads(payload)
    segment = shared_memory.SharedMemory(name=name)
    try:
        buffers, offset = [], 0
        for size in sizes:
            with segment.buf[offset:offset + size] as view:
                buffers.append(bytearray(view))  # one copy, so that the segment can go now
            offset += size
    finally:
        segment.close()
        segment.unlink()
    return pickle.loads(payload, buffers=buffers)


def _work(connection, prepare: Callable[[], Callable], verbose: bool) -> None:
    """The device's process: `prepare()` gives the callable that answers batches; then batches until the pipe closes
    or brings None, and the process ends at once. Signals are the server's to handle: it drains, then closes the
    pipe."""
    _die_with_parent()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)

    def attempt(call, *args) -> tuple:
        try:
            return "ok", call(*args)
        except Exception as exc:  # noqa: BLE001 -- sent to the server, which reports it
            if verbose:
                traceback.print_exc()
            return "error", _sendable(exc)

    kind, prepared = attempt(prepare)
    _send(connection, (kind, None if kind == "ok" else prepared))  # the callable stays here; an exception goes
    if kind != "ok":
        return
    while True:
        try:
            batch = _receive_value(connection)
        except EOFError:
            break
        if batch is None:
            break
        _send(connection, attempt(prepared, batch))
    # Nothing is left to clean up: the interpreter's own teardown (torch, the pipeline) took 4.4 s of a stop on the
    # 2-core CPU machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class DeviceWorker:
    """A device's pipeline in a process of its own, called with a batch as the pipeline is (one call at a time;
    exceptions raised in the process are raised here)."""

    def __init__(self, device, prepare: Callable[[], Callable], verbose: bool = False):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self.device = device
        self.connection, theirs = context.Pipe()
        self._process = context.Process(target=_work, args=(theirs, prepare, verbose), name=f"sd-serve {device}")
        self._process.start()
        theirs.close()
        # One batch at a time through the pipe, on the stages that the device's models (txt2img, img2img, inpaint)
        # share. The server's WorkerPool lends a worker to one call at a time; this keeps any other caller to that.
        self._lock = threading.Lock()

    def _receive(self):
        try:
            kind, value = _receive_value(self.connection)
        except (EOFError, OSError):
            self._process.join(5)
            raise RunFailure(f"the pipeline process for {self.device} exited (status {self._process.exitcode})") \
                from None
        if kind == "error":
            raise value
        return value

    def wait_prepared(self) -> None:
        """Returns once the pipeline is prepared; raises what preparing it raised: a UsageError or RunFailure as it
        is, anything else as a RunFailure with its type and first line (its traceback, the device process's, shows
        with --verbose; here it would show only this call)."""
        try:
            self._receive()
        except (UsageError, RunFailure):
            raise
        except Exception as exc:  # noqa: BLE001 -- whatever preparing the pipeline raised, as one line
            first_line = (str(exc).strip().splitlines() or ["no detail"])[0]
            raise RunFailure(f"preparing the pipeline for {self.device} failed: {type(exc).__name__}: "
                             f"{first_line}") from None

    def __call__(self, requests: Sequence):
        with self._lock:
            _send(self.connection, list(requests))
            return self._receive()

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.is_alive()

    def kill(self) -> None:
        """Ends the process now, in the middle of a batch too (its caller then gets a RunFailure)."""
        self._process.kill()

    def close(self, timeout: float = 10.0) -> None:
        """Ends the process: once it finishes the batch it is running, or at `timeout`."""
        try:
            _send(self.connection, None)
        except OSError:
            pass  # already gone
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self.connection.close()


def start_workers(devices, prepare_for: Callable[[object], Callable[[], Callable]], verbose: bool = False) \
        -> list[DeviceWorker]:
    """A prepared DeviceWorker per device, prepared side by side; `prepare_for(device)` is the (picklable) job that
    prepares one. Where one fails, all are ended and its exception is raised."""
    workers = [DeviceWorker(device, prepare_for(device), verbose) for device in devices]
    try:
        pending = {worker.connection: worker for worker in workers}
        while pending:
            for connection in multiprocessing.connection.wait(list(pending)):
                pending.pop(connection).wait_prepared()
    except BaseException:
        for worker in workers:
            worker.close(timeout=0)
        raise
    return workers


class WorkerPool:
    """The device workers, lent one call at a time: the free one listed first, or the first to come free. Why not
    one worker per Triton instance: Triton hands requests to its idle instances in turn, so at concurrency 1 on two
    H100s (2026-11-26) the GPUs alternated, each idle for a whole request before its next, and a request took 12.6 ms
    longer than on one GPU; lent this way, 6.7 (results/serve-gpus/h100x2-2026-11-26-pool/). One GPU runs everything
    while one suffices; under load, all do."""

    def __init__(self, workers: Sequence):
        self.workers = list(workers)
        self._busy: set[int] = set()  # indices into workers
        self._changed = threading.Condition()

    @contextmanager
    def lend(self) -> Iterator:
        with self._changed:
            self._changed.wait_for(lambda: len(self._busy) < len(self.workers))
            index = min(set(range(len(self.workers))) - self._busy)
            self._busy.add(index)
        try:
            yield self.workers[index]
        finally:
            with self._changed:
                self._busy.discard(index)
                self._changed.notify()
