"""sd-serve's per-device processes (demo/serve/workers.py), with toy jobs in place of pipelines: batches are answered
in another process, exceptions come back with their type, a failed preparation ends every worker, a worker that dies
(or is killed) fails its caller in one line, a closed worker ends at once, no worker outlives the process that started
it, even one killed with SIGKILL, and images cross in shared memory that is gone once they have arrived; the pool lends
the first free worker."""

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from core.errors import RunFailure, UsageError
from demo.serve import workers as workers_module
from demo.serve.workers import DeviceWorker, WorkerPool, start_workers


class Unpicklable(Exception):
    def __init__(self, reason, extra):  # pickling calls Unpicklable(*args) with args == (reason,): it fails
        super().__init__(reason)


def answer(batch):
    """A batch's answer from the worker: each item with the worker's pid, or the exception an item asks for."""
    if "usage" in batch:
        raise UsageError("--height 65: must be a multiple of 8")
    if "odd" in batch:
        raise Unpicklable("an exception that cannot cross a pipe", 1)
    if "die" in batch:
        os._exit(3)
    if "sleep" in batch:
        time.sleep(60)
    if "images" in batch:
        return [images(seed) for seed in range(len(batch))]
    return [(item, os.getpid()) for item in batch]


def images(seed: int) -> np.ndarray:
    """A batch of four 512x512 images, as a pipeline returns them: 3 MiB."""
    return np.random.default_rng(seed).integers(0, 256, (4, 512, 512, 3), dtype=np.uint8)


def prepare(delay: float = 0.0, fail: bool = False):
    time.sleep(delay)
    if fail:
        raise UsageError("no such model")
    return answer


def alive(pid: int) -> bool:
    """Running: a zombie (killed, not yet reaped where PID 1 does not reap) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_batches_run_in_the_workers_process_and_errors_keep_their_type():
    (worker,) = start_workers(["cpu"], lambda _: prepare)
    try:
        result = worker(["a", "b"])
        assert [item for item, _ in result] == ["a", "b"]
        assert result[0][1] != os.getpid()
        with pytest.raises(UsageError, match="multiple of 8"):
            worker(["usage"])
        with pytest.raises(RuntimeError, match="Unpicklable: an exception that cannot cross a pipe"):
            worker(["odd"])
        assert worker(["c"])[0][0] == "c"  # the worker goes on after a failed batch
    finally:
        worker.close()
    assert not worker.alive()


def shared_segments() -> set[str]:
    return set(os.listdir(workers_module.SHARED_MEMORY_DIR))


def test_images_come_back_whole_and_leave_no_shared_memory_behind():
    before = shared_segments()
    (worker,) = start_workers(["cpu"], lambda _: prepare)
    try:
        for _ in range(3):
            result = worker(["images", "images"])
            assert len(result) == 2
            for seed, got in enumerate(result):
                assert np.array_equal(got, images(seed))
            result[0][0, 0, 0] = 7  # writable, as the pipeline's own arrays are
    finally:
        worker.close()
    assert shared_segments() == before


@pytest.mark.parametrize("room", [True, False])
def test_arrays_go_in_shared_memory_where_it_has_room_else_in_the_pipe(monkeypatch, room):
    """Arrays in any layout: a permuted view (as torch's .permute().numpy() gives) too."""
    monkeypatch.setattr(workers_module, "_room_for", lambda size: room)
    ours, theirs = multiprocessing.Pipe()
    channels_first = np.ascontiguousarray(images(1).transpose(0, 3, 1, 2))
    value = ("ok", [images(1), "text", channels_first.transpose(0, 2, 3, 1)])
    before = shared_segments()
    sender = threading.Thread(target=workers_module._send, args=(theirs, value))
    sender.start()
    payload, name, sizes = message = ours.recv()
    sender.join()
    if room:
        assert name is not None and len(payload) < 10_000  # the images are not in the pipe
    else:
        assert name is None and len(payload) > 2 * images(1).nbytes
    ours_again, theirs_again = multiprocessing.Pipe()
    sender = threading.Thread(target=theirs_again.send, args=(message,))  # a pipe holds 64 KiB: someone must read
    sender.start()
    kind, (array, text, permuted) = workers_module._receive_value(ours_again)
    sender.join()
    assert kind == "ok" and text == "text" and np.array_equal(array, images(1)) and np.array_equal(permuted, array)
    assert shared_segments() == before


def test_workers_prepare_side_by_side():
    started = time.monotonic()
    workers = start_workers(["cuda:0", "cuda:1"], lambda _: functools.partial(prepare, 3.0))
    try:
        assert time.monotonic() - started < 5.5  # one after another would take 6 s and more
        assert len({worker(["x"])[0][1] for worker in workers}) == 2
    finally:
        for worker in workers:
            worker.close()


def test_a_failed_preparation_ends_every_worker():
    jobs = {"cuda:0": functools.partial(prepare, 60.0), "cuda:1": functools.partial(prepare, fail=True)}
    started = time.monotonic()
    with pytest.raises(UsageError, match="no such model"):
        start_workers(list(jobs), jobs.__getitem__)
    assert time.monotonic() - started < 30  # the slow one was not waited for
    assert not [child for child in _children() if "spawn_main" in child]


def slow_to_end():
    """A job whose process would take 30 s to end after its work (its interpreter's teardown: torch's and the
    pipeline's took 4.4 s of a server's stop on the 2-core CPU machine)."""
    import atexit

    atexit.register(time.sleep, 30)
    return answer


def test_a_closed_worker_ends_at_once_skipping_its_teardown():
    (worker,) = start_workers(["cpu"], lambda _: slow_to_end)
    assert worker(["a"])[0][0] == "a"
    started = time.monotonic()
    worker.close()  # else it waits 10 s for the process, then kills it
    assert not worker.alive() and time.monotonic() - started < 8


def test_a_killed_worker_fails_the_batch_it_runs():
    """A drain cut short ends the devices' processes in the middle of their batches."""
    (worker,) = start_workers(["cpu"], lambda _: prepare)
    try:
        threading.Timer(1.0, worker.kill).start()
        with pytest.raises(RunFailure, match=r"^the pipeline process for cpu exited \(status -9\)$"):
            worker(["sleep"])
    finally:
        worker.close()


def test_a_worker_that_dies_fails_its_call_naming_the_device():
    worker = DeviceWorker("cuda:1", prepare)
    worker.wait_prepared()
    with pytest.raises(RunFailure, match=r"the pipeline process for cuda:1 exited \(status 3\)"):
        worker(["die"])
    worker.close()


@pytest.mark.parametrize("state", ["preparing", "idle"])
def test_no_worker_outlives_a_server_killed_with_sigkill(tmp_path, state):
    pid_file = tmp_path / "worker.pid"
    code = textwrap.dedent(f"""
        import functools, pathlib, sys, time
        sys.path[:0] = {sys.path!r}
        from demo.serve.workers import DeviceWorker
        from tests.test_serve_workers import prepare
        worker = DeviceWorker("cpu", functools.partial(prepare, {600.0 if state == "preparing" else 0.0}))
        if {state == "idle"}:
            worker.wait_prepared()
        pathlib.Path({str(pid_file)!r}).write_text(str(worker.pid))
        time.sleep(600)
    """)
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert server.poll() is None and time.monotonic() < deadline, "the toy server did not start its worker"
            time.sleep(0.2)
        worker_pid = int(pid_file.read_text())
        time.sleep(2)  # the worker is in its job (preparing) or waiting for a batch
        assert alive(worker_pid)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    deadline = time.monotonic() + 10
    while alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker_pid)


def test_the_pool_lends_the_first_free_worker_and_waits_when_none_is():
    pool = WorkerPool(["cuda:0", "cuda:1"])
    for _ in range(3):  # one call at a time: always the first, however Triton's instances take turns
        with pool.lend() as worker:
            assert worker == "cuda:0"
    with pytest.raises(ValueError):
        with pool.lend():
            raise ValueError("a failed call gives its worker back")
    third_lent = []

    def third_call():
        with pool.lend() as worker:
            third_lent.append(worker)

    second = pool.lend()
    with pool.lend() as first:
        assert (first, second.__enter__()) == ("cuda:0", "cuda:1")
        third = threading.Thread(target=third_call)
        third.start()
        time.sleep(0.5)
        assert third_lent == [], "a third call got a worker while both were lent"
    third.join(10)  # the first came back: the third call has it
    assert third_lent == ["cuda:0"]
    second.__exit__(None, None, None)
    with pool.lend() as worker:
        assert worker == "cuda:0"


def _children() -> list[str]:
    """The command lines of this process's children that are still running."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) == os.getpid():
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    found.append(cmdline.read().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return found
