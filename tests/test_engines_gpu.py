"""Real TensorRT engines on a GPU: the tiny model's CLIP, UNet and VAE built with the TensorRT found here (8.6 and
later), run against the torch modules on identical fresh inputs, with and without CUDA graphs, and the whole pipeline
on engines against the torch pipeline, each loaded from a PipelineSpec as every command loads it."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.settings import FALLBACK
from demo.pipelines import image_psnr, to_uint8
from demo.request import TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline
from demo.runtime.spec import PipelineSpec, reference_spec
from models import stage_batch
from tests.parity import torch_stages

pytestmark = [pytest.mark.gpu, pytest.mark.tensorrt]

QUIET = lambda *_: None  # noqa: E731
HEIGHT, WIDTH = 64, 48
CUDA = torch.device("cuda")
REQUEST = Request("a castle on a hill", "", height=HEIGHT, width=WIDTH, denoising_steps=12, guidance_scale=7.5,
                  seed=5, scheduler="DDIM")


@pytest.fixture(scope="module", autouse=True)
def _tensorrt_runs_this_gpu():
    from demo.backends.tensorrt.flavour import why_cannot_run

    reason = why_cannot_run("tensorrt", torch.cuda.get_device_capability())
    if reason:
        pytest.skip(reason)


def engine_spec(folder, plugins: str = "none", **engine) -> PipelineSpec:
    """tiny's text-to-image on static engines of TensorRT at the test's size. cuDNN's tactics are not what is tested
    here, and TensorRT 8.6 installs may carry a cuDNN 8 stub: they are left out."""
    options = EngineOptions(onnx_dir=str(folder / "onnx"), engine_dir=str(folder / "engine"), build_static_batch=True,
                            optimization_level=0, disable_tactic_sources="CUDNN", **engine)
    return PipelineSpec(model="tiny", backend="tensorrt", plugins=plugins, modes=(TEXT_TO_IMAGE,), height=HEIGHT,
                        width=WIDTH, scheduler="DDIM", engine=options)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The engines' spec, built once; each test loads it with the CUDA-graph setting it needs."""
    return engine_spec(tmp_path_factory.mktemp("gpu-engines"))


@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["stream", "cuda-graph"])
def test_each_engine_matches_its_torch_module(built, tiny, use_cuda_graph):
    generator = torch.Generator().manual_seed(7)
    references = torch_stages(tiny, settings=FALLBACK, device=CUDA)
    with load_pipeline(replace(built, use_cuda_graph=use_cuda_graph), CUDA, progress=QUIET) as pipeline:
        for name, stage in pipeline.stages.items():
            batch = stage_batch(name, 1, guided=True)
            stage.prepare(batch, HEIGHT, WIDTH)
            assert stage.engine.has_graph == use_cuda_graph  # captured while preparing, not inside a run
            reference = references[name]
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


def torch_image(spec: PipelineSpec) -> np.ndarray:
    """The request's image from the torch modules as they are, in fp16 on the GPU."""
    with load_pipeline(replace(reference_spec(spec), precision="fp16"), CUDA, progress=QUIET) as pipeline:
        return pipeline.run([REQUEST])


def test_pipeline_on_engines_matches_torch(built):
    with load_pipeline(replace(built, use_cuda_graph=True), CUDA, progress=QUIET) as pipeline:
        engines = pipeline.run([REQUEST])
    reference = torch_image(built)
    mse = float(np.mean((engines - reference) ** 2))
    psnr = 10 * np.log10(1.0 / max(mse, 1e-12))
    assert psnr > 35, f"PSNR {psnr:.1f} dB"
    assert reference.std() > 0.01


def test_plugin_engines_contain_our_layers_and_match_plain_engines(tmp_path):
    """--plugins all on the tiny model: every replacement the passes report is a plugin layer of the built
    engine, TensorRT's per-layer profiler times each of them, and the image matches the plugin-free engines'."""
    from demo.backends.tensorrt.runtime import time_by_kind
    from models.plugin_passes import read_pass_report
    from plugins import trt_plugins
    from plugins.contract import PLUGIN_KEYS

    if trt_plugins.status() != "built":
        pytest.skip(trt_plugins.status())
    images = {}
    for name in ("none", "all"):
        spec = engine_spec(tmp_path / name, plugins=name)
        with load_pipeline(spec, CUDA, progress=QUIET) as pipeline:
            images[name] = pipeline.run([replace(REQUEST, prompt="a bowl of fruit", denoising_steps=8, seed=11)])
            for model in pipeline.plan.base.models:
                engine = pipeline.stages[model.name].engine
                found = dict(engine.plugin_layers())
                report = read_pass_report(model.optimized_onnx_path(tmp_path / name / "onnx"))
                reported = {k: v["replaced"] for k, v in report.items() if v["replaced"]}
                assert found == reported, f"{model.name}: engine {found}, passes {reported}"
                if name == "all":
                    assert reported, f"{model.name}: no plugin replaced"
                    # Every plugin layer is timed by name in the per-layer profile (the pipeline left shapes bound)
                    by_kind = time_by_kind(engine.layer_times(runs=3), engine.layer_kinds())
                    timed = {kind: ms for kind, ms in by_kind.items() if kind in PLUGIN_KEYS}
                    assert set(timed) == set(reported) and min(timed.values()) > 0, f"{model.name}: {by_kind}"
    mse = float(np.mean((images["all"] - images["none"]) ** 2))
    assert 10 * np.log10(1.0 / max(mse, 1e-12)) > 30


def test_int8_unet_engine_runs_int8_kernels_and_draws_the_torch_image(tmp_path):
    """--int8 with real TensorRT: the engine runs int8 kernels where the pass put Q/DQ (the inspector lists int8
    inputs), and the image stays near the fp16 torch pipeline's (35 dB on the CPU, ONNX Runtime computing the Q/DQ
    graph; 25 asked here). The calibration renders through the torch pipeline on this GPU."""
    from models.quantize import read_int8_report

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red car in the rain\na bowl of fruit\n")
    spec = engine_spec(tmp_path, int8=True, calibration_prompts=str(prompts), calibration_steps=8)
    with load_pipeline(spec, CUDA, progress=QUIET) as pipeline:
        unet = pipeline.stages["unet"]
        quantized = sum(read_int8_report(unet.model.optimized_onnx_path(tmp_path / "onnx", int8=True))
                        ["quantized"].values())
        int8_layers = unet.engine.int8_layers()
        print(f"int8 layers in the engine: {int8_layers} of {quantized} quantized")
        assert int8_layers > 0
        images = [to_uint8(pipeline.run([REQUEST])), to_uint8(torch_image(spec))]
    psnr = image_psnr(*images)
    print(f"int8 engines against the torch pipeline: {psnr:.1f} dB")
    assert 25 < psnr < float("inf")


def test_controlnets_on_engines_draw_the_torch_image(tmp_path):
    """Two ControlNets on TensorRT engines with CUDA graphs (each one's conditioning embedding an engine run once per
    call, its per-step engine handing the residuals to the UNet's by name) draw the torch modules' picture; the
    picture with both at scale 0 is far further from it than the engines' error (the residuals reach the UNet: on an
    H200, 58.0 dB against the torch picture, 39.4 dB between the steered and unsteered pictures)."""
    from tests.test_controlnet import picture

    request = replace(REQUEST, height=64, width=64, denoising_steps=8, control_guidance_start=0.2,
                      control_images=(picture(11), picture(12)))
    spec = replace(engine_spec(tmp_path), height=64, width=64, use_cuda_graph=True,
                   controlnets=(("tiny-controlnet", 0.6), ("tiny-controlnet", 1.1)))
    with load_pipeline(spec, CUDA, progress=QUIET) as pipeline:
        engines = to_uint8(pipeline.run([request]))
        assert {"controlnet0", "controlnet0_image", "controlnet1", "controlnet1_image"} <= set(pipeline.stages)
        assert all(stage.engine.has_graph for stage in pipeline.stages.values())
    with load_pipeline(replace(reference_spec(spec), precision="fp16"), CUDA, progress=QUIET) as pipeline:
        reference = to_uint8(pipeline.run([request]))
    unsteered = replace(spec, controlnets=(("tiny-controlnet", 0.0), ("tiny-controlnet", 0.0)))
    with load_pipeline(unsteered, CUDA, progress=QUIET) as pipeline:
        without = to_uint8(pipeline.run([request]))
    psnr = image_psnr(engines, reference)
    print(f"ControlNet engines against the torch pipeline: {psnr:.1f} dB, "
          f"largest pixel difference {np.abs(engines.astype(int) - reference.astype(int)).max()}")
    assert psnr > 35
    assert image_psnr(engines, without) < psnr - 10
