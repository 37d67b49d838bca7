"""SD3's and Flux's engines on a GPU (issue 58, item 6): tiny-sd3's and tiny-flux's stages (the CLIPs, T5, the
transformer, the VAE) built with the TensorRT found here (8.6 and later), each against its torch module on identical
fresh inputs, with and without CUDA graphs, within the tolerance of the precision its engine is built in (fp16; T5 in
fp32 and the transformer in fp16 where the flavour has no bf16, bf16 where it has: Family.bf16_engines); the whole
text-to-image pipeline on engines against the torch pipeline in fp16; and with our plugins, every engine holding the
plugin layers its passes report (the transformer's: a joint attention, RMSNorm, modulated LayerNorm and GELU-tanh for
each its modules have) and drawing the plugin-free engines' picture. Each loaded from a PipelineSpec as every command
loads it; each model's engines built once for the module (tests/test_engines_gpu.py: the same for tiny's UNet)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from demo.backends.tensorrt.build import engine_dtype
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.settings import FALLBACK
from demo.request import TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline
from demo.runtime.spec import PipelineSpec, reference_spec
from models import stage_batch
from models.stages import text_to_image_stages
from tests.parity import torch_stages

pytestmark = [pytest.mark.gpu, pytest.mark.tensorrt]

QUIET = lambda *_: None  # noqa: E731
CUDA = torch.device("cuda")
SIZES = {"tiny-sd3": 64, "tiny-flux": 128}  # the least each takes (tests/test_engines_flow.py)
# The largest |engine - torch| a stage may give, relative to its output's largest value (at least 1), by the precision
# its engine runs in: fp16's as for tiny's UNet (tests/test_engines_gpu.py); fp32 the same, TensorRT computing its
# matrix products in TF32 unless told not to; bf16 (three fewer bits of mantissa than fp16) eight times fp16's.
TOLERANCE = {torch.float16: 2e-2, torch.float32: 2e-2, torch.bfloat16: 16e-2}
# Both pictures fp16 on the GPU, the engines' stages each within TOLERANCE of torch's, a flow's Euler steps adding no
# noise of their own: what stays is rounding, as for tiny's UNet (tests/test_engines_gpu.py asks 35 dB there; a
# root-mean-square error of 1.8% of the range, 4.5 of 255 levels).
PSNR_DB = 35


def request(model: str) -> Request:
    """SD3 guided with a negative prompt (the batches of classifier-free guidance), Flux [dev] its scale embedded
    (unguided batches); each at the least size it takes, a few flow-matching Euler steps (the model's scheduler)."""
    size = SIZES[model]
    sd3 = model == "tiny-sd3"
    return Request("a castle on a hill", "blurry" if sd3 else None, height=size, width=size, denoising_steps=8,
                   guidance_scale=5.0 if sd3 else 3.5, seed=5)


@pytest.fixture(scope="module", autouse=True)
def _tensorrt_runs_this_gpu():
    from demo.backends.tensorrt.flavour import why_cannot_run

    reason = why_cannot_run("tensorrt", torch.cuda.get_device_capability())
    if reason:
        pytest.skip(reason)


def engine_spec(model: str, folder, plugins: str = "none", **engine) -> PipelineSpec:
    """The model's text-to-image on static engines of TensorRT at its least size, in fp16 (the engines' default).
    cuDNN's tactics are not what is tested here, and TensorRT 8.6 installs may carry a cuDNN 8 stub: they are left
    out."""
    options = EngineOptions(onnx_dir=str(folder / "onnx"), engine_dir=str(folder / "engine"), build_static_batch=True,
                            optimization_level=0, disable_tactic_sources="CUDNN", **engine)
    size = SIZES[model]
    return PipelineSpec(model=model, backend="tensorrt", plugins=plugins, modes=(TEXT_TO_IMAGE,), height=size,
                        width=size, engine=options)


@pytest.fixture(scope="module", params=list(SIZES))
def built(request, tmp_path_factory):
    """Per model: its plugin-free engines' spec, the engines built by the first load (later loads find them cached);
    each test loads it with the CUDA-graph setting it needs."""
    model = request.param
    spec = engine_spec(model, tmp_path_factory.mktemp(f"{model}-engines"))
    with load_pipeline(spec, CUDA, progress=QUIET) as pipeline:
        assert all(type(stage).__name__ == "EngineStage" for stage in pipeline.stages.values())
    return spec


def render(spec: PipelineSpec, model: str) -> np.ndarray:
    """The model's request (resolved by the pipeline, as every face does) drawn by `spec`'s pipeline on the GPU."""
    with load_pipeline(spec, CUDA, progress=QUIET) as pipeline:
        return pipeline.run([pipeline.request(request(model))])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """dB between two float images in [0, 1]."""
    return 10 * np.log10(1.0 / max(float(np.mean((a - b) ** 2)), 1e-12))


@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["stream", "cuda-graph"])
def test_each_engine_matches_its_torch_module(built, use_cuda_graph):
    generator = torch.Generator().manual_seed(7)
    size = SIZES[built.model]
    with load_pipeline(replace(built, use_cuda_graph=use_cuda_graph), CUDA, progress=QUIET) as pipeline:
        source, plan = pipeline.plan.source, pipeline.plan.base
        assert tuple(pipeline.stages) == text_to_image_stages(source)  # every stage of the model, T5 too
        references = torch_stages(source, settings=FALLBACK, device=CUDA)
        for name, stage in pipeline.stages.items():
            settings = plan.settings_of(stage.model)
            # what the family builds this stage in for an fp16 pipeline (T5's fp32 where the flavour has no bf16)
            dtype = engine_dtype(stage.model, settings, pipeline.dtype)
            assert {stage.engine.torch_dtype(output) for output in stage.model.output_names} == {dtype}, name
            batch = stage_batch(name, 1, guided=settings.guided)  # SD3's doubled batches; Flux [dev]'s single
            stage.prepare(batch, size, size)
            assert stage.engine.has_graph == use_cuda_graph  # captured while preparing, not inside a run
            for _ in range(2):  # a second feed: replays must read the new inputs
                feed = stage.model.sample_inputs(batch, size, size, CUDA, pipeline.dtype, generator)
                for buffer in stage.engine.buffers.values():
                    if buffer.is_floating_point():
                        buffer.fill_(float("nan"))  # poisoned: every output element must be written
                outputs = stage(feed)
                expected = references[name]({k: v.float() if v.is_floating_point() else v for k, v in feed.items()})
                assert set(outputs) == set(expected) == set(stage.model.output_names), name
                for output_name, output in outputs.items():
                    reference = expected[output_name].float()
                    assert output.shape == reference.shape and torch.isfinite(output).all(), (name, output_name)
                    error = (output.float() - reference).abs().max().item()
                    scale = reference.abs().max().item()
                    assert error <= TOLERANCE[dtype] * max(scale, 1.0), \
                        f"{name} {output_name} ({dtype}): max |engine - torch| {error} (scale {scale})"


def test_pipeline_on_engines_matches_torch(built):
    engines = render(replace(built, use_cuda_graph=True), built.model)
    reference = render(replace(reference_spec(built), precision="fp16"), built.model)
    size = SIZES[built.model]
    assert engines.shape == reference.shape == (1, size, size, 3)
    measured = psnr(engines, reference)
    print(f"{built.model}: engines against the torch pipeline (fp16), {measured:.1f} dB")
    assert measured > PSNR_DB, f"PSNR {measured:.1f} dB"
    assert reference.std() > 0.01  # the comparison is between real pictures


def test_plugin_engines_contain_our_layers_and_match_plain_engines(built, tmp_path):
    """--plugins all: every replacement the passes report is a plugin layer of the built engine, and TensorRT's
    per-layer profiler times each of them; our kernels take fp16 alone, so the stages the family builds in fp32 or
    bf16 (T5, and the transformer where the flavour builds bf16) have none. The transformer's engine, where fp16, has
    one of ours for each joint attention, RMSNorm, modulation of a LayerNorm and GELU-tanh of its modules (counted
    from them: tests/test_plugin_passes.py). The picture matches the plugin-free engines'."""
    from demo.backends.tensorrt.runtime import time_by_kind
    from models.plugin_passes import read_pass_report
    from plugins import trt_plugins
    from plugins.contract import PLUGIN_KEYS
    from tests.test_plugin_passes import expected_transformer_passes

    if trt_plugins.status() != "built":
        pytest.skip(trt_plugins.status())
    model = built.model
    import tensorrt

    if model == "tiny-flux" and int(tensorrt.__version__.split(".")[0]) < 10:
        pytest.xfail(f"TensorRT {tensorrt.__version__} fails to build Flux's transformer with our plugins (an internal "
                     "error in its graph optimizer, addUnaryExpr, H200, 2026-12-03); plugin-free, it builds and passes")
    plain = render(built, model)
    spec = engine_spec(model, tmp_path, plugins="all")
    with load_pipeline(spec, CUDA, progress=QUIET) as pipeline:
        image = pipeline.run([pipeline.request(request(model))])
        plan = pipeline.plan.base
        for stage_model in plan.models:
            engine = pipeline.stages[stage_model.name].engine
            found = dict(engine.plugin_layers())
            report = read_pass_report(stage_model.optimized_onnx_path(tmp_path / "onnx"))
            reported = {k: v["replaced"] for k, v in report.items() if v["replaced"]}
            assert found == reported, f"{stage_model.name}: engine {found}, passes {reported}"
            if engine_dtype(stage_model, plan.settings_of(stage_model), pipeline.dtype) != torch.float16:
                assert not found, f"{stage_model.name}: plugin layers in an engine that is not fp16: {found}"
                continue
            assert reported, f"{stage_model.name}: no plugin replaced"
            if stage_model.name == plan.source.family.denoiser_stage:
                counts = expected_transformer_passes(stage_model.load_module())["counts"]
                assert found == {k: c["replaced"] for k, c in counts.items() if c["replaced"]}, stage_model.name
            # Every plugin layer is timed by name in the per-layer profile (the pipeline left shapes bound)
            by_kind = time_by_kind(engine.layer_times(runs=3), engine.layer_kinds())
            timed = {kind: ms for kind, ms in by_kind.items() if kind in PLUGIN_KEYS}
            assert set(timed) == set(reported) and min(timed.values()) > 0, f"{stage_model.name}: {by_kind}"
    measured = psnr(image, plain)
    print(f"{model}: plugin engines against plugin-free ones, {measured:.1f} dB")
    assert measured > 30, f"PSNR {measured:.1f} dB"
