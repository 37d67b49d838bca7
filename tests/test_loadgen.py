"""sd-loadgen (issue 60): MLPerf's LoadGen drives a real sd-serve of `tiny` (64x64, 2 steps) on loopback, started the
way sd-loadgen starts one, for a few seconds a run: Offline VALID with every sample LoadGen issued answered and
batched; Server within a generous bound meeting it (and INVALID only for LoadGen's early stopping, which needs ~459
queries at p99); Server over a bound too tight for the CPU INVALID with LoadGen's reason; a refused request failing
the run; bad flags one line and exit 2 before anything starts; MLPerf's SDXL settings and LoadGen's own mlperf.conf."""

import contextlib
import importlib.util
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from tests.test_serve import NO_PYTRITON, free_ports

NO_LOADGEN = importlib.util.find_spec("mlperf_loadgen") is None
needs_loadgen = pytest.mark.skipif(NO_LOADGEN, reason="needs MLPerf's LoadGen: pip install -e '.[serve]' "
                                                      "(mlcommons-loadgen)")
needs_server = pytest.mark.skipif(NO_PYTRITON or NO_LOADGEN, reason="needs PyTriton, tritonclient and MLPerf's "
                                                                    "LoadGen: pip install -e '.[serve]'")
SIZE, STEPS = 64, 2
REQUEST = ["--height", str(SIZE), "--width", str(SIZE), "--denoising-steps", str(STEPS)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """sd-serve of tiny on the CPU (on a GPU machine too: the runs' rates are sized for it) as sd-loadgen starts one
    (bench.loadgen.started_server), shared by the runs; stopped by SIGTERM at the end, which it must answer by
    draining and stopping (its log says so)."""
    from bench.loadgen import started_server

    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("loadgen-serve") / "sd-serve.log"
    argv = ["--model", "tiny", "--height", str(SIZE), "--width", str(SIZE), "--max-batch-size", "4",
            "--max-queue-delay-ms", "100", "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(metrics)]
    with contextlib.ExitStack() as running:
        with pytest.MonkeyPatch.context() as env:  # the server's environment only
            env.setenv("CUDA_VISIBLE_DEVICES", "")
            running.enter_context(started_server(argv, http, drain_seconds=10, log_path=log, timeout_s=300))
        yield SimpleNamespace(url=f"127.0.0.1:{http}", log=log)
    assert re.search(r"\[sd-serve\] stopped in [\d.]+ s", log.read_text()), log.read_text()[-2000:]


def loadgen(tmp_path, server, *args) -> tuple[int, dict, str]:
    """sd-loadgen against the module's server: (exit status, the JSON summary, LoadGen's own summary text)."""
    from bench.common import slug
    from bench.loadgen import gpu_name, main

    status = main(["--url", server.url, "--model", "tiny", *REQUEST, "--results-dir", str(tmp_path), *args])
    scenario = args[args.index("--scenario") + 1].lower()
    stem = tmp_path / f"loadgen-{scenario}-{slug(gpu_name())}-tiny"
    return status, json.loads(stem.with_suffix(".json").read_text()), (stem / "mlperf_log_summary.txt").read_text()


@needs_server
def test_offline_is_valid_and_every_sample_loadgen_issued_comes_back_batched(server, tmp_path):
    from bench.common import slug
    from bench.loadgen import gpu_name

    status, report, summary = loadgen(tmp_path, server, "--scenario", "Offline", "--target-qps", "10",
                                      "--min-duration-s", "1")
    assert status == 0
    assert "Result is : VALID" in summary and (report["loadgen_result"], report["valid"]) == ("VALID", True)
    per_s = float(re.search(r"Samples per second: ([\d.]+)", summary).group(1))
    assert report["samples_per_s"] == pytest.approx(per_s, rel=1e-4) and per_s > 0
    # LoadGen's one Offline query: expected QPS x duration x 1.1 samples, each answered once with its image
    assert report["samples_issued"] == report["settings"]["samples_per_query"] == 11
    assert (report["samples_answered"], report["samples_failed"]) == (11, 0)
    assert sum(report["batch_sizes"].values()) == 11 and max(map(int, report["batch_sizes"])) > 1
    latency = report["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    assert report["settings"]["request"] == {"denoising_steps": STEPS, "guidance_scale": None, "height": SIZE,
                                             "width": SIZE, "scheduler": None, "negative_prompt": None}
    assert report["official"]["met"] is False and "600" in report["official"]["note"]
    assert report["command"].startswith("sd-loadgen --url ") and report["gpu"] == gpu_name()
    assert {"torch", "diffusers", "loadgen"} <= set(report["versions"])
    stem = tmp_path / f"loadgen-offline-{slug(gpu_name())}-tiny"
    assert (stem / "mlperf_log_detail.txt").stat().st_size > 0 and "| Offline |" in stem.with_suffix(".md").read_text()


@needs_server
def test_server_within_a_generous_bound_meets_it_and_is_short_only_of_early_stopping(server, tmp_path):
    status, report, summary = loadgen(tmp_path, server, "--scenario", "Server", "--target-qps", "2",
                                      "--min-query-count", "8", "--min-duration-s", "1", "--target-latency-ms",
                                      "120000")
    assert status == 0
    assert "Performance constraints satisfied : Yes" in summary and report["overlatency_queries"] == 0
    assert report["invalid_reasons"][0] == "early stopping not met"
    assert not any("performance constraints" in reason for reason in report["invalid_reasons"])
    assert report["samples_issued"] == report["samples_answered"] == 8 and report["samples_failed"] == 0
    assert report["settings"]["target_latency_ms"] == 120000 and report["settings"]["target_latency_percentile"] == 0.99
    assert report["samples_per_s"] > 0


@needs_server
def test_server_over_a_bound_too_tight_for_the_cpu_is_invalid_with_loadgens_reason(server, tmp_path):
    status, report, summary = loadgen(tmp_path, server, "--scenario", "Server", "--target-qps", "2",
                                      "--min-query-count", "6", "--min-duration-s", "1", "--target-latency-ms", "20")
    assert status == 0  # a run LoadGen judged: its verdict is the result
    assert "Result is : INVALID" in summary and "Performance constraints satisfied : NO" in summary
    assert report["valid"] is False and report["overlatency_queries"] > 0
    assert "performance constraints (the latency bound) not met" in report["invalid_reasons"]
    assert "Reduce target QPS to improve latency." in report["invalid_reasons"]  # LoadGen's recommendation
    assert report["samples_issued"] == report["samples_answered"] == 6


@needs_server
def test_samples_the_server_refuses_fail_the_run_with_its_line(server, tmp_path):
    status, report, _ = loadgen(tmp_path, server, "--scenario", "Offline", "--target-qps", "5",
                                "--min-duration-s", "0.5", "--scheduler", "Nope")
    assert status == 1 and report["valid"] is False
    assert report["samples_failed"] == report["samples_issued"] > 0 and report["samples_answered"] == 0
    assert any("scheduler" in message for message in report["error_messages"]), report["error_messages"]


@needs_loadgen
def test_an_image_of_the_wrong_shape_is_a_failed_sample(monkeypatch):
    import bench.loadgen as harness

    sut = harness.SystemUnderTest("127.0.0.1:1", "http", ["a castle"], {"height": SIZE, "width": SIZE}, 1)
    sample = SimpleNamespace(id=1, index=0)
    monkeypatch.setattr(harness, "generate", lambda *_: (np.zeros((SIZE, SIZE, 3), np.uint8), 1))
    assert sut._send(None, None, sample) is None
    monkeypatch.setattr(harness, "generate", lambda *_: (np.zeros((32, SIZE, 3), np.uint8), 1))
    assert sut._send(None, None, sample) == "an image of shape [32, 64, 3] uint8, not [64, 64, 3] uint8"
    monkeypatch.setattr(harness, "generate", lambda *_: (np.zeros((SIZE, SIZE, 3), np.float32), 1))
    assert "float32" in sut._send(None, None, sample)


@pytest.mark.parametrize("args, message", [
    (["--scenario", "Nope"], "argument --scenario: invalid choice: 'Nope'"),
    (["--target-qps", "0"], "--target-qps must be above 0, got 0.0"),
    (["--target-qps", "nan"], "--target-qps must be a finite number, got nan"),
    (["--min-duration-s", "-1"], "--min-duration-s must be 0 or more, got -1.0"),
    (["--min-query-count", "0"], "--min-query-count must be at least 1, got 0"),
    (["--target-latency-ms", "100"], "--target-latency-ms bounds the Server scenario's latency; Offline has none"),
    (["--scenario", "Server", "--target-latency-ms", "0.5"], "--target-latency-ms must be at least 1, got 0.5"),
    (["--height", "60"], "--height must be a multiple of 8, at least 8, got 60"),
    (["--prompts", "/nonexistent/captions.txt"], "--prompts /nonexistent/captions.txt: cannot read it"),
    (["--max-batch-size", "0"], "--max-batch-size must be at least 1, got 0"),  # sd-serve's flag, sd-serve's check
    (["--no-such-flag", "3"], "unrecognized arguments: --no-such-flag 3"),
    (["--url", "127.0.0.1:8000", "--max-batch-size", "4"], "--url targets a running server: sd-serve's flags"),
])
@needs_loadgen
def test_bad_flags_are_one_line_and_exit_2_before_anything_starts(args, message, capsys, monkeypatch, tmp_path):
    import subprocess

    from bench.loadgen import main

    def popen(*_, **__):
        raise AssertionError("sd-serve was started before every flag was checked")

    monkeypatch.setattr(subprocess, "Popen", popen)
    assert main(["--model", "tiny", "--results-dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.split("...\n")[-1]  # after the built-in model's generation, on a cold cache
    assert err.startswith("sd-loadgen: error: ") and message in err and err.count("\n") == 1, err


@needs_loadgen
def test_mlperf_sdxl_settings_are_the_defaults_for_sdxl_and_reach_the_server():
    from bench.loadgen import MLPERF_SDXL_REQUEST, LoadgenFlags, is_sdxl, request_settings, serve_plan

    assert is_sdxl("tiny-xl") and not is_sdxl("tiny") and not is_sdxl(None)
    assert request_settings(LoadgenFlags(), sdxl=True) == {
        "denoising_steps": 20, "guidance_scale": 8.0, "height": 1024, "width": 1024, "scheduler": "Euler",
        "negative_prompt": "normal quality, low quality, worst quality, low res, blurry, nsfw, nude"}
    assert request_settings(LoadgenFlags(denoising_steps=4), sdxl=True)["denoising_steps"] == 4
    assert set(request_settings(LoadgenFlags(), sdxl=False).values()) == {None}  # the server's own
    argv, serve_flags, spec = serve_plan(LoadgenFlags(model="tiny-xl", height=512), ["--max-batch-size", "8"], True)
    assert argv == ["--max-batch-size", "8", "--model", "tiny-xl", "--height", "512", "--width", "1024",
                    "--scheduler", "Euler"]
    assert (serve_flags.max_batch_size, spec.model, spec.height, spec.width) == (8, "tiny-xl", 512, 1024)
    assert set(MLPERF_SDXL_REQUEST) == set(request_settings(LoadgenFlags(), sdxl=False))


@needs_loadgen
def test_the_official_settings_are_loadgens_own_mlperf_conf_for_sdxl():
    """MLPerf's SDXL rules as LoadGen itself holds them (mlcommons/inference loadgen/mlperf.conf): the Server
    scenario's 20 s bound at the 99th percentile, 600 s runs, Offline's 5000 samples; a run's user.conf overrides."""
    from bench.loadgen import LoadgenFlags, official_minimums, user_conf

    assert official_minimums("Server") == {"min_duration_s": 600.0, "min_query_count": 100,
                                           "target_latency_ms": 20000.0, "target_latency_percentile": 0.99}
    assert official_minimums("Offline") == {"min_duration_s": 600.0, "min_query_count": 5000}
    conf = user_conf(LoadgenFlags(scenario="Server", target_qps=2.5, min_duration_s=90, target_latency_ms=15000), 48)
    assert conf.splitlines() == ["stable-diffusion-xl.*.performance_sample_count_override = 48",
                                 "stable-diffusion-xl.Server.min_duration = 90000",
                                 "stable-diffusion-xl.Server.target_qps = 2.5",
                                 "stable-diffusion-xl.Server.target_latency = 15000"]


@pytest.mark.gpu
@needs_server
def test_on_a_gpu_sd_loadgen_starts_its_server_and_offline_is_valid_named_for_the_gpu(tmp_path):
    """The whole command on a GPU: sd-loadgen starts sd-serve of tiny on GPU 0 itself, runs Offline, stops it."""
    import torch

    from bench.common import slug
    from bench.loadgen import main

    http, grpc, metrics = free_ports(3)
    # tiny runs hundreds of samples a second there: a query large enough to last the min duration
    assert main(["--scenario", "Offline", "--model", "tiny", *REQUEST, "--target-qps", "300", "--min-duration-s", "2",
                 "--results-dir", str(tmp_path), "--gpus", "0", "--max-batch-size", "8", "--http-port", str(http),
                 "--grpc-port", str(grpc), "--metrics-port", str(metrics)]) == 0
    gpu = torch.cuda.get_device_name(0)
    stem = tmp_path / f"loadgen-offline-{slug(gpu)}-tiny"
    report = json.loads(stem.with_suffix(".json").read_text())
    assert report["valid"] and report["gpu"] == gpu and "cuda" in report["versions"]
    assert report["samples_issued"] == report["samples_answered"] == 660 and max(map(int, report["batch_sizes"])) > 1
    assert re.search(r"\[sd-serve\] stopped in [\d.]+ s", (stem / "sd-serve.log").read_text())


@needs_server
def test_ctrl_c_stops_the_server_sd_loadgen_started_and_exits_130(tmp_path):
    """The whole command, starting its own server (on the CPU): a Ctrl-C in the middle of a Server run ends it with
    130 once sd-serve has drained and stopped (issue: the interrupted LoadGen was destroyed under its own thread, a
    segfault, and sd-serve outlived sd-loadgen)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from bench.loadgen import answers_ready
    from tests.conftest import ROOT

    http, grpc, metrics = free_ports(3)
    out = tmp_path / "sd-loadgen.out"
    command = [sys.executable, str(ROOT / "scripts" / "loadgen.py"), "--scenario", "Server", "--model", "tiny",
               *REQUEST, "--target-qps", "2", "--min-duration-s", "600", "--results-dir", str(tmp_path),
               "--max-batch-size", "4", "--drain-seconds", "2", "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics)]
    with open(out, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=tmp_path,
                                   start_new_session=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        deadline = time.monotonic() + 300
        while "[sd-loadgen] Server on" not in out.read_text():
            assert process.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)  # requests in flight
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130, out.read_text()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert out.read_text().strip().endswith("sd-loadgen: interrupted")
    log = (tmp_path / "loadgen-server-cpu-tiny" / "sd-serve.log").read_text()
    assert re.search(r"\[sd-serve\] SIGTERM: refusing new requests", log) and "[sd-serve] stopped in" in log
    assert not answers_ready(http)


@needs_loadgen
@pytest.mark.parametrize("broken", ["send", "connect"])
def test_a_sample_whose_request_raises_is_still_completed(monkeypatch, broken):
    """Whatever goes wrong with a sample's request (a client error other than ServeError, no client at all), LoadGen
    hears of the sample: a worker that died with it would leave LoadGen waiting for it for ever."""
    import mlperf_loadgen

    import bench.loadgen as harness

    @contextlib.contextmanager
    def connection(*_):
        if broken == "connect":
            raise ValueError("bad address")
        yield None, None

    def generate(*_):
        raise TypeError("'NoneType' object is not subscriptable")

    completed = []
    monkeypatch.setattr(harness, "connection", connection)
    monkeypatch.setattr(harness, "generate", generate)
    monkeypatch.setattr(mlperf_loadgen, "QuerySamplesComplete", completed.extend)
    monkeypatch.setattr(mlperf_loadgen, "QuerySampleResponse", lambda id, *_: id)
    sut = harness.SystemUnderTest("127.0.0.1:1", "http", ["a castle"], {}, 1)
    for sample in (SimpleNamespace(id=7, index=0), SimpleNamespace(id=8, index=0), None):
        sut.samples.put(sample)
    sut._work()
    assert completed == [7, 8] and sut.tally.answered == 0 and sum(sut.tally.errors.values()) == 2
    assert all(("bad address" if broken == "connect" else "NoneType") in error for error in sut.tally.errors)


def test_a_server_run_with_a_looser_bound_than_mlperfs_does_not_meet_the_official_settings():
    """MLPerf's minimums met (600 s, 100 queries) but the latency bound 6x MLPerf's 20 s: not an official run."""
    from bench.loadgen import Tally, summarize

    official = {"min_duration_s": 600.0, "min_query_count": 100, "target_latency_ms": 20000.0,
                "target_latency_percentile": 0.99}

    def report(bound_ns: int) -> dict:
        detail = {"result_validity": "VALID", "effective_min_duration_ms": 600000, "effective_min_query_count": 460,
                  "effective_min_sample_count": 460, "effective_target_latency_ns": bound_ns,
                  "effective_target_latency_percentile": 0.99}
        context = {"concurrency": 16, "max_batch_size": 8, "prompts": {"file": "captions.txt", "count": 48},
                   "official": dict(official), "model": "sdxl-arch"}
        return summarize(detail, Tally(answered=460), "Server", {}, context)["official"]

    assert report(20000 * 10**6)["met"] is True and "meets" in report(20000 * 10**6)["note"]
    looser = report(120000 * 10**6)
    assert looser["met"] is False and "target_latency_ms" in looser["note"], looser


def test_without_matplotlib_an_earlier_runs_chart_is_not_left_beside_this_runs_summary(tmp_path, monkeypatch):
    import bench.loadgen as harness

    stale = tmp_path / "loadgen-offline-cpu-tiny.png"
    stale.write_bytes(b"an earlier run's chart")

    def no_matplotlib(_):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(harness, "chart", no_matplotlib)
    monkeypatch.setattr(harness, "table", lambda report: "| table |")
    saved = harness.save_summary(tmp_path, "loadgen-offline-cpu-tiny", {"valid": True})
    assert [path.name for path in saved] == ["loadgen-offline-cpu-tiny.json", "loadgen-offline-cpu-tiny.md"]
    assert not stale.exists()
