"""sd-serve's faults (the server's answers and its ends): every request of a batch answered well-formed on its own,
and its error sent as Triton's own of its code with one line, never a traceback (triton_model.py, on a stand-in
model); a port claimed by one server only, so that a second server started with it on the same ports is refused in one
line and touches nothing of the first; a drain cut short by --drain-seconds, failing the requests in flight with a clear
error; the client's flags checked before it sends anything."""

import re
import signal
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from tests.test_serve import (
    NATIVE_ABORT,
    SIZE,
    Served,
    free_ports,
    inputs,
    needs_pytriton,
    plan_for,
    stop_duration,
    together,
)


class FakePool:
    """One worker, answering each batch with gray images."""

    def __init__(self):
        self.device = "cpu"
        self.workers = [self]

    def lend(self):
        import contextlib

        return contextlib.nullcontext(self)

    def __call__(self, requests):
        from demo.serve.batching import Generated

        return Generated(np.full((len(requests), requests[0].height, requests[0].width, 3), 128, np.uint8), 1.0)


def test_each_request_of_a_batch_is_answered_well_formed_on_its_own(tiny, capsys):
    """A good request batched with refused ones gets its image, and every answer's arrays can be laid out in memory
    as PyTriton sends them: a zero-size placeholder for a refused request's image broke the whole batch ("memoryview:
    cannot cast view with zeros in shape or strides")."""
    from demo.serve.schema import BAD_REQUEST, BATCH_SIZE, ERROR, ERROR_CODE, IMAGE
    from demo.serve.server import Server

    server = Server(FakePool(), plan_for(), verbose=False)
    batch = [SimpleNamespace(data=inputs(prompt="a", steps=2, height=SIZE, width=SIZE)),
             SimpleNamespace(data=inputs(prompt="b", steps=0)),
             SimpleNamespace(data=inputs(steps=2))]
    answers = server.answer("text-to-image", batch)
    assert answers[0][IMAGE].shape == (1, SIZE, SIZE, 3) and answers[0][ERROR][0, 0] == b""
    assert [(answer[ERROR][0, 0], answer[ERROR_CODE][0, 0]) for answer in answers[1:]] == [
        (b"steps must be at least 1, got 0", BAD_REQUEST.encode()), (b"prompt: required", BAD_REQUEST.encode())]
    for answer in answers:
        assert set(answer) == {IMAGE, BATCH_SIZE, ERROR, ERROR_CODE}
        for array in answer.values():
            memoryview(np.ascontiguousarray(array)).cast("B")
    assert "call 1, a batch of 1, on cpu" in capsys.readouterr().err  # not "batch 1 of 1"


def test_a_stopping_server_refuses_each_request(tiny):
    from demo.serve.schema import ERROR, ERROR_CODE, UNAVAILABLE
    from demo.serve.server import Server

    server = Server(FakePool(), plan_for(), verbose=False)
    server.stop_accepting("sd-serve is stopping (SIGTERM)")
    answers = server.answer("text-to-image", [SimpleNamespace(data=inputs(prompt="a"))] * 2)
    assert [(answer[ERROR][0, 0], answer[ERROR_CODE][0, 0]) for answer in answers] == [
        (b"sd-serve is stopping (SIGTERM)", UNAVAILABLE.encode())] * 2
    assert server.drain(0)  # nothing in flight


def test_a_port_is_claimed_by_one_server_only():
    from core.errors import UsageError
    from demo.serve.options import ServeOptions
    from demo.serve.server import claim_ports, port_lock_path

    http, grpc, metrics = free_ports(3)
    options = ServeOptions(http_port=http, grpc_port=grpc, metrics_port=metrics)
    with claim_ports(options):
        with pytest.raises(UsageError, match=rf"^{re.escape(f'http_port {http}: another sd-serve')}"):
            with claim_ports(options):
                pass
        with pytest.raises(UsageError, match=rf"^{re.escape(f'metrics_port {metrics}: another sd-serve')}"):
            with claim_ports(replace(options, http_port=free_ports(1)[0], grpc_port=free_ports(1)[0])):
                pass
    with claim_ports(options):  # released with the claim (and by the system, however the process ends)
        assert port_lock_path(http).exists()
    assert not any(port_lock_path(port).exists() for port in (http, grpc, metrics))  # no files left behind


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "--seed must be 0..18446744073709551615, got -1"),
    (["--seed", str(2**64)], f"--seed must be 0..18446744073709551615, got {2**64}"),
    (["--output-dir", "{file}"], "output directory '{file}' cannot be written: '{file}' is not a directory"),
])
def test_the_client_refuses_bad_flags_before_sending_anything(tmp_path, capsys, args, message):
    """Issue: --seed -1 was sent as 18446744073709551615 (and reported as -1); --output-dir naming a file was a
    FileExistsError's traceback once the server had made the image. Nothing listens on the client's address here: a
    request sent would be 'cannot reach the server', exit 1."""
    from demo.cli.client import main

    file = tmp_path / "a-file"
    file.write_text("")
    args = [arg.format(file=file) for arg in args]
    status = main(["a castle", "--url", f"127.0.0.1:{free_ports(1)[0]}", "--output-dir", str(tmp_path), *args])
    assert (status, capsys.readouterr().err) == (2, f"client: error: {message.format(file=file)}\n")


@needs_pytriton
def test_two_servers_on_the_same_ports_and_a_drain_cut_short(tmp_path):
    """Two sd-serve started together on the same ports (issue: the second one's PyTriton took the first one's Triton
    for its own, tried to unload its models, and ended in two chained tracebacks): one is refused at once, in one
    line, exit 2; the other serves. Then SIGINT to it, with --drain-seconds 1 and a long request in flight: the request
    fails with the stop's one line (503), the process exits 130 within 30 s, having said how long its stop took."""
    from demo.serve.client import ServeError

    ports = free_ports(3)
    servers = [Served(tmp_path, ports=ports, log=f"serve-{i}.log", args=("--drain-seconds", "1")) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while all(served.process.poll() is None for served in servers) and time.monotonic() < deadline:
            time.sleep(0.2)
        (loser,) = [served for served in servers if served.process.poll() is not None]
        (winner,) = [served for served in servers if served is not loser]
        assert loser.process.returncode == 2
        line = loser.text().split("...\n")[-1]  # after the built-in model's generation, on a cold cache
        assert line == f"sd-serve: error: --http-port {ports[0]}: another sd-serve on this machine has it\n"
        winner.wait_ready()
        assert winner.generate(prompt="a castle", seed=1)[0].shape == (SIZE, SIZE, 3)

        signalled = []

        def interrupt_then_ask():
            time.sleep(3)  # the long request running
            winner.process.send_signal(signal.SIGINT)
            signalled.append(time.monotonic())
            time.sleep(0.3)  # within the drain: queued behind the long request
            return winner.generate(prompt="late", seed=3)

        slow, late = together([lambda: winner.generate(prompt="slow", seed=2, scheduler="DDIM", denoising_steps=500),
                               interrupt_then_ask])
        assert isinstance(slow, ServeError) and slow.status == "503", slow
        assert str(slow) == ("sd-serve stopped (SIGINT) before this request finished: it waits 1 s for those in "
                             "flight")
        assert isinstance(late, ServeError) and late.status == "503", late
        assert str(late) == "sd-serve is stopping (SIGINT); send the request again elsewhere or later"
        assert winner.process.wait(30) == 128 + signal.SIGINT
        lived = time.monotonic() - signalled[0]
        assert lived < 30 and stop_duration(winner.text()) < 30
        assert "requests still running after 1 s: failing them" in winner.text()
        assert not NATIVE_ABORT.search(winner.text()), NATIVE_ABORT.search(winner.text())
    finally:
        for served in servers:
            served.stop()



def toy_answers(requests) -> list[dict]:
    """A stand-in for sd-serve's answers: x 0 an image; 1, 2 and 3 sd-serve's errors of each code; 4 an empty image,
    which PyTriton cannot send (it fails the whole batch)."""
    from demo.serve.schema import BAD_REQUEST, ERROR, ERROR_CODE, FAILED, UNAVAILABLE

    answers = []
    for request in requests:
        x = int(request.data["x"].reshape(-1)[0])
        code = {1: BAD_REQUEST, 2: FAILED, 3: UNAVAILABLE}.get(x, "")
        answers.append({"y": np.zeros((1, 0 if x == 4 else 2, 2, 3), np.uint8),
                        ERROR: np.array([[f"x {x}: refused" if code else ""]], np.bytes_),
                        ERROR_CODE: np.array([[code]], np.bytes_)})
    return answers


@needs_pytriton
def test_the_model_answers_each_error_as_tritons_own_and_never_a_traceback(tmp_path):
    """triton_model.py over PyTriton's proxy model: an error sd-serve answers is Triton's error of its code, its text
    the one line (PyTriton 0.7 alone failed the whole batch with HTTP 500 and a traceback); a batch PyTriton fails
    whole is one line too, its traceback kept in Triton's log."""
    import tritonclient.http
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonLifecyclePolicy
    from pytriton.utils.workspace import Workspace

    from demo.serve.server import answer_errors_alone, put_triton_libraries_first

    http, grpc, metrics = free_ports(3)
    put_triton_libraries_first()
    workspace = Workspace(tmp_path / "workspace")
    triton = Triton(config=TritonConfig(http_address="127.0.0.1", grpc_address="127.0.0.1",
                                        metrics_address="127.0.0.1", http_port=http, grpc_port=grpc,
                                        metrics_port=metrics, exit_timeout_secs=5),
                    workspace=workspace, triton_lifecycle_policy=TritonLifecyclePolicy(
                        launch_triton_on_startup=False, local_model_store=True))
    try:
        triton.bind("toy", toy_answers, inputs=[Tensor(name="x", dtype=np.int32, shape=(1,))],
                    outputs=[Tensor(name="y", dtype=np.uint8, shape=(-1, -1, 3))],
                    config=ModelConfig(max_batch_size=8, batcher=DynamicBatcher(max_queue_delay_microseconds=300_000)))
        answer_errors_alone(workspace.model_store_path, ["toy"])
        triton.run()

        def infer(x: int):
            client = tritonclient.http.InferenceServerClient(f"127.0.0.1:{http}")
            tensor = tritonclient.http.InferInput("x", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[x]], np.int32))
            try:
                return client.infer("toy", [tensor]).as_numpy("y").shape
            except tritonclient.utils.InferenceServerException as exc:
                return exc.status(), exc.message()
            finally:
                client.close()

        assert together([lambda x=x: infer(x) for x in range(4)]) == [  # one batch, each answered on its own
            (1, 2, 2, 3), ("400", "x 1: refused"), ("500", "x 2: refused"), ("503", "x 3: refused")]
        assert together([lambda: infer(0), lambda: infer(4)]) == [  # a batch PyTriton fails whole
            ("500", "the server failed this request (its log says why)")] * 2
        assert infer(0) == (1, 2, 2, 3)
    finally:
        triton.stop()


def fail_to_prepare():
    """A device's preparation failing as diffusers does on a truncated ControlNet's weights."""
    raise OSError("Unable to load weights from checkpoint file for 'cn/diffusion_pytorch_model.safetensors'")


def test_a_preparation_that_fails_is_one_line_naming_the_device():
    """Issue: `sd-serve --controlnet` with a folder whose weights were cut short was the server's traceback, pointing
    at the pipe it received the device process's exception from. A UsageError comes as it is
    (test_serve_workers.py)."""
    from core.errors import RunFailure
    from demo.serve.workers import start_workers

    with pytest.raises(RunFailure, match=r"^preparing the pipeline for cpu failed: OSError: Unable to load weights "
                                         r"from checkpoint file for 'cn/diffusion_pytorch_model.safetensors'$"):
        start_workers(["cpu"], lambda _: fail_to_prepare)
