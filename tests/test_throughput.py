"""The throughput path (demo.pipelines.stream through Pipeline.run_stream) and sd-throughput (bench.throughput) on
the CPU: a stream's images are each batch's alone (same seeds), in either mode, for one request of several images and
for several one-image requests (sd-serve's calls); the command's table, JSON and chart with their fields, its rows
kept across runs, a batch that does not fit (its memory floor, or out of memory at run time) reported while the sweep
goes on; engines (the stand-in TensorRT) through the stream, never overlapped, and every batch size of their range,
one above it refused; MLPerf's settings, and bad flags (exit 2). The overlapped stream on CUDA:
tests/test_throughput_gpu.py."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from bench import throughput
from bench.common import slug
from demo import PipelineSpec, load_pipeline
from demo.pipelines.stream import BatchStream
from demo.request import TEXT_TO_IMAGE, Request
from demo.runtime.report import device_name

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path; the GPU test runs the real one")

COMMON = ["--model", "tiny", "--denoising-steps", "2", "--seed", "5", "--scheduler", "Euler", "--warmup-batches", "0",
          "--batches", "2"]
STEM = "throughput-" + slug(device_name(torch.device("cpu")))


@pytest.fixture(scope="module")
def pipe(tiny):
    with load_pipeline(PipelineSpec(model="tiny", backend="torch")) as pipeline:
        yield pipeline


@pytest.mark.parametrize("overlap", [True, False])
def test_a_stream_gives_each_batch_its_images_alone(pipe, overlap):
    request = pipe.request("a red circle", seed=11, denoising_steps=2, batch_size=2, scheduler="EulerA")
    calls = [[replace(request, seed=11 + index)] for index in range(3)]
    seen = []
    streamed = pipe.run_stream(calls, overlap=overlap, done=seen.append)
    assert len(streamed) == 3 and seen == [0, 1, 2]
    for requests, pixels in zip(calls, streamed):
        alone = pipe.run(requests, pixels=True)
        assert pixels.shape == (2, 64, 64, 3) and pixels.dtype == np.uint8
        np.testing.assert_array_equal(pixels, alone)
    assert not np.array_equal(streamed[0], streamed[1])  # each call its own seed, not one image repeated


def test_a_stream_of_one_image_requests_is_sd_serves_calls(pipe):
    requests = [pipe.request(prompt, seed=seed, denoising_steps=2) for prompt, seed in
                (("a cat", 1), ("a dog", 2), ("a tree", 3), ("a car", 4))]
    calls = [requests[:2], requests[2:3], requests[3:]]  # batch sizes 2, 1, 1: each call prepares for its own
    streamed = pipe.run_stream(calls)
    for call, pixels in zip(calls, streamed):
        np.testing.assert_array_equal(pixels, pipe.run(call, pixels=True))


def test_a_stream_says_when_decoded_images_are_not_finite(pipe, monkeypatch):
    family = pipe.family(TEXT_TO_IMAGE)
    monkeypatch.setattr(family, "decode", lambda latents: torch.full((latents.shape[0], 3, 64, 64), float("nan")))
    request = pipe.request("a cat", seed=1, denoising_steps=2)
    with pytest.warns(RuntimeWarning, match="non-finite values in the decoded images"):
        pipe.run_stream([[request]])


def test_a_stream_takes_one_scheduler(pipe):
    first = pipe.request("a cat", seed=1, denoising_steps=2, scheduler="Euler")
    with pytest.raises(throughput.UsageError, match="one mode and one scheduler"):
        pipe.run_stream([[first], [replace(first, scheduler="DDIM")]])
    with pytest.raises(throughput.UsageError, match="one call at least"):
        pipe.run_stream([])


def run(tmp_path, *args):
    results = tmp_path / "results"
    status = throughput.main([*COMMON, "--results-dir", str(results), *args])
    path = results / f"{STEM}.json"
    return status, (json.loads(path.read_text()) if path.is_file() else None), results


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny):
    tmp_path = tmp_path_factory.mktemp("throughput")
    return tmp_path, *run(tmp_path, "--batch-sizes", "1,2")


def test_the_command_writes_its_table_json_and_chart(sweep):
    _, status, data, results = sweep
    assert status == 0
    assert data["gpu"] == device_name(torch.device("cpu")) and data["versions"]["torch"] and data["date"]
    assert data["command"].startswith("sd-throughput --model tiny") and "--batch-sizes 1,2" in data["command"]
    rows = sorted(data["rows"], key=lambda row: row["batch_size"])
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        assert row["workload"] == "tiny, 64x64, 2 Euler steps, guidance 7.5"
        assert not row["overlap"] and row["label"].endswith("· serial")  # nothing overlaps on a CPU
        assert row["images"] == 2 * row["batch_size"] and row["batches"] == 2
        assert row["images_per_s"] == pytest.approx(row["images"] / row["wall_s"])
        assert row["ms_per_image"] == pytest.approx(1e3 / row["images_per_s"])
        assert row["unet_calls"] == 2 and len(row["latency_ms_batches"]) == 2
        assert all(row["latency_ms"][stage] > 0 for stage in ("clip", "unet", "vae"))
        assert row["unet_ms_per_step"] == pytest.approx(row["latency_ms"]["unet"] / 2)
        assert row["load_s"] > 0 and row["ready_s"] >= 0 and row["command"] == data["command"]
    table = (results / f"{STEM}.md").read_text()
    assert "| setup | batch | images/s |" in table and f"| {rows[1]['label']} | 2 |" in table
    assert (results / f"{STEM}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_are_kept_across_runs(sweep):
    tmp_path, *_ = sweep
    status, data, _ = run(tmp_path, "--batch-sizes", "3", "--batches", "1")
    assert status == 0
    assert sorted(row["batch_size"] for row in data["rows"]) == [1, 2, 3]
    status, data, _ = run(tmp_path, "--batch-sizes", "1", "--batches", "1", "--fresh")
    assert [row["batch_size"] for row in data["rows"]] == [1]


def test_a_batch_that_does_not_fit_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch, tiny):
    from demo.runtime import loaded, memory

    floor = memory.activation_floor
    monkeypatch.setattr(memory, "activation_floor", lambda source, batch, *rest: floor(source, batch, *rest)
                        if batch < 3 else 2**60)  # batch 3: a floor no machine has
    run_stream = loaded.Pipeline.run_stream

    def out_of_memory_at_two(self, calls, *args, **kwargs):
        if len(calls[0][0].prompts) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return run_stream(self, calls, *args, **kwargs)

    monkeypatch.setattr(loaded.Pipeline, "run_stream", out_of_memory_at_two)
    status, data, results = run(tmp_path, "--batch-sizes", "3,2,1")
    assert status == 0
    assert [row["batch_size"] for row in data["rows"]] == [1]
    reasons = {entry["batch_size"]: entry["reason"] for entry in data["did_not_fit"]}
    assert set(reasons) == {2, 3} and not data["failed"]
    assert "batch 3 at 64x64 needs at least" in reasons[3] and "\n" not in reasons[3]
    assert reasons[2].startswith("OutOfMemoryError: CUDA out of memory")
    assert "batch 3: did not fit: batch 3 at 64x64" in (results / f"{STEM}.md").read_text()


def test_a_batch_size_above_the_engines_range_is_refused(tmp_path, capsys, tiny):
    status, data, _ = run(tmp_path, "--backend", "tensorrt-rtx", "--max-batch-size", "2", "--batch-sizes", "1,4,8")
    assert status == 2 and data is None
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == ("sd-throughput: error: --batch-sizes 4,8: above --max-batch-size 2, the largest batch the "
                    "engines are built for")


def test_mlperf_sets_what_is_unset(tiny):
    from types import SimpleNamespace

    from models.families import SDXL

    sdxl = SimpleNamespace(family=SDXL)  # what runs_mlperf reads of a model
    request = throughput.mlperf_request(Request("a cat", guidance_scale=8.0), True)
    assert (request.denoising_steps, request.scheduler, request.guidance_scale, request.height, request.width) == \
        (20, "Euler", 8.0, 1024, 1024)
    assert throughput.runs_mlperf(sdxl, request)
    assert not throughput.runs_mlperf(tiny, request)  # not an SDXL model
    assert not throughput.runs_mlperf(sdxl, replace(request, denoising_steps=30))
    assert throughput.mlperf_request(Request("a cat"), False) == Request("a cat")


def test_a_run_of_mlperfs_settings_is_set_against_mlperfs_figure(sweep):
    _, _, data, _ = sweep
    assert not any(row["mlperf_settings"] for row in data["rows"])  # tiny at 64x64: nothing to compare
    assert throughput.mlperf_yardstick("NVIDIA H200", data["rows"]) is None
    rows = [{**row, "mlperf_settings": True, "images_per_s": 1.185 * row["batch_size"]} for row in data["rows"]]
    table = throughput.throughput_table({**data, "gpu": "NVIDIA H200", "rows": rows})
    assert ("Best: 2.370 images/s at batch 2" in table and "MLPerf Inference v5.0 SDXL offline, NVIDIA H200 "
            "(TensorRT, UNet FP8, VAE INT8): 2.37 images/s; the best here is 1.00x that." in table)
    assert throughput.mlperf_yardstick("NVIDIA A100-SXM4-80GB", rows) is None
    from bench.charts import throughput_chart

    png = throughput_chart(rows, {rows[0]["workload"]: throughput.mlperf_yardstick("NVIDIA H200", rows)})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--batch-sizes", "0,2"], "--batch-sizes must be at least 1, got 0"),
    (["--batch-sizes", "two"], "--batch-sizes"),
    (["--batches", "0"], "--batches must be at least 1, got 0"),
    (["--warmup-batches", "-1"], "--warmup-batches must be 0 or more"),
    (["--batch-size", "4"], "--batch-size: sd-throughput measures the sizes --batch-sizes gives"),
    (["--overlap", "sometimes"], "--overlap"),
    (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
    (["--mlperf", "--denoising-steps", "30"], "--denoising-steps 30: --mlperf runs MLPerf's 20; leave it unset"),
    (["--update-defaults"], "records no tuned defaults"),
])
def test_bad_flags_exit_2_in_one_line(tmp_path, capsys, no_loading, args, message):
    status = throughput.main([*args, "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("sd-throughput: error: ") and message in err[0]


def test_engines_of_the_range_run_the_stream_in_order_and_every_batch_size(tmp_path, monkeypatch, tiny):
    """Engines (the stand-in TensorRT, tests/fake_tensorrt.py) built for batches 1 to --max-batch-size: the stream
    gives their images alone, never overlapped (they share one working-memory block), and each batch size of the
    sweep runs on them."""
    from demo.backends.tensorrt.options import EngineOptions
    from demo.runtime import loaded
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "10.8.0")
    dirs = {"onnx_dir": str(tmp_path / "onnx"), "engine_dir": str(tmp_path / "engine")}
    asked = []
    monkeypatch.setattr(loaded, "BatchStream", lambda family, device, overlap: asked.append(overlap) or
                        BatchStream(family, device, overlap))
    spec = PipelineSpec(model="tiny", backend="tensorrt", precision="fp32", plugins="none", batch_size=3,
                        max_batch_size=3, engine=EngineOptions(optimization_level=0, **dirs))
    with load_pipeline(spec, torch.device("cpu"), progress=lambda _: None) as engines:
        head = engines.request("a red circle", seed=3, denoising_steps=2, batch_size=3, scheduler="Euler")
        calls = [[head], [replace(head, prompt="a blue square", seed=4)]]
        for call, pixels in zip(calls, engines.run_stream(calls, overlap=True)):
            np.testing.assert_array_equal(pixels, engines.run(call, pixels=True))
    assert asked == [False]
    status, data, _ = run(tmp_path, "--backend", "tensorrt", "--precision", "fp32", "--plugins", "none",
                          "--optimization-level", "0", "--max-batch-size", "3", "--batch-sizes", "1,3",
                          "--batches", "1", "--onnx-dir", dirs["onnx_dir"], "--engine-dir", dirs["engine_dir"])
    assert status == 0, data
    assert [(row["batch_size"], row["backend"]) for row in data["rows"]] == [(1, "tensorrt"), (3, "tensorrt")]
    assert all(row["images_per_s"] > 0 and row["setup"].startswith("tensorrt, fp32") for row in data["rows"])


def test_engines_are_measured_serial_only():
    from types import SimpleNamespace

    from demo.backends.registry import backend_named

    def plan(device: str, backend: str):
        return SimpleNamespace(device=torch.device(device), backend=backend_named(backend),
                               base=SimpleNamespace(settings={}))

    assert throughput.overlap_modes("both", plan("cuda", "tensorrt")) == (False,)
    assert "share one working-memory block" in throughput.why_serial(plan("cuda", "tensorrt"))
    assert throughput.overlap_modes("both", plan("cuda", "torch")) == (True, False)
    assert throughput.why_serial(plan("cuda", "torch")) is None
    assert throughput.overlap_modes("on", plan("cpu", "torch")) == (False,)


def test_each_modes_row_has_its_own_peak_memory(monkeypatch):
    """With --overlap both the overlapped mode runs first and holds more (two batches' tensors at once): the serial
    row's peak must be the serial batches', not the overlapped run's before it (a GPU's counters, stood in for)."""
    from types import SimpleNamespace

    from demo.pipelines import timer
    from demo.runtime import loader, memory

    memory_state = {"allocated": 0, "peak": 0}

    def allocate(size):
        memory_state["peak"] = max(memory_state["peak"], size)

    class Pipeline:
        stages, backend = {}, SimpleNamespace(name="torch")

        def request(self, request):
            return request

        def stats(self):
            return {}

        def unet_calls(self, request):
            return 2

        def run_stream(self, calls, overlap, timers=None, done=None):
            allocate(300 if overlap else 100)

        def close(self):
            pass

    class Timer:
        def __init__(self, device):
            pass

        def milliseconds(self):
            return {"clip": 1.0, "unet": 2.0, "vae": 3.0}

    monkeypatch.setattr(memory, "check_memory", lambda *_: None)
    monkeypatch.setattr(loader, "load_pipeline", lambda *_, **__: Pipeline())
    monkeypatch.setattr(timer, "StageTimer", Timer)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *_: memory_state.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: memory_state["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (2**30, 2**31))
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *_: None)
    monkeypatch.setattr(throughput, "why_serial", lambda plan: None)
    first = SimpleNamespace(device=SimpleNamespace(type="cuda"), source=None, dtype=torch.float16)
    request = Request("a cat", batch_size=2, height=64, width=64, seed=1, guidance_scale=7.5)
    thr = throughput.ThroughputFlags(batches=1, warmup_batches=1, overlap="both")
    rows = throughput.measure_batch(None, request, thr, first, {"setup": "torch"})
    peaks = {entry["overlap"]: entry["peak_allocated_bytes"] for kind, entry in rows}
    assert [kind for kind, _ in rows] == ["rows", "rows"] and peaks == {True: 300, False: 100}


def test_torch_compiles_cuda_graph_trees_are_never_overlapped(pipe, monkeypatch):
    """torch.compile's reduce-overhead and max-autotune replay every compiled stage's graphs from one cudagraph tree,
    one memory pool whose graphs reuse each other's memory on the assumption that they replay one after the other:
    run on three streams at once they would overwrite each other's tensors. So the stream runs them in order, and
    sd-throughput measures serial rows alone, saying why."""
    from types import SimpleNamespace

    from demo.backends.registry import backend_named
    from demo.backends.torch.options import TorchSettings
    from demo.runtime import loaded

    settings = {"unet": TorchSettings(compile="reduce-overhead"), "vae": TorchSettings(compile="none")}
    graphed = SimpleNamespace(device=torch.device("cuda"), backend=backend_named("torch"),
                              base=SimpleNamespace(settings=settings))
    assert throughput.overlap_modes("both", graphed) == (False,)
    assert "reduce-overhead" in throughput.why_serial(graphed)
    plain = SimpleNamespace(**{**vars(graphed),
                               "base": SimpleNamespace(settings={"unet": TorchSettings(compile="default")})})
    assert throughput.why_serial(plain) is None
    asked = []
    monkeypatch.setattr(loaded, "BatchStream", lambda family, device, overlap: asked.append(overlap) or
                        BatchStream(family, device, overlap))
    request = pipe.request("a cat", seed=1, denoising_steps=2)
    pipe.run_stream([[request]], overlap=True)
    for name in pipe.plan.base.settings:
        monkeypatch.setitem(pipe.plan.base.settings, name, TorchSettings(compile="reduce-overhead"))
    pipe.run_stream([[request]], overlap=True)
    assert asked == [True, False]


def test_mlperfs_sdxl_settings_are_one_definition_for_both_commands():
    """sd-throughput's --mlperf and sd-loadgen's SDXL defaults are MLPerf's one reference: one definition, so that
    they cannot drift apart (sd-loadgen adds the reference's negative prompt, which costs no extra work)."""
    from bench import common, loadgen

    assert throughput.MLPERF_SDXL is common.MLPERF_SDXL
    assert loadgen.MLPERF_SDXL_REQUEST == {**common.MLPERF_SDXL, "negative_prompt": common.MLPERF_SDXL_NEGATIVE_PROMPT}


def test_mlperfs_figure_is_only_the_sxm_parts(sweep):
    """MLPerf's figures are NVIDIA's SXM systems' (700 W): a PCIe or NVL card of the same name, at half the power or
    less, is not set against them."""
    _, _, data, _ = sweep
    rows = [{**row, "mlperf_settings": True} for row in data["rows"]]
    assert throughput.mlperf_yardstick("NVIDIA H100 80GB HBM3", rows)[0] == 2.04
    assert throughput.mlperf_yardstick("NVIDIA H200", rows)[0] == 2.37
    for gpu in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL"):
        assert throughput.mlperf_yardstick(gpu, rows) is None, gpu


def test_the_overlapped_mode_running_out_of_memory_leaves_the_serial_row(tmp_path, monkeypatch, tiny):
    """The overlapped stream holds two batches at once: where it runs out of memory, the serial stream (what sd-serve
    runs) may still fit, and is measured; the batch size is not reported as not fitting whole."""
    from demo.runtime import loaded

    monkeypatch.setattr(throughput, "why_serial", lambda plan: None)  # both modes, as on a GPU
    run_stream = loaded.Pipeline.run_stream

    def overlapped_out_of_memory_at_two(self, calls, overlap=True, *args, **kwargs):
        if overlap and len(calls[0][0].prompts) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run_stream(self, calls, overlap, *args, **kwargs)

    monkeypatch.setattr(loaded.Pipeline, "run_stream", overlapped_out_of_memory_at_two)
    status, data, results = run(tmp_path, "--batch-sizes", "1,2", "--batches", "1")
    assert status == 0
    assert sorted((row["batch_size"], row["overlap"]) for row in data["rows"]) == [(1, False), (1, True), (2, False)]
    [entry] = data["did_not_fit"]
    assert (entry["batch_size"], entry["overlap"]) == (2, True) and entry["reason"].startswith("OutOfMemoryError")
    assert "· overlapped, batch 2: did not fit: OutOfMemoryError" in (results / f"{STEM}.md").read_text()
    # a later run in which it fits replaces that mode's line, and keeps the serial row
    monkeypatch.setattr(loaded.Pipeline, "run_stream", run_stream)
    status, data, _ = run(tmp_path, "--batch-sizes", "2", "--batches", "1", "--overlap", "on")
    assert not data["did_not_fit"]
    assert sorted((row["batch_size"], row["overlap"]) for row in data["rows"]) == [(1, False), (1, True), (2, False),
                                                                                   (2, True)]
