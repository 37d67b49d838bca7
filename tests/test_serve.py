"""sd-serve (issue 21): requests checked as the CLI checks its flags, batches whose images equal the CLI's, a failing
request failing alone; then a real Triton server on loopback with `tiny` (where PyTriton is installed: the `serve`
extra): concurrent requests answered with the CLI's images, batching seen in the responses, the log and Triton's
metrics, bad requests answered with a 400 and one line naming the input (each input's wrong type, shape, value and
absence; a bad request batched with good ones failing alone) while the server goes on, img2img and inpaint (the latent
blend) answered with the CLI's images for --input-image and --mask-image, SIGTERM draining the requests in flight
with no native abort and the stop's true duration; one with
`tiny-inpaint` (a 9-channel UNet), which serves inpaint only; one with PyTriton installed outside site-packages; one
on the stand-in TensorRT's engines; and the check that Triton's Python backend, which ignores PYTHONPATH, can import
what PyTriton's proxy needs."""

import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT

NO_PYTRITON = importlib.util.find_spec("pytriton") is None
needs_pytriton = pytest.mark.skipif(NO_PYTRITON, reason="needs PyTriton and tritonclient: pip install -e '.[serve]' "
                                                        "(numpy 1.26.4; docs/serving.md)")
SIZE, STEPS = 64, 4


def plan_for(**spec):
    """What a server of `tiny` (torch backend, the CPU) checks requests with, and fills in what they leave out."""
    from demo.runtime.loader import plan_pipeline
    from demo.runtime.spec import PipelineSpec

    return plan_pipeline(PipelineSpec(**{"model": "tiny", "backend": "torch", **spec}), "cpu")


def text_request(tiny, **values):
    """A parsed text-to-image request."""
    from demo.request import Request

    return Request(**{"prompt": "a castle", "denoising_steps": STEPS, "height": SIZE, "width": SIZE,
                      **values}).resolved(tiny)


def inputs(**values) -> dict:
    """A request's inputs as Triton hands them to the server: [1, 1] arrays, images [1, H, W, 3] and masks [1, H, W]."""
    from demo.serve.schema import INPUTS

    dtypes = {item.name: item.dtype for item in INPUTS}
    return {name: np.asarray(value, dtypes[name])[None] if isinstance(value, np.ndarray) else
            np.array([[value.encode() if isinstance(value, str) else value]], dtypes[name])
            for name, value in values.items() if value is not None}


def random_pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def a_mask(height: int, width: int) -> np.ndarray:
    """White (repaint) in the middle, black (keep) around it."""
    mask = np.zeros((height, width), np.uint8)
    mask[height // 4: 3 * height // 4, width // 4: 3 * width // 4] = 255
    return mask


def as_server_names(cli_message: str) -> str:
    """A CLI usage error with each request field's flag (--denoising-steps, --input-image) as the server's input
    (steps, image)."""
    from demo.cli.command import flag_name
    from demo.serve.schema import INPUT_OF_FIELD

    for field, name in sorted(INPUT_OF_FIELD.items(), key=lambda item: -len(flag_name(item[0]))):
        cli_message = re.sub(re.escape(flag_name(field)) + r"\b", name, cli_message)
    return cli_message


@pytest.mark.parametrize("values, args", [
    ({"steps": 0}, ["--denoising-steps", "0"]),
    ({"steps": -5}, ["--denoising-steps", "-5"]),
    ({"steps": 5000}, ["--denoising-steps", "5000"]),
    ({"steps": 100_000_000}, ["--denoising-steps", "100000000"]),
    ({"height": 60}, ["--height", "60"]),
    ({"width": 4096}, ["--width", "4096"]),
    ({"guidance_scale": float("nan")}, ["--guidance-scale", "nan"]),
    ({"scheduler": "Nope"}, ["--scheduler", "Nope"]),
    ({"image": random_pixels(64, 64), "strength": 0.0}, ["--input-image", "{image}", "--strength", "0"]),
    ({"image": random_pixels(8, 8)}, ["--input-image", "{image}"]),
    ({"image": random_pixels(64, 64), "mask": a_mask(32, 64)}, ["--input-image", "{image}", "--mask-image", "{mask}"]),
])
def test_a_request_is_refused_as_the_cli_refuses_its_flags_naming_the_input(tiny, tmp_path, capsys, values, args):
    """The server's line for a bad value is the CLI's usage error for the same value, its flags named as the
    server's inputs."""
    from PIL import Image

    from demo.cli.generate import main
    from demo.serve.client import mode_of
    from demo.serve.schema import RequestRejected, parse_request

    files = {}
    for name in ("image", "mask"):
        if name in values:
            files[name] = str(tmp_path / f"{name}.png")
            Image.fromarray(values[name]).save(files[name])
    assert main(["a castle", "--model", "tiny", "--output-dir", str(tmp_path / "out"),
                 *(arg.format(**files) for arg in args)]) == 2
    cli_line = capsys.readouterr().err.strip().splitlines()[-1].removeprefix("demo-diffusion: error: ")
    with pytest.raises(RequestRejected) as refused:
        parse_request(inputs(**{"prompt": "a castle", **values}), plan_for(), mode=mode_of(values))
    assert str(refused.value) == as_server_names(cli_line)
    assert "\n" not in str(refused.value)


def test_a_prompt_that_is_not_utf8_is_refused_naming_it(tiny):
    from demo.serve.schema import RequestRejected, parse_request

    with pytest.raises(RequestRejected, match=r"^negative_prompt: not UTF-8 text$"):
        parse_request(inputs(prompt="a castle", negative_prompt=b"\xff\xfe"), plan_for())


def test_a_request_leaves_out_what_the_server_or_model_fills_in(tiny):
    from demo.serve.schema import RequestRejected, parse_request

    request = parse_request(inputs(prompt="a castle", seed=2**64 - 1), plan_for(height=48, scheduler="Euler"))
    assert (request.height, request.width, request.scheduler, request.seed) == (48, 64, "Euler", 2**64 - 1)
    assert (request.batch_size, request.denoising_steps, request.guidance_scale, request.negative_prompt) == (
        1, 50, 7.5, None)
    assert parse_request(inputs(prompt="a"), plan_for()).seed is not None  # a random one
    with pytest.raises(RequestRejected, match=r"^seed: one value per request \(shape \[1, 1\]\), got shape \[2, 1\]"):
        parse_request({**inputs(prompt="a"), "seed": np.array([[1], [2]], np.uint64)}, plan_for())


def test_a_request_without_guidance_gets_the_served_models_own():
    """shapes' server runs a request that leaves out guidance_scale at the model's 4 (tiny's: 7.5, above); a given
    one is kept."""
    from demo.serve.schema import parse_request

    plan = plan_for(model="shapes")
    assert parse_request(inputs(prompt="a red circle"), plan).guidance_scale == 3.0
    assert parse_request(inputs(prompt="a red circle", guidance_scale=7.5), plan).guidance_scale == 7.5


def test_engines_serve_their_size_and_guided_requests_only(tiny, monkeypatch):
    from demo.backends.tensorrt.options import EngineOptions
    from demo.serve.schema import RequestRejected, parse_request
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "8.6.0")
    plan = plan_for(backend="tensorrt", plugins="none", height=64, width=64, batch_size=1, max_batch_size=4,
                    engine=EngineOptions(optimization_level=0))
    assert parse_request(inputs(prompt="a", height=64), plan).height == 64
    with pytest.raises(RequestRejected, match=r"^height 128: the engines take 64 \(engines built with "
                                              r"build_dynamic_shape take any size\)"):
        parse_request(inputs(prompt="a", height=128), plan)
    with pytest.raises(RequestRejected, match=r"^guidance_scale 1.0: the engines were built for guided batches only"):
        parse_request(inputs(prompt="a", guidance_scale=1.0), plan)


def test_an_image_request_is_sized_and_checked_as_the_cli_checks_input_images(tiny):
    from demo.request import IMAGE_TO_IMAGE, INPAINTING
    from demo.serve.schema import RequestRejected, parse_request

    image, mask = random_pixels(60, 70), a_mask(60, 70)
    plan = plan_for(height=SIZE, width=SIZE)  # the server's size: for text-to-image only
    parsed = parse_request(inputs(prompt="a", image=image), plan, mode=IMAGE_TO_IMAGE)
    assert (parsed.height, parsed.width, parsed.strength, parsed.mask) == (56, 64, 0.8, None)
    assert np.array_equal(np.asarray(parsed.image), image)
    parsed = parse_request(inputs(prompt="a", image=image, mask=mask, height=32, strength=0.5), plan, mode=INPAINTING)
    assert (parsed.height, parsed.width, parsed.strength, parsed.mask.mode) == (32, 64, 0.5, "L")

    def refused(message: str, mode: str = INPAINTING, **values) -> None:
        with pytest.raises(RequestRejected, match="^" + re.escape(message)):
            parse_request(inputs(**{"prompt": "a", "image": image, "mask": mask, **values}), plan, mode=mode)

    refused("strength must be more than 0 and at most 1, got 0.0", strength=0.0)
    refused("strength 0.1 leaves none of the 4 denoising steps to run; raise strength or steps", strength=0.1,
            steps=4)
    refused("mask is 70x30, image 70x60: the mask must have the image's proportions", mask=a_mask(30, 70))
    refused("image is 5000x60; model 'tiny' takes", image=random_pixels(60, 5000), mask=a_mask(60, 5000))
    refused("mask: required", mask=None)
    refused("image: one image per request (shape [1, H, W, 3]), got shape [1, 60, 70, 4]", mode=IMAGE_TO_IMAGE,
            image=np.zeros((60, 70, 4), np.uint8))
    refused("image: one image per request (shape [1, H, W, 3]), got shape [1, 0, 70, 3]", mode=IMAGE_TO_IMAGE,
            image=np.zeros((0, 70, 3), np.uint8))


def test_image_requests_each_run_alone(tiny):
    from demo.request import IMAGE_TO_IMAGE
    from demo.serve.batching import Generated, run_requests
    from demo.serve.schema import parse_request

    same = inputs(prompt="a", image=random_pixels(SIZE, SIZE), seed=1, steps=STEPS)
    parsed = [parse_request(same, plan_for(), mode=IMAGE_TO_IMAGE) for _ in range(3)]
    outcomes = run_requests(parsed, lambda requests: Generated(np.zeros((len(requests), 8, 8, 3), np.uint8), 1.0))
    assert [o.batch_size for o in outcomes] == [1, 1, 1]  # one input image per pipeline call


def test_requests_batch_only_with_their_like_and_a_failing_one_fails_alone(tiny):
    from demo.serve.batching import Generated, run_requests
    from demo.serve.schema import RequestRejected

    calls = []

    def generate(requests):
        calls.append([r.prompt for r in requests])
        if any(r.prompt == "boom" for r in requests):
            raise RuntimeError("CUDA out of memory\nmore detail")
        return Generated(np.zeros((len(requests), 8, 8, 3), np.uint8), 1.0)

    parsed = [text_request(tiny, prompt="a", seed=1), text_request(tiny, prompt="b", seed=2, height=48),
              RequestRejected("steps must be at least 1, got 0"), text_request(tiny, prompt="c", seed=3),
              text_request(tiny, prompt="d", seed=4, guidance_scale=5.0),
              text_request(tiny, prompt="e", seed=5, negative_prompt="blurry")]
    outcomes = run_requests(parsed, generate)
    assert calls == [["a", "c"], ["b"], ["d"], ["e"]]  # one call per size, guidance, negative prompts given or not
    assert [o.batch_size for o in outcomes] == [2, 1, 0, 2, 1, 1]
    assert outcomes[2].error == "steps must be at least 1, got 0" and outcomes[2].image is None

    calls.clear()
    parsed = [text_request(tiny, prompt=p, seed=i) for i, p in enumerate(["a", "boom", "c"])]
    outcomes = run_requests(parsed, generate)
    assert calls == [["a", "boom", "c"], ["a"], ["boom"], ["c"]]  # the batch failed: each again alone
    assert [o.error for o in outcomes] == [None, "RuntimeError: CUDA out of memory", None]
    assert [o.batch_size for o in outcomes] == [1, 0, 1]


def test_a_batch_draws_each_image_from_its_own_seed(tiny):
    """A batch with different seeds and a stochastic scheduler (its noise drawn per step) gives each request the
    image it gets alone."""
    from demo.request import TEXT_TO_IMAGE
    from demo.serve.batching import ServedPipeline

    served = ServedPipeline(plan_for(modes=(TEXT_TO_IMAGE,)).load())
    requests = [text_request(tiny, prompt=f"a photo {seed}", seed=seed, scheduler="EulerA") for seed in (3, 1, 2)]
    generated = served(requests)
    batched = generated.images
    alone = np.concatenate([served([request]).images for request in requests])
    assert generated.pipeline_milliseconds > 0
    assert batched.shape == (3, SIZE, SIZE, 3) and batched.dtype == np.uint8
    assert np.abs(batched.astype(int) - alone.astype(int)).max() <= 2
    assert np.abs(batched[0].astype(int) - batched[1].astype(int)).max() > 20  # different seeds, different images


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for probe in sockets:
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in sockets]
    for probe in sockets:
        probe.close()
    return ports


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0"], "--gpus: there is no CUDA GPU here"),
    (["--max-batch-size", "0"], "--max-batch-size must be at least 1, got 0"),
    (["--max-batch-size", "2", "--opt-batch-size", "3"],
     "--opt-batch-size must be at most --max-batch-size (2), got 3"),
    (["--height", "60"], "--height must be a multiple of 8, got 60"),
    (["--http-port", "70000"], "--http-port must be 1..65535, got 70000"),
    (["--grpc-port", "-1"], "--grpc-port must be 1..65535, got -1"),
    (["--metrics-port", "0"], "--metrics-port must be 1..65535, got 0"),
    (["--max-queue-delay-ms", "nan"], "--max-queue-delay-ms must be a finite number from 0 to 60000, got nan"),
    (["--max-queue-delay-ms", "inf"], "--max-queue-delay-ms must be a finite number from 0 to 60000, got inf"),
    (["--max-queue-delay-ms", "-1"], "--max-queue-delay-ms must be a finite number from 0 to 60000, got -1.0"),
    (["--drain-seconds", "nan"], "--drain-seconds must be a finite number, 0 or more, got nan"),
    (["--drain-seconds", "-1"], "--drain-seconds must be a finite number, 0 or more, got -1.0"),
    (["--cache-interval", "0"], "--cache-interval must be at least 1, got 0"),
    (["--build-static-batch"], "engines need a batch range; drop --build-static-batch"),
    (["--use-cuda-graph"], "CUDA graphs on the torch backend only (a graph per batch size; engines need a batch "
                           "range): give --backend torch or drop --use-cuda-graph"),
    (["--backend", "tensorrt", "--use-cuda-graph"], "give --backend torch or drop --use-cuda-graph"),
    (["--cache-interval", "3", "--cache-branch", "6"], "--cache-branch 6: this UNet's skip branches are 0 to 5"),
])
def test_sd_serve_refuses_bad_flags_in_one_line(args, message, capsys):
    """One line, exit 2, before anything loads (issue: ports out of range were an OverflowError's traceback, port 0
    failed after 263 s, a queue delay of nan or inf a traceback once everything was prepared)."""
    import torch

    from demo.cli.serve import main

    if args[0] == "--gpus" and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    http, grpc, metrics = free_ports(3)
    assert main(["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), *args]) == 2
    err = capsys.readouterr().err.split("...\n")[-1]  # after the built-in model's generation, on a cold cache
    assert err.startswith("sd-serve: error: ") and message in err and err.count("\n") == 1, err


def test_sd_serve_refuses_a_port_taken(capsys):
    from demo.cli.serve import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        grpc, metrics = free_ports(2)
        assert main(["--http-port", str(port), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]) == 2
    assert f"--http-port {port} on 127.0.0.1: cannot listen" in capsys.readouterr().err


class Served:
    """An sd-serve process on loopback, its log in a file."""

    def __init__(self, tmp_path, model: str = "tiny", max_batch_size: int = 4, env: dict | None = None,
                 args: tuple = (), ports: list[int] | None = None, log: str = "serve.log"):
        self.http, self.grpc, self.metrics = ports or free_ports(3)
        self.log = tmp_path / log
        command = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", model, "--height", str(SIZE),
                   "--width", str(SIZE), "--max-batch-size", str(max_batch_size), "--max-queue-delay-ms", "500",
                   "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
                   *args]
        with open(self.log, "w") as log:  # the child has its own copy
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                            start_new_session=True, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"sd-serve exited {self.process.returncode}:\n{self.text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"sd-serve not ready in {timeout} s:\n{self.text()[-3000:]}")

    def generate(self, protocol: str = "http", **values):
        from demo.serve.client import connect, generate

        module, client = connect(f"127.0.0.1:{self.http if protocol == 'http' else self.grpc}", protocol)
        try:
            return generate(module, client, {"denoising_steps": STEPS, **values})
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM, then (past 40 s) SIGKILL to the whole session it started: nothing it started outlives a test."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(40)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A drain longer than the default: on a busy 2-core machine the requests in flight at its SIGTERM (last) take
    # seconds.
    served = Served(tmp_path_factory.mktemp("serve"), args=("--drain-seconds", "20"))
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


def cli_image(tmp_path, prompt: str, seed: int, model: str = "tiny", image=None, mask=None,
              args=("--height", str(SIZE), "--width", str(SIZE))) -> np.ndarray:
    """demo-diffusion's image, with --input-image and --mask-image (PNGs of `image` and `mask`) where given."""
    from PIL import Image

    from demo.cli.generate import main

    out = tmp_path / f"cli-{model}-{seed}"
    files = []
    for option, pixels in (("--input-image", image), ("--mask-image", mask)):
        if pixels is not None:
            path = tmp_path / f"{option[2:]}-{seed}.png"
            Image.fromarray(pixels).save(path)
            files += [option, str(path)]
    assert main([prompt, "--model", model, "--seed", str(seed), "--denoising-steps", str(STEPS), *args, *files,
                 "--num-warmup-runs", "0", "--output-dir", str(out)]) == 0
    return np.asarray(Image.open(out / f"{model}-seed{seed}-0.png"))


def differs(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def together(calls) -> list:
    """Run the calls at once, each in its own thread (so their requests arrive together): what each returned, or the
    exception it raised."""
    def outcome(call):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 -- the caller looks at it
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(outcome, calls))


@needs_pytriton
def test_concurrent_requests_are_batched_and_answered_with_the_clis_images(server, tmp_path):
    seeds = [11, 0, 2**40 + 3, 7]
    answers = together([lambda seed=seed, i=i: server.generate("grpc" if i % 2 else "http", prompt=f"a photo {seed}",
                                                               seed=seed) for i, seed in enumerate(seeds)])
    for seed, (image, _) in zip(seeds, answers):
        assert image.shape == (SIZE, SIZE, 3) and image.dtype == np.uint8
        assert np.abs(image.astype(int) - cli_image(tmp_path, f"a photo {seed}", seed).astype(int)).max() <= 2, seed
    # They arrived within the 500 ms queue delay: one pipeline call ran them all, as the responses, the log and
    # Triton's metrics say.
    assert [batch for _, batch in answers] == [4] * 4
    calls = re.findall(r"sd-serve: request \d+ 64x64 steps 4 seed \d+: call \d+, a batch of 4, on cpu, ([\d.]+) ms "
                       r"\(pipeline ([\d.]+) ms\)", server.text())
    assert len(calls) >= 4
    assert all(0 < float(pipeline) <= float(call) for call, pipeline in calls), calls
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    counts = {name: float(re.search(rf'^{name}{{model="txt2img",version="1"}} ([\d.]+)$', metrics, re.M).group(1))
              for name in ("nv_inference_count", "nv_inference_exec_count")}
    assert counts["nv_inference_count"] >= counts["nv_inference_exec_count"] + 3, counts


@needs_pytriton
def test_bad_requests_get_an_error_naming_the_input_and_the_server_goes_on(server):
    from demo.serve.client import ServeError

    for protocol, status in (("http", "400"), ("grpc", "StatusCode.INVALID_ARGUMENT")):  # alone in its batch
        with pytest.raises(ServeError, match="^steps must be at least 1, got 0$") as refused:
            server.generate(protocol, prompt="a", seed=1, denoising_steps=0)
        assert refused.value.status == status
    good, bad = together([lambda: server.generate(prompt="a", seed=1),
                          lambda: server.generate(prompt="b", seed=2, height=60)])  # one batch
    assert good[0].shape == (SIZE, SIZE, 3) and good[1] == 1
    assert isinstance(bad, ServeError) and str(bad) == "height must be a multiple of 8, got 60"
    assert bad.status == "400"
    assert server.generate(prompt="still here", seed=3)[0].shape == (SIZE, SIZE, 3)
    assert "request" in server.text() and "failed: height must be a multiple of 8, got 60" in server.text()


def post(port: int, model: str, body: dict) -> tuple[int, dict]:
    """An HTTP request of the KServe v2 JSON protocol, as curl sends it: the status and the JSON answer."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/infer",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@needs_pytriton
def test_a_bad_request_is_a_400_with_one_line_and_nothing_of_the_server(server):
    """Issue: the answer was HTTP 500, its text a traceback naming the server's files."""
    status, answer = post(server.http, "txt2img", {"inputs": [
        {"name": "prompt", "datatype": "BYTES", "shape": [1, 1], "data": ["a castle"]},
        {"name": "steps", "datatype": "INT32", "shape": [1, 1], "data": [-5]}]})
    assert (status, answer) == (400, {"error": "steps must be at least 1, got -5"})
    status, answer = post(server.http, "txt2img", {"inputs": [
        {"name": "steps", "datatype": "INT32", "shape": [1, 1], "data": [4]}]})
    assert (status, answer) == (400, {"error": "prompt: required"})


def wrong_type(item) -> np.ndarray:
    """A value of another type than `item` takes, in its shape."""
    if item.shape != (1,):
        return np.zeros((1, SIZE, SIZE, 3)[:1 + len(item.shape)], np.float32)
    return np.array([[b"x"]]) if item.dtype is np.float32 else np.array([[1.5]], np.float32)


def wrong_shape(item) -> np.ndarray:
    """A value of `item`'s type in another shape: two values, an image of four channels, a mask of three."""
    if item.shape != (1,):
        return np.zeros((1, SIZE, SIZE, 4) if item.name == "image" else (1, SIZE, SIZE, 3), np.uint8)
    return np.array([[b"a", b"b"]]) if item.dtype is np.bytes_ else np.zeros((1, 2), item.dtype)


# A value out of each input's range (seed: every UINT64 is one), and the server's line for it.
OUT_OF_RANGE = {
    "prompt": (b"\xff\xfe", "prompt: not UTF-8 text"),
    "negative_prompt": (b"\xff", "negative_prompt: not UTF-8 text"),
    "steps": (-5, "steps must be at least 1, got -5"),
    "guidance_scale": (float("nan"), "guidance_scale must be a finite number, 0 or more, got nan"),
    "height": (60, "height must be a multiple of 8, got 60"),
    "width": (4096, "width 4096 is outside model 'tiny' range 32..128"),
    "scheduler": (b"Nope", "scheduler 'Nope' is unknown"),
    "image": (random_pixels(8, 8), "image is 8x8; model 'tiny' takes 32..128 pixels a side"),
    "mask": (a_mask(32, SIZE), f"mask is {SIZE}x32, image {SIZE}x{SIZE}: the mask must have the image's proportions"),
    "strength": (0.0, "strength must be more than 0 and at most 1, got 0.0"),
}


def infer_raw(server, model: str, arrays: dict):
    """`arrays` (the batch dimension first) to `model` through tritonclient: the image, or the server's (status,
    message)."""
    import tritonclient.http
    import tritonclient.utils

    datatypes = {"S": "BYTES", "O": "BYTES"}
    client = tritonclient.http.InferenceServerClient(f"127.0.0.1:{server.http}", network_timeout=600)
    try:
        tensors = []
        for name, array in arrays.items():
            datatype = datatypes.get(array.dtype.kind) or tritonclient.utils.np_to_triton_dtype(array.dtype)
            tensor = tritonclient.http.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array.astype(object) if datatype == "BYTES" else array)
            tensors.append(tensor)
        return client.infer(model, tensors).as_numpy("image")
    except tritonclient.utils.InferenceServerException as exc:
        return exc.status(), exc.message()
    finally:
        client.close()


@needs_pytriton
@pytest.mark.parametrize("model", ["txt2img", "img2img", "inpaint"])
def test_each_input_of_wrong_type_shape_or_value_or_missing_is_refused_naming_it(server, model):
    """Every input of the model's schema, sent a wrong type, a wrong shape, a value out of range, and left out where
    it is required, all at once (batched with each other and a good request, each judged on its own): a 400 with one
    line naming the input, nothing of the server's internals; the good request gets its image, and so does the next
    one."""
    from demo.serve.schema import MODEL_MODES, inputs_of

    mode = MODEL_MODES[model]
    good = {"prompt": np.array([[b"a castle"]]), "steps": np.array([[2]], np.int32),
            "seed": np.array([[1]], np.uint64)}
    if model != "txt2img":
        good["image"] = random_pixels(SIZE, SIZE)[None]
    if model == "inpaint":
        good["mask"] = a_mask(SIZE, SIZE)[None]
    bad = {}
    for item in inputs_of(mode):
        bad[f"{item.name}: wrong type"] = (item.name, {**good, item.name: wrong_type(item)})
        bad[f"{item.name}: wrong shape"] = (item.name, {**good, item.name: wrong_shape(item)})
        if item.name in OUT_OF_RANGE:
            value = OUT_OF_RANGE[item.name][0]
            bad[f"{item.name}: out of range"] = (item.name, {**good, item.name: np.asarray(value, item.dtype)[None]
                                                             if isinstance(value, np.ndarray) else
                                                             np.array([[value]], item.dtype)})
        if not item.optional:
            bad[f"{item.name}: missing"] = (item.name, {k: v for k, v in good.items() if k != item.name})
    answers = together([lambda arrays=arrays: infer_raw(server, model, arrays) for _, arrays in bad.values()]
                       + [lambda: infer_raw(server, model, good)])
    for (case, (name, _)), answer in zip(bad.items(), answers):
        assert isinstance(answer, tuple), f"{case}: answered {answer!r}"
        status, message = answer
        assert status.startswith("4") and "\n" not in message and name in message, (case, answer)
        assert not re.search(r"Traceback|\.py\b|site-packages|/", message), (case, message)
        if case.endswith("out of range"):
            assert message.startswith(OUT_OF_RANGE[name][1]), (case, message)
        if case.endswith("missing"):
            assert message == f"{name}: required", (case, message)
    assert answers[-1].shape == (1, SIZE, SIZE, 3)
    assert infer_raw(server, model, good).shape == (1, SIZE, SIZE, 3)


def peak_memory_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status.read(), re.M).group(1))


@needs_pytriton
def test_a_huge_steps_is_refused_at_once(server):
    """Issue: steps 100000000 was refused only after 21.8 s, the server's memory grown by 3 GB (a schedule that
    long built to be checked)."""
    from demo.serve.client import ServeError

    before = peak_memory_kib(server.process.pid)
    started = time.monotonic()
    with pytest.raises(ServeError, match=r"^steps 100000000 is more than scheduler \w+ can take") as refused:
        server.generate(prompt="a", seed=1, denoising_steps=100_000_000)
    assert refused.value.status == "400" and time.monotonic() - started < 30
    assert peak_memory_kib(server.process.pid) - before < 300 * 1024


@needs_pytriton
def test_a_good_request_batched_with_a_refused_one_gets_its_image(server):
    """Issue: with the pipeline busy, a steps-2 and a steps-0 request arriving together both failed (a zero-size
    image in the refused one's outputs broke the batch's serialization)."""
    from demo.serve.client import ServeError

    answers = together([lambda: server.generate(prompt="busy", seed=1, denoising_steps=STEPS),
                        lambda: (time.sleep(1.0), server.generate(prompt="good", seed=2, denoising_steps=2))[1],
                        lambda: (time.sleep(1.0), server.generate(prompt="bad", seed=3, denoising_steps=0))[1]])
    assert [answer[0].shape for answer in answers[:2]] == [(SIZE, SIZE, 3)] * 2, answers
    assert isinstance(answers[2], ServeError) and answers[2].status == "400"
    assert str(answers[2]) == "steps must be at least 1, got 0"


@needs_pytriton
def test_the_client_writes_the_png(server, tmp_path):
    from PIL import Image

    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "client.py"), "a red apple", "--url",
                             f"127.0.0.1:{server.http}", "--seed", "5", "--denoising-steps", str(STEPS),
                             "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert Image.open(tmp_path / "txt2img-seed5.png").size == (SIZE, SIZE)
    Image.fromarray(random_pixels(48, 40)).save(tmp_path / "in.png")
    Image.fromarray(a_mask(48, 40)).convert("RGB").save(tmp_path / "mask.png")  # made grayscale, as the CLI does
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "client.py"), "a red apple", "--url",
                             f"127.0.0.1:{server.http}", "--seed", "5", "--denoising-steps", str(STEPS),
                             "--input-image", str(tmp_path / "in.png"), "--mask-image", str(tmp_path / "mask.png"),
                             "--strength", "0.9", "--output-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert Image.open(tmp_path / "inpaint-seed5.png").size == (40, 48)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "client.py"), "a", "--url",
                             f"127.0.0.1:{server.http}", "--width", "4096"], capture_output=True, text=True,
                            timeout=120)  # the model's range: the server's check
    assert result.returncode == 1 and result.stderr == ("client: error: width 4096 is outside model 'tiny' range "
                                                        "32..128\n"), result.stderr


@needs_pytriton
def test_img2img_and_inpaint_answer_with_the_clis_images_each_run_alone(server, tmp_path):
    """An ordinary model serves img2img and inpaint (the latent blend): each request the CLI's image for
    --input-image [--mask-image], sized as it sizes them (the image's own size, rounded down to a multiple of 8),
    and each in a pipeline call of its own."""
    image, mask = random_pixels(60, 68), a_mask(60, 68)
    answers = together([lambda: server.generate(prompt="a castle", seed=5, image=image, strength=0.6),
                        lambda: server.generate(prompt="a castle", seed=5, image=image),
                        lambda: server.generate(prompt="a tree", seed=6, image=image, mask=mask,
                                                scheduler="EulerA")])
    assert [batch for _, batch in answers] == [1, 1, 1]
    assert answers[0][0].shape == (56, 64, 3)
    assert differs(answers[0][0], cli_image(tmp_path, "a castle", 5, image=image, args=("--strength", "0.6"))) <= 2
    assert differs(answers[0][0], answers[1][0]) > 20  # strength 0.8 (the default) re-draws more
    assert differs(answers[2][0], cli_image(tmp_path, "a tree", 6, image=image, mask=mask,
                                            args=("--scheduler", "EulerA"))) <= 2


@needs_pytriton
def test_sd_serve_starts_with_pytriton_installed_outside_site_packages(tmp_path):
    """Where the serve wheels go in with `pip install --target` onto PYTHONPATH: PyTriton then looks for its bundled
    libraries in the wrong folder, and tritonserver could not load libcudart (2026-11-26)."""
    import pytriton

    installed = Path(pytriton.__file__).parent.parent
    elsewhere = tmp_path / "site"
    elsewhere.mkdir()
    for name in ("pytriton", "nvidia_pytriton.libs"):
        (elsewhere / name).symlink_to(installed / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(elsewhere), os.environ.get("PYTHONPATH")]))}
    found = subprocess.run([sys.executable, "-c", "import pytriton; print(pytriton.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert found.startswith(str(elsewhere))
    served = Served(tmp_path, max_batch_size=1, env=env)
    try:
        served.wait_ready(timeout=180)
        assert served.generate(prompt="a red apple", seed=0)[0].shape == (SIZE, SIZE, 3)
    finally:
        served.stop()


# Every process of the server below (itself and its pipeline's worker, which the spawn start method makes a fresh
# interpreter) takes the stand-in TensorRT this way, before anything imports `tensorrt`; Triton's Python-backend stub
# runs isolated from PYTHONPATH and never sees it.
STAND_IN_TENSORRT = """
import pytest
from tests import fake_tensorrt
patch = pytest.MonkeyPatch()  # never undone: the process is the test's server
fake_tensorrt.install(patch, "8.6.0")  # engines "for this GPU", and run here, as on an H100
"""


@needs_pytriton
def test_engines_behind_the_server_answer_with_the_clis_images_on_engines(tmp_path, monkeypatch):
    """sd-serve --backend tensorrt on the stand-in TensorRT (ONNX Runtime runs the engines): it builds engines for a
    batch range before it is ready, batches requests arriving together into one engine call, and answers each with
    the image the CLI draws; a request of another size is refused naming the engines' size. With --max-batch-size 4
    and the default --opt-batch-size 1, its engines are the CLI's: the CLI finds them and builds none."""
    from PIL import Image

    from demo.cli.generate import main
    from demo.serve.client import ServeError
    from tests import fake_tensorrt

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STAND_IN_TENSORRT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT),
                                                                     os.environ.get("PYTHONPATH")]))}
    served = Served(tmp_path, env=env, args=("--backend", "tensorrt"))
    try:
        served.wait_ready()
        seeds = [4, 9, 2]
        answers = together([lambda seed=seed: served.generate(prompt=f"a boat {seed}", seed=seed) for seed in seeds])
        with pytest.raises(ServeError, match=r"^height 32: the engines take 64"):
            served.generate(prompt="a", seed=1, height=32)
    finally:
        served.stop()
    assert "model tiny, backend tensorrt (requested" in served.text() and (tmp_path / "engine").is_dir()
    assert "Warning" not in served.text()  # the export's, in the pipeline's process: quiet unless --verbose, as the CLI
    assert [batch for _, batch in answers] == [3] * 3
    fake_tensorrt.install(monkeypatch, "8.6.0")
    monkeypatch.chdir(tmp_path)  # the server's folders, as it named them (the stand-in's engines name their ONNX)
    built = {path: path.stat().st_mtime_ns for path in Path("engine").glob("*.engine")}
    for seed, (image, _) in zip(seeds, answers):
        out = tmp_path / f"cli-{seed}"
        assert main([f"a boat {seed}", "--model", "tiny", "--backend", "tensorrt", "--seed", str(seed),
                     "--denoising-steps", str(STEPS), "--height", str(SIZE), "--width", str(SIZE),
                     "--num-warmup-runs", "0", "--output-dir", str(out)]) == 0
        expected = np.asarray(Image.open(out / f"tiny-seed{seed}-0.png"))
        assert image.shape == expected.shape == (SIZE, SIZE, 3) and differs(image, expected) <= 2, seed
    assert differs(answers[0][0], answers[1][0]) > 20  # real, different pictures
    assert len(built) == 4 and {path: path.stat().st_mtime_ns for path in built} == built  # the VAE encoder's too
    assert sorted(Path("engine").glob("*.engine")) == sorted(built)


def test_sd_serve_refuses_a_python_whose_isolated_self_lacks_the_proxys_modules(tmp_path):
    """Triton's Python-backend stub ignores PYTHONPATH: numpy and zmq found only there (`pip install --target`) made
    every model fail to load (2026-11-26). An interpreter without its site-packages stands in for that one."""
    from core.errors import UsageError
    from demo.serve.server import check_python_backend

    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    with pytest.raises(UsageError, match="cannot import numpy and zmq"):
        check_python_backend(str(bare))


@needs_pytriton
def test_this_python_passes_the_python_backend_check():
    from demo.serve.server import check_python_backend

    check_python_backend()


@pytest.fixture(scope="module")
def inpaint_server(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("serve-inpaint"), "tiny-inpaint")
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


@needs_pytriton
def test_an_inpainting_model_serves_inpaint_only_with_the_clis_images(inpaint_server, tmp_path):
    from demo.serve.client import ServeError

    image, mask = random_pixels(SIZE, SIZE, seed=1), a_mask(SIZE, SIZE)
    for seed, strength in ((9, 0.75), (10, None)):  # a noised input image; from noise (the UNet sees it masked)
        answer, batch = inpaint_server.generate(prompt="a castle", seed=seed, image=image, mask=mask,
                                                strength=strength)
        expected = cli_image(tmp_path, "a castle", seed, "tiny-inpaint", image, mask,
                             ("--strength", str(strength)) if strength else ())
        assert batch == 1 and differs(answer, expected) <= 2, strength
    for values in ({}, {"image": image}):
        with pytest.raises(ServeError, match="unknown model|not found"):
            inpaint_server.generate(prompt="a", seed=1, **values)


@needs_pytriton
def test_the_load_test_reports_throughput_latency_and_batch_sizes(server, tmp_path):
    import json

    from bench.loadtest import main

    assert main(["--url", f"127.0.0.1:{server.http}", "--concurrency", "4", "--requests", "8", "--denoising-steps",
                 "2", "--sizes", "64x64,48x48", "--results-dir", str(tmp_path), "--name", "t"]) == 0
    report = json.loads((tmp_path / "loadtest-t.json").read_text())
    assert (report["requests"], report["answered"], report["errors"]) == (8, 8, 0)
    assert report["sizes"] == ["48x48", "64x64"] and report["latency_ms"]["p50"] > 0
    assert sum(report["batch_sizes"].values()) == 8 and max(map(int, report["batch_sizes"])) >= 2
    assert report["images_per_s"] > 0 and (tmp_path / "loadtest-t.png").stat().st_size > 0


def stop_duration(log: str) -> float:
    return float(re.search(r"\[sd-serve\] stopped in ([\d.]+) s", log).group(1))


NATIVE_ABORT = re.compile(r"Exit timeout expired|terminate called|failed to stop server|Traceback")


@needs_pytriton
def test_sigterm_drains_the_requests_in_flight_and_refuses_new_ones(server):
    """Last: it stops the module's server. Issue: Triton waited out its exit timeout on a client's open connection,
    aborted (a native crash) and the process lived 30.3 s while it said "stopped in 24.0 s"."""
    import http.client

    from demo.serve.client import ServeError

    idle = http.client.HTTPConnection("127.0.0.1", server.http)  # a client's keep-alive connection, left open
    idle.request("GET", "/v2/health/ready")
    assert idle.getresponse().status == 200
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = [pool.submit(server.generate, prompt="slow", seed=seed, denoising_steps=2) for seed in (1, 2)]
        time.sleep(1.5)  # queued, batched, running
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(ServeError) as refused:  # while they run, a 503; once Triton stops, a connection closed
            server.generate(prompt="late", seed=3)
        assert refused.value.status in ("503", None), refused.value
        assert [future.result()[0].shape for future in in_flight] == [(SIZE, SIZE, 3)] * 2
    assert server.process.wait(30) == 128 + signal.SIGTERM
    lived = time.monotonic() - signalled
    idle.close()
    assert lived < 30
    log = server.text()
    assert "SIGTERM: refusing new requests, finishing those in flight (at most 20 s)" in log
    assert not NATIVE_ABORT.search(log), NATIVE_ABORT.search(log)
    assert lived - 2 < stop_duration(log) <= lived + 0.1  # the whole stop, to the process's end (rounded)


def test_a_controlnet_server_takes_a_control_image_per_controlnet_and_refuses_one_missing(tiny):
    """With --controlnet, each model takes control_image_<i> (one per ControlNet, in order) and the ControlNet fields;
    a request without its control image is refused naming the input; without ControlNets no model has them."""
    from demo.request import INPAINTING, TEXT_TO_IMAGE
    from demo.serve.schema import RequestRejected, inputs_of, parse_request

    plain = {item.name for item in inputs_of(TEXT_TO_IMAGE)}
    assert not any(name.startswith("control") or name == "guess_mode" for name in plain)
    names = [item.name for item in inputs_of(INPAINTING, 2)]
    assert names[-2:] == ["control_image_0", "control_image_1"] and "guess_mode" in names
    plan = plan_for(controlnets=(("tiny-controlnet", 0.5),))
    control = random_pixels(SIZE, SIZE, seed=3)
    request = parse_request({**inputs(prompt="a castle", control_guidance_end=0.6),
                             "control_image_0": control[None], "guess_mode": np.array([[True]])}, plan)
    assert np.array_equal(np.asarray(request.control_images[0]), control)
    assert (request.control_guidance_end, request.guess_mode) == (0.6, True)
    with pytest.raises(RequestRejected, match="^control_image_0: required$"):
        parse_request(inputs(prompt="a castle"), plan)


@needs_pytriton
def test_a_controlnet_server_batches_its_requests_and_answers_with_the_clis_images(tmp_path):
    """sd-serve --controlnet: requests with their own control images arrive together and run as one batch, each
    image the CLI's with the same ControlNet and control image; one without its control image is refused alone."""
    from PIL import Image

    from demo.serve.client import ServeError

    served = Served(tmp_path, args=("--controlnet", "tiny-controlnet:0.5"), log="serve-controlnet.log")
    try:
        served.wait_ready()
        controls, seeds = [random_pixels(SIZE, SIZE, seed=seed) for seed in (3, 4)], [5, 6]
        answers = together([lambda i=i: served.generate(prompt=f"a castle {i}", seed=seeds[i],
                                                        control_images=[controls[i]]) for i in range(2)])
        assert [batch for _, batch in answers] == [2, 2]
        for i, (image, _) in enumerate(answers):
            control = tmp_path / f"control-{i}.png"
            Image.fromarray(controls[i]).save(control)
            expected = cli_image(tmp_path, f"a castle {i}", seeds[i], args=(
                "--height", str(SIZE), "--width", str(SIZE), "--controlnet", "tiny-controlnet:0.5",
                "--control-image", str(control)))
            assert differs(image, expected) <= 2, i
        plain = tmp_path / "plain"
        plain.mkdir()
        assert differs(answers[0][0], cli_image(plain, "a castle 0", seeds[0])) > 2  # the ControlNet steered it
        with pytest.raises(ServeError, match="control_image_0"):
            served.generate(prompt="a castle", seed=1)
    finally:
        served.stop()
