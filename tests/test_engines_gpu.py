"""Real TensorRT engines on a GPU: the tiny model's CLIP, UNet and VAE built with the TensorRT found here
(8.6 on the H100/H200 box), run against the torch modules on identical fresh inputs, with and without
CUDA graphs, and the whole pipeline on engines against the torch pipeline."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.tensorrt]

QUIET = lambda *_: None  # noqa: E731
HEIGHT, WIDTH = 64, 48
CUDA = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def _tensorrt_runs_this_gpu():
    from demo.trt_flavour import why_cannot_run

    reason = why_cannot_run("tensorrt", torch.cuda.get_device_capability())
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def engines(tiny, tmp_path_factory):
    from demo.engine import BuildOptions, EngineSettings, ImageProfile, prepare_stage_engines
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES

    root = tmp_path_factory.mktemp("gpu-engines")
    profile = ImageProfile.for_request(tiny, 1, HEIGHT, WIDTH, static_batch=True, dynamic_shape=False)
    # cuDNN tactics are not what is tested here, and the box's cuDNN 8 is a stub.
    options = BuildOptions("tensorrt", 0, disabled_tactic_sources=("CUDNN",))
    settings = EngineSettings(root / "onnx", root / "engine", profile, options)
    models = [STAGE_MODELS[name](tiny) for name in TEXT_TO_IMAGE_STAGES]
    return models, prepare_stage_engines(models, settings, CUDA, torch.float16, QUIET, QUIET)


def stages(engines, use_cuda_graph):
    from demo.engine_runtime import create_engine_stages
    from demo.trt_flavour import TensorRTAPI

    models, paths = engines
    return create_engine_stages(models, paths, TensorRTAPI("tensorrt"), torch.float16, use_cuda_graph, CUDA, QUIET)


@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["stream", "cuda-graph"])
def test_each_engine_matches_its_torch_module(engines, use_cuda_graph):
    from demo.stages import TorchStage
    from models import stage_batch

    generator = torch.Generator().manual_seed(7)
    for name, stage in stages(engines, use_cuda_graph).items():
        batch = stage_batch(name, 1, guided=True)
        stage.prepare(batch, HEIGHT, WIDTH)
        assert stage.engine.has_graph == use_cuda_graph  # captured while preparing, not inside a run
        reference = TorchStage(stage.model, CUDA, torch.float32)
        for _ in range(2):  # a second feed: replays must read the new inputs
            feed = stage.model.sample_inputs(batch, HEIGHT, WIDTH, CUDA, torch.float16, generator)
            for buffer in stage.engine.buffers.values():
                if buffer.is_floating_point():
                    buffer.fill_(float("nan"))  # poisoned: every output element must be written
            (output,) = stage(feed).values()
            expected = next(iter(reference({k: v.float() if v.is_floating_point() and k != "timestep" else v
                                            for k, v in feed.items()}).values()))
            assert torch.isfinite(output).all()
            error = (output.float() - expected).abs().max().item()
            scale = expected.abs().max().item()
            assert error <= 2e-2 * max(scale, 1.0), f"{name}: max |engine - torch| {error} (scale {scale})"
        stage.close()


def test_pipeline_on_engines_matches_torch(tiny, engines):
    from demo.backends import create_stages
    from demo.pipeline import GenerationRequest, Text2ImagePipeline
    from demo.report import StageTimer

    request = GenerationRequest(["a castle on a hill"], [""], HEIGHT, WIDTH, steps=12, guidance_scale=7.5, seed=5)
    torch_stages = create_stages("torch", engines[0], CUDA, torch.float16)
    images = [Text2ImagePipeline(tiny, used, "DDIM", CUDA, torch.float16)(request, StageTimer(CUDA))
              for used in (stages(engines, True), torch_stages)]
    mse = float(np.mean((images[0] - images[1]) ** 2))
    psnr = 10 * np.log10(1.0 / max(mse, 1e-12))
    assert psnr > 35, f"PSNR {psnr:.1f} dB"
    assert images[1].std() > 0.01


def test_plugin_engines_contain_our_layers_and_match_plain_engines(tiny, tmp_path):
    """--plugins all on the tiny model: every replacement the passes report is a plugin layer of the built
    engine, TensorRT's per-layer profiler times each of them, and the image matches the plugin-free engines'."""
    from demo.backends import create_stages
    from demo.engine import BuildOptions, EngineSettings, ImageProfile
    from demo.engine_runtime import time_by_kind
    from demo.pipeline import GenerationRequest, Text2ImagePipeline
    from demo.report import StageTimer
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES
    from models.plugin_passes import read_pass_report
    from plugins import trt_plugins
    from plugins.contract import PLUGIN_KEYS

    if trt_plugins.status() != "built":
        pytest.skip(trt_plugins.status())
    profile = ImageProfile.for_request(tiny, 1, HEIGHT, WIDTH, static_batch=True, dynamic_shape=False)
    request = GenerationRequest(["a bowl of fruit"], [""], HEIGHT, WIDTH, steps=8, guidance_scale=7.5, seed=11)
    images = {}
    for name, plugins in (("none", ()), ("all", tuple(sorted(PLUGIN_KEYS)))):
        settings = EngineSettings(tmp_path / name / "onnx", tmp_path / name / "engine", profile,
                                  BuildOptions("tensorrt", 0, disabled_tactic_sources=("CUDNN",)), plugins=plugins)
        models = [STAGE_MODELS[stage](tiny) for stage in TEXT_TO_IMAGE_STAGES]
        stages = create_stages("tensorrt", models, CUDA, torch.float16, settings, log=QUIET, progress=QUIET)
        images[name] = Text2ImagePipeline(tiny, stages, "DDIM", CUDA, torch.float16)(request, StageTimer(CUDA))
        for model in models:
            found = dict(stages[model.name].engine.plugin_layers())
            report = read_pass_report(model.optimized_onnx_path(settings.onnx_dir))
            reported = {k: v["replaced"] for k, v in report.items() if v["replaced"]}
            assert found == reported, f"{model.name}: engine {found}, passes {reported}"
            if plugins:
                assert reported, f"{model.name}: no plugin replaced"
                # Every plugin layer is timed by name in the per-layer profile (the pipeline left shapes bound)
                engine = stages[model.name].engine
                by_kind = time_by_kind(engine.layer_times(runs=3), engine.layer_kinds())
                timed = {kind: ms for kind, ms in by_kind.items() if kind in PLUGIN_KEYS}
                assert set(timed) == set(reported) and min(timed.values()) > 0, f"{model.name}: {by_kind}"
            stages[model.name].close()
    mse = float(np.mean((images["all"] - images["none"]) ** 2))
    assert 10 * np.log10(1.0 / max(mse, 1e-12)) > 30


def test_int8_unet_engine_runs_int8_kernels_and_draws_the_torch_image(tiny, tmp_path):
    """--int8 with real TensorRT: the engine runs int8 kernels where the pass put Q/DQ (the inspector lists int8
    inputs), and the image stays near the fp16 torch pipeline's (35 dB on the CPU, ONNX Runtime computing the Q/DQ
    graph; 25 asked here)."""
    from demo.backends import create_stages
    from demo.calibrate import int8_request
    from demo.engine import BuildOptions, EngineSettings, ImageProfile
    from demo.pipeline import GenerationRequest, Text2ImagePipeline, image_psnr, to_uint8
    from demo.report import StageTimer
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES
    from models.quantize import read_int8_report

    profile = ImageProfile.for_request(tiny, 1, HEIGHT, WIDTH, static_batch=True, dynamic_shape=False)
    int8 = int8_request(tiny, ("a red car in the rain", "a bowl of fruit"), 8, "DDIM", 7.5, HEIGHT, WIDTH,
                        tmp_path / "onnx", QUIET, QUIET)
    settings = EngineSettings(tmp_path / "onnx", tmp_path / "engine", profile,
                              BuildOptions("tensorrt", 0, disabled_tactic_sources=("CUDNN",)), int8=int8)
    models = [STAGE_MODELS[stage](tiny) for stage in TEXT_TO_IMAGE_STAGES]
    engine_stages = create_stages("tensorrt", models, CUDA, torch.float16, settings, log=QUIET, progress=QUIET)
    quantized = sum(read_int8_report(models[1].optimized_onnx_path(settings.onnx_dir, int8=True))["quantized"].values())
    int8_layers = engine_stages["unet"].engine.int8_layers()
    print(f"int8 layers in the engine: {int8_layers} of {quantized} quantized")
    assert int8_layers > 0
    request = GenerationRequest(["a castle on a hill"], [""], HEIGHT, WIDTH, steps=12, guidance_scale=7.5, seed=5)
    torch_stages = create_stages("torch", models, CUDA, torch.float16)
    images = [to_uint8(Text2ImagePipeline(tiny, used, "DDIM", CUDA, torch.float16)(request, StageTimer(CUDA)))
              for used in (engine_stages, torch_stages)]
    psnr = image_psnr(*images)
    print(f"int8 engines against the torch pipeline: {psnr:.1f} dB")
    assert 25 < psnr < float("inf")
