"""--int8 on the CPU: calibration records what the layers really see, SmoothQuant leaves the function unchanged,
the Q/DQ pass quantizes the layers it should (traced through the provenance, the fMHA pass's packed QKV too), and
the pipeline on INT8 engines (the stand-in TensorRT runs the Q/DQ ONNX with ONNX Runtime, which computes int8
arithmetic) draws the torch pipeline's image within a stated PSNR, from a calibration cached by what made it.

Engines of real TensorRT are built and timed on a GPU (results/README.md says where that ran); here the graph and
its numerics are what is checked."""

import json
import subprocess
import sys

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
import torch

from demo.backends.registry import REGISTRY
from demo.backends.tensorrt.build import BuildOptions, EngineSettings, ImageProfile, prepare_stage_engines
from demo.backends.tensorrt.flavour import TensorRTAPI
from demo.backends.tensorrt.int8 import DEFAULT_PROMPTS, int8_request, read_calibration_prompts
from demo.backends.tensorrt.runtime import create_engine_stages
from demo.pipelines import StageTimer, Text2ImagePipeline, image_psnr, to_uint8
from demo.request import Request
from demo.runtime.loader import activation_recorder
from demo.runtime.spec import PipelineSpec
from models import CLIP, STAGE_MODELS, UNET, VAE
from models.provenance import Provenance
from models.quantize import (
    MIN_CHANNELS,
    ActivationRecorder,
    quantizable_layers,
    read_int8_report,
    smooth_layer_norms,
)
from tests import fake_tensorrt
from tests.conftest import ROOT

SD_STAGES = (CLIP, UNET, VAE)  # the text-to-image stages of an SD 1.x/2.x model (tiny's)

QUIET = lambda *_: None  # noqa: E731
CPU = torch.device("cpu")
SIZE, STEPS, SCHEDULER, GUIDANCE = 64, 4, "DDIM", 7.5
PROMPTS = ("a red car in the rain", "a bowl of fruit")


def recorder(model: str):
    """What calibrates engines of `model` here: its torch pipeline on the CPU (demo.runtime.calibrate)."""
    return activation_recorder(PipelineSpec(model=model), CPU)


def calibration_request(tiny, onnx_dir, prompts=PROMPTS, progress=QUIET, log=QUIET):
    return int8_request(tiny, prompts, STEPS, SCHEDULER, GUIDANCE, SIZE, SIZE, onnx_dir, recorder("tiny"), progress,
                        log)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("int8-onnx")


@pytest.fixture(scope="module")
def unet_onnx(tiny, onnx_dir):
    """fp32 ONNX of tiny's UNet, plain and INT8 (plugin-free: ONNX Runtime runs it as it is)."""
    unet = STAGE_MODELS["unet"](tiny)
    request = calibration_request(tiny, onnx_dir)
    return (unet.prepare_onnx(onnx_dir, "cpu", torch.float32, log=QUIET),
            unet.prepare_onnx(onnx_dir, "cpu", torch.float32, log=QUIET, int8=request), request)


def run_onnx(path, feed):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def unet_feed(tiny, seed=0):
    inputs = STAGE_MODELS["unet"](tiny).sample_inputs(2, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))
    return {name: value.numpy() for name, value in inputs.items()}


def rel_error(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_recorder_sees_each_layers_input():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Unflatten(-1, (2, 2, 2)), torch.nn.Flatten(0, 1),
                                torch.nn.Conv2d(2, 3, 1))
    x = torch.randn(3, 5, 6) * torch.linspace(0.1, 4, 6)  # a different range per channel
    with ActivationRecorder(model) as recorder:
        model(x)
    with torch.no_grad():
        conv_in = model[2](model[1](model[0](x)))
    linear, conv = recorder.calibration().layers["0"], recorder.calibration().layers["3"]
    assert linear.amax == pytest.approx(x.abs().max().item())
    np.testing.assert_allclose(linear.channel_amax, x.abs().amax(dim=(0, 1)).numpy(), rtol=1e-6)
    assert linear.rows == 5  # tokens per batch item
    np.testing.assert_allclose(conv.channel_amax, conv_in.abs().amax(dim=(0, 2, 3)).numpy(), rtol=1e-6)
    assert conv.rows == 4  # pixels
    model(x)  # outside the block: no hook records
    assert set(recorder.calibration().layers) == {"0", "3"}


def test_smoothing_leaves_the_function_unchanged(tiny, unet_onnx, tmp_path):
    plain, _, request = unet_onnx
    graph = gs.import_onnx(onnx.load(str(plain)))
    layers, _ = quantizable_layers(graph, Provenance.read(plain), request.calibrate())
    spread = lambda stats: stats.channel_amax.max() / np.median(stats.channel_amax)  # noqa: E731
    before = {id(layer): layer.stats for layer in layers}
    smoothed = smooth_layer_norms(graph, layers, alpha=0.5)
    norms = sum(isinstance(m, torch.nn.LayerNorm) for m in STAGE_MODELS["unet"](tiny).component_skeleton().modules())
    assert smoothed == norms  # every transformer LayerNorm feeds quantized linear layers only
    changed = [layer for layer in layers if layer.stats is not before[id(layer)]]
    assert changed and all(spread(layer.stats) < spread(before[id(layer)]) for layer in changed)  # flatter inputs
    onnx.save(gs.export_onnx(graph.cleanup().toposort()), str(tmp_path / "smoothed.onnx"))
    feed = unet_feed(tiny)
    assert rel_error(run_onnx(tmp_path / "smoothed.onnx", feed), run_onnx(plain, feed)) < 1e-5


def test_int8_onnx_quantizes_the_layers_that_pay(tiny, unet_onnx):
    plain, quantized, _ = unet_onnx
    report = read_int8_report(quantized)
    component = STAGE_MODELS["unet"](tiny).component_skeleton()
    convs = {name for name, m in component.named_modules()
             if isinstance(m, torch.nn.Conv2d) and min(m.in_channels, m.out_channels) >= MIN_CHANNELS}
    assert convs <= set(report["modules"]) and report["quantized"]["Conv"] == len(convs)
    assert not {"conv_in", "conv_out"} & set(report["modules"])  # the latents' 4 channels stay fp16
    assert not any(m.endswith(("attn2.to_k", "attn2.to_v")) or m.startswith("time_embedding")
                   for m in report["modules"])  # 77 text tokens, one time embedding: too little work
    graph = onnx.load(str(quantized)).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("QuantizeLinear") == ops.count("DequantizeLinear") > 0
    # Weights per output channel: a Conv's on axis 0, a MatMul's on axis 1.
    axes = {n.name.rsplit("/", 2)[0]: {a.name: a.i for a in n.attribute}.get("axis") for n in graph.node
            if n.op_type == "QuantizeLinear" and n.name.endswith("/w/Q")}
    assert axes and all(axis in (0, 1) for axis in axes.values())
    feed = unet_feed(tiny, seed=1)
    error = rel_error(run_onnx(quantized, feed), run_onnx(plain, feed))
    assert 1e-4 < error < 0.15, error  # quantized (not the fp32 function), and close to it


def test_the_fmha_packed_qkv_is_quantized_as_one_layer_of_three_modules(tiny, tmp_path):
    unet = STAGE_MODELS["unet"](tiny)
    request = calibration_request(tiny, tmp_path)
    path = unet.prepare_onnx(tmp_path, "cpu", torch.float16, log=QUIET, plugins=("LayerNorm", "fMHA", "fMHCA"),
                             int8=request)
    report = read_int8_report(path)
    blocks = sum(type(m).__name__ == "BasicTransformerBlock" for m in unet.component_skeleton().modules())
    assert report["layer_norms_smoothed"] == 3 * blocks  # through our SDPLayerNorm plugin nodes
    packed = [m for m in report["modules"] if m.endswith(("attn1.to_q", "attn1.to_k", "attn1.to_v"))]
    assert len(packed) == 3 * blocks
    graph = onnx.load(str(path)).graph
    casts = [n for n in graph.node if n.op_type == "Cast"]
    assert casts and all(n.op_type != "QuantizeLinear" or n.input[0] in {c.output[0] for c in casts}
                         or n.name.endswith("/w/Q") for n in graph.node)  # fp16 activations reach Q through fp32


@pytest.fixture(params=["8.6.0", "10.8.0"], ids=["trt8.6", "trt10"])
def trt(request, monkeypatch):
    return fake_tensorrt.install(monkeypatch, request.param)


def test_pipeline_on_int8_engines_draws_the_torch_image(trt, tiny, tiny_stages, tmp_path):
    log = []
    request = calibration_request(tiny, tmp_path / "onnx", log=log.append)
    profile = ImageProfile.for_request(tiny, 1, SIZE, SIZE, static_batch=True, dynamic_shape=False)
    settings = EngineSettings(tmp_path / "onnx", tmp_path / "engine", profile, BuildOptions("tensorrt", 0),
                              int8=request)
    models = [STAGE_MODELS[name](tiny) for name in SD_STAGES]
    prepare_stage_engines(models[1:2], settings, CPU, torch.float32, QUIET, QUIET)  # the UNet first: its flags
    assert ("INT8" in trt.last_build["config_flags"]) != TensorRTAPI("tensorrt").strongly_typed
    engines = prepare_stage_engines(models, settings, CPU, torch.float32, QUIET, QUIET)
    assert engines["unet"].name == "unet.int8.engine" and engines["vae"].name == "vae.engine"
    stages = create_engine_stages(models, engines, TensorRTAPI("tensorrt"), torch.float32, settings, CPU, QUIET)
    generation = Request("a lighthouse at dusk", None, height=SIZE, width=SIZE, denoising_steps=STEPS,
                         guidance_scale=GUIDANCE, seed=5)
    images = {name: to_uint8(Text2ImagePipeline(tiny, used, SCHEDULER, CPU, torch.float32)(generation,
                                                                                           StageTimer(CPU)))
              for name, used in (("int8", stages), ("torch", tiny_stages))}
    psnr = image_psnr(images["int8"], images["torch"])
    print(f"int8 engines against the torch pipeline: {psnr:.1f} dB, largest pixel difference "
          f"{np.abs(images['int8'].astype(int) - images['torch']).max()}")
    assert 25 < psnr < float("inf"), psnr  # the bound for sd1.5-arch on a GPU; quantized, so not equal
    assert images["torch"].std() > 3  # between real pictures

    # Cached by what made it: the same request reads it, other prompts calibrate (and quantize) again.
    log.clear()
    prepare_stage_engines(models, settings, CPU, torch.float32, log.append, QUIET)
    assert "[cache] unet.int8.engine: up to date" in log
    assert not any("unet.calibration.json" in line for line in log)  # a cached engine needs no calibration
    other = EngineSettings(settings.onnx_dir, settings.engine_dir, profile, BuildOptions("tensorrt", 0),
                           int8=calibration_request(tiny, tmp_path / "onnx", prompts=("a blue boat",), log=log.append))
    prepare_stage_engines(models[1:2], other, CPU, torch.float32, log.append, QUIET)
    assert any(line.startswith("[cache] unet.calibration.json: building (stale (prompts") for line in log)


def test_calibration_prompts_files(tmp_path):
    assert read_calibration_prompts(None) == DEFAULT_PROMPTS
    listed = tmp_path / "prompts.txt"
    listed.write_text("# calibration\na cat\n\n  a dog  \n")
    assert read_calibration_prompts(str(listed)) == ("a cat", "a dog")


@pytest.mark.parametrize("args, message", [
    (["--calibration-prompts", "p.txt"], "--calibration-prompts is for --int8"),
    (["--int8", "--build-enable-refit"], "--int8 engines cannot be refitted"),
    (["--int8", "--calibration-steps", "0"], "--calibration-steps must be"),
])
def test_int8_usage_errors_are_one_line(tmp_path, args, message):
    (tmp_path / "p.txt").write_text("a cat\n")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engines.py"), "--model", "tiny",
                             "--backend", "tensorrt-rtx", "--target-cc", "8.6", *args], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "onnx").exists() or not any((tmp_path / "onnx").iterdir())


@pytest.mark.parametrize("args, message", [
    (["--calibration-prompts", "missing.txt"], "--calibration-prompts missing.txt: no such file"),
    (["--calibration-prompts", "empty.txt"], "--calibration-prompts empty.txt: no prompts in it (one a line)"),
    (["--calibration-prompts", "binary.txt"], "--calibration-prompts binary.txt: not a text file"),
    (["--calibration-prompts", "nul.txt"], "--calibration-prompts nul.txt: not a text file"),
    (["--calibration-prompts", "folder"], "--calibration-prompts folder: a folder, not a file of prompts"),
    # above the scheduler's 1000 training timesteps: the request's own check, naming the calibration's flag
    (["--calibration-steps", "1001"], "--calibration-steps 1001 is more than scheduler "),
])
def test_bad_calibration_input_is_one_line_before_any_export(tiny, tmp_path, monkeypatch, capsys, args, message):
    from demo.cli.build_engines import main
    from models.base import StageModel

    fake_tensorrt.install(monkeypatch, "8.6.0")

    def export(*_, **__):
        raise AssertionError("an ONNX export before the INT8 options were checked")

    monkeypatch.setattr(StageModel, "export_onnx", export)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("# comments and blank lines only\n\n")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)))  # not UTF-8
    (tmp_path / "nul.txt").write_bytes(b"a cat\0\0\0\n")  # UTF-8, but binary
    (tmp_path / "folder").mkdir()
    status = main(["--model", "tiny", "--backend", "tensorrt", "--height", str(SIZE), "--width", str(SIZE), "--int8",
                   *args])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"build-engines: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "onnx").exists()


def test_tensorrt_for_rtx_builds_the_int8_unet(tiny, tmp_path):
    """Real TensorRT (for RTX, which builds on a CPU) parses and builds the fp16 graph with its Q/DQ layers, through
    build-engines, whose report says which stage is int8."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    report = tmp_path / "build.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engines.py"), "--model", "tiny",
                             "--backend", "tensorrt-rtx", "--target-cc", "8.9", "--optimization-level", "0",
                             "--height", str(SIZE), "--width", str(SIZE), "--build-static-batch", "--stages", "unet",
                             "--int8", "--calibration-prompts", "prompts.txt", "--calibration-steps", str(STEPS),
                             "--report", str(report)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text())["precision"] == "fp16, int8 unet"
    assert (tmp_path / "engine" / "unet.int8.engine").stat().st_size > 0
    assert read_int8_report(tmp_path / "onnx" / "unet.int8.opt.onnx")["quantized"]["Conv"] > 0


def test_sdxl_calibrates_through_its_own_pipeline_and_quantizes(tmp_path):
    from models.source import resolve_model

    xl = resolve_model("tiny-xl")
    unet = STAGE_MODELS["unet"](xl)
    request = int8_request(xl, PROMPTS, 3, "Euler", GUIDANCE, SIZE, SIZE, tmp_path, recorder("tiny-xl"), QUIET, QUIET)
    plain = unet.prepare_onnx(tmp_path, "cpu", torch.float32, log=QUIET)
    quantized = unet.prepare_onnx(tmp_path, "cpu", torch.float32, log=QUIET, int8=request)
    report = read_int8_report(quantized)
    assert report["quantized"]["Conv"] > 0 and report["quantized"]["MatMul"] > 0
    assert not any(m.startswith("add_embedding") for m in report["modules"])  # one row per image: the added conditions
    inputs = unet.sample_inputs(2, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    feed = {name: value.numpy() for name, value in inputs.items()}
    assert 1e-4 < rel_error(run_onnx(quantized, feed), run_onnx(plain, feed)) < 0.15


def test_the_report_names_the_int8_unet(tiny, tmp_path):
    profile = ImageProfile.for_request(tiny, 1, SIZE, SIZE, static_batch=True, dynamic_shape=False)
    settings = EngineSettings(tmp_path, tmp_path, profile, BuildOptions("tensorrt", 0), use_cuda_graph=True)
    engines = REGISTRY["tensorrt"]
    assert engines.describe(settings).options == ("CUDA graphs",)
    settings.int8 = calibration_request(tiny, tmp_path)
    assert engines.describe(settings).options == ("CUDA graphs", "INT8 UNet")
