"""The engine layer end to end on a CPU, with a stand-in TensorRT (tests/fake_tensorrt.py) of each API
generation the toolkit serves (8.6 and 10.x): build, load, bind, check, run, and the pipeline on top.

The stand-in reads inputs from and writes outputs to the raw addresses it is bound to and scribbles
over its device memory on every run, so lifetime and aliasing bugs give wrong numbers here too.
"""

import gc
import sys
import time

import onnx
import onnx.helper as helper
import pytest
import torch

from core.errors import UsageError
from demo.backends.base import Stage
from demo.backends.tensorrt.build import (
    BuildOptions,
    BuildProgress,
    EngineBuildError,
    EngineSettings,
    ImageProfile,
    build_engine_file,
    prepare_stage_engines,
)
from demo.backends.tensorrt.flavour import TensorRTAPI
from demo.backends.tensorrt.runtime import (
    CONCAT_COPY,
    GENERATED,
    INT8,
    REFORMAT,
    Engine,
    EngineMismatchError,
    create_engine_stages,
    layer_kind,
    plugin_counts,
    time_by_kind,
)
from demo.pipelines import StageTimer, Text2ImagePipeline
from demo.request import Request
from models import CLIP, STAGE_MODELS, UNET, VAE, stage_batch
from tests import fake_tensorrt

SD_STAGES = (CLIP, UNET, VAE)  # the text-to-image stages of an SD 1.x/2.x model (tiny's)

QUIET = lambda *_: None  # noqa: E731
CPU = torch.device("cpu")
HEIGHT, WIDTH = 64, 48


@pytest.fixture(params=["8.6.0", "10.8.0"], ids=["trt8.6", "trt10"])
def trt(request, monkeypatch):
    return fake_tensorrt.install(monkeypatch, request.param)


@pytest.fixture(scope="module")
def onnx_dir(tiny, tmp_path_factory):
    """fp32 ONNX of the tiny model's stages, exported once (the stand-in runs it with ONNX Runtime)."""
    root = tmp_path_factory.mktemp("onnx")
    for name in SD_STAGES:
        STAGE_MODELS[name](tiny).prepare_onnx(root, "cpu", torch.float32, log=QUIET)
    return root


def engine_settings(onnx_dir, tmp_path, tiny, guided=True, batch=1, static=True) -> EngineSettings:
    profile = ImageProfile.for_request(tiny, batch, HEIGHT, WIDTH, static_batch=static, dynamic_shape=False)
    return EngineSettings(onnx_dir, tmp_path / "engine", profile, BuildOptions("tensorrt", 0), guided=guided)


def build(tiny, onnx_dir, tmp_path, **kwargs):
    models = [STAGE_MODELS[name](tiny) for name in SD_STAGES]
    settings = engine_settings(onnx_dir, tmp_path, tiny, **kwargs)
    return models, prepare_stage_engines(models, settings, CPU, torch.float32, QUIET, QUIET)


def engine_stages(trt, tiny, onnx_dir, tmp_path, **kwargs):
    models, engines = build(tiny, onnx_dir, tmp_path, **kwargs)
    settings = engine_settings(onnx_dir, tmp_path, tiny, **kwargs)
    return create_engine_stages(models, engines, TensorRTAPI("tensorrt"), torch.float32, settings, CPU, QUIET)


@pytest.mark.parametrize("scheduler, guidance", [("PNDM", 1.0), ("DDIM", 7.5)])
def test_pipeline_on_engines_matches_the_torch_pipeline(trt, tiny, tiny_stages, onnx_dir, tmp_path, scheduler,
                                                        guidance):
    # PNDM keeps past model outputs; unguided, each is the UNet's output as returned: had the engine
    # handed out its output buffer, every history entry would be the latest one.
    stages = engine_stages(trt, tiny, onnx_dir, tmp_path, guided=guidance > 1)
    request = Request("a red car", "", height=HEIGHT, width=WIDTH, denoising_steps=6, guidance_scale=guidance, seed=3)
    images = {}
    for backend, used in (("engine", stages), ("torch", tiny_stages)):
        pipeline = Text2ImagePipeline(tiny, used, scheduler, CPU, torch.float32)
        images[backend] = pipeline(request, StageTimer(CPU))
    assert images["engine"].shape == (1, HEIGHT, WIDTH, 3)
    assert abs(images["engine"] - images["torch"]).max() < 1e-3
    assert images["torch"].std() > 0.01  # the comparison is between real pictures


def test_outputs_are_not_overwritten_by_the_next_run(trt, tiny, onnx_dir, tmp_path):
    unet = engine_stages(trt, tiny, onnx_dir, tmp_path, guided=False)["unet"]
    unet.prepare(1, HEIGHT, WIDTH)
    generator = torch.Generator().manual_seed(0)
    first_feed = unet.model.sample_inputs(1, HEIGHT, WIDTH, generator=generator)
    first = unet(first_feed)["latent"]
    kept = first.clone()
    second = unet(unet.model.sample_inputs(1, HEIGHT, WIDTH, generator=generator))["latent"]
    assert not torch.equal(second, kept)
    assert torch.equal(first, kept)


def test_layer_times_are_per_run_means_from_a_context_of_their_own(trt, tiny, onnx_dir, tmp_path):
    unet = engine_stages(trt, tiny, onnx_dir, tmp_path, guided=False)["unet"]
    with pytest.raises(RuntimeError, match="before prepare"):
        unet.engine.layer_times(runs=2)
    unet.prepare(1, HEIGHT, WIDTH)
    feed = unet.model.sample_inputs(1, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(3))
    expected = unet(feed)["latent"]
    runs = unet.engine.context.runs
    times = unet.engine.layer_times(runs=3)
    layers = unet.engine.engine.onnx_nodes()
    assert len(times) == len(layers) > 10
    assert times == pytest.approx({name: fake_tensorrt.fake_layer_ms(i) for i, (name, _) in enumerate(layers)})
    # The engine's own context neither ran nor got the profiler, and runs as before.
    assert unet.engine.context.runs == runs and unet.engine.context.profiler is None
    assert torch.equal(unet(feed)["latent"], expected)
    assert set(unet.engine.layer_kinds()) == set(times) and set(unet.engine.layer_kinds().values()) == {GENERATED}


def test_layer_kinds_tell_plugins_concat_copies_format_conversions_and_int8_apart():
    """Layer names as TensorRT 8.6 gave them in sd1.5-arch's UNet engine on an H200 (2026-11-26; layer types and
    input formats as its inspector writes them), where the concatenation copies and the format conversions were one
    kind, so their split was not known."""
    def layer(name, layer_type, *input_types):
        return {"Name": name, "LayerType": layer_type, "Inputs": [{"Format/Datatype": t} for t in input_types]}

    assert layer_kind(layer("/unet/up_blocks.3/resnets.0/nonlinearity/Mul_output_0/SDPGroupNorm", "PluginV2")) \
        == "GroupNorm"
    assert layer_kind(layer("/unet/up_blocks.1/x/SomeonesPlugin", "PluginV2")) == "other"
    assert layer_kind(layer("/unet/down_blocks.1/attentions.0/Add_output_0 copy", "Reformat", "Half")) == CONCAT_COPY
    assert layer_kind(layer("Reformatting CopyNode for Input Tensor 0 to /unet/conv_in/Conv", "Reformat",
                            "Row major linear FP16 format (kLINEAR)")) == REFORMAT
    assert layer_kind(layer("/unet/conv_in/Conv", "CaskConvolution", "Int8 format")) == INT8
    assert layer_kind(layer("{ForeignNode[unet.down_blocks.0.attentions.0.transformer_blocks.0.norm3.weight...]}",
                            "Myelin", "Half")) == GENERATED


def test_time_by_kind_sums_layers_and_counts_unlisted_ones_as_generated():
    kinds = {"a/SDPGroupNorm": "GroupNorm", "b/SDPGroupNorm": "GroupNorm", "copy": REFORMAT, "conv": GENERATED}
    layer_ms = {"a/SDPGroupNorm": 0.5, "b/SDPGroupNorm": 0.25, "copy": 0.125, "conv": 1.0, "myelin piece": 2.0}
    assert time_by_kind(layer_ms, kinds) == {"GroupNorm": 0.75, REFORMAT: 0.125, GENERATED: 3.0}
    assert plugin_counts(kinds) == {"GroupNorm": 2}  # reformats and TensorRT's own layers are no plugins


def test_shared_device_memory_lives_as_long_as_the_engines(trt, tiny, onnx_dir, tmp_path):
    stages = engine_stages(trt, tiny, onnx_dir, tmp_path)
    gc.collect()
    blocks = {id(stage.engine.device_memory) for stage in stages.values()}
    assert len(blocks) == 1  # one block shared by all stages
    for stage in stages.values():
        address, size = stage.engine.context.scratch
        assert stage.engine.device_memory.data_ptr() == address
        assert stage.engine.device_memory.numel() >= size >= fake_tensorrt.DEVICE_MEMORY_BYTES
    # Buffers allocated afterwards must not land inside the block TensorRT works in.
    for name, stage in stages.items():
        stage.prepare(stage_batch(name, 1, guided=True), HEIGHT, WIDTH)
        for buffer in stage.engine.buffers.values():
            start = buffer.data_ptr()
            assert not address <= start < address + size


def test_an_engine_of_another_stage_is_refused(trt, tiny, onnx_dir, tmp_path):
    models, engines = build(tiny, onnx_dir, tmp_path)
    api = TensorRTAPI("tensorrt")
    vae_engine = Engine(api, engines["vae"], "unet", CPU, False)
    with pytest.raises(EngineMismatchError, match=r"unet: the engine binds \['latent'\] -> \['images'\], the model "
                                                  r"class \['sample', 'timestep', 'encoder_hidden_states'\]"):
        vae_engine.check_model(models[1], torch.float32)
    clip_engine = Engine(api, engines["clip"], "clip", CPU, False)
    with pytest.raises(EngineMismatchError, match="text_embeddings is torch.float32, expected torch.float16"):
        clip_engine.check_model(models[0], torch.float16)


def test_output_shapes_come_from_the_engine_and_are_checked(trt, tiny, onnx_dir, tmp_path):
    vae = engine_stages(trt, tiny, onnx_dir, tmp_path)["vae"]
    vae.engine.prepare(vae.model.input_shapes(1, HEIGHT, WIDTH), {"images": (1, 3, HEIGHT, WIDTH)})
    with pytest.raises(EngineMismatchError, match=r"output 'images' comes out \[1, 3, 64, 48\], the model class "
                                                  r"expects \[1, 3, 128, 96\]"):
        vae.engine.prepare(vae.model.input_shapes(1, HEIGHT, WIDTH), {"images": (1, 3, 2 * HEIGHT, 2 * WIDTH)})


def test_shapes_outside_the_profile(trt, tiny, onnx_dir, tmp_path, monkeypatch):
    unet = engine_stages(trt, tiny, onnx_dir, tmp_path, batch=1, static=True)["unet"]
    with pytest.raises(UsageError, match=r"unet engine input 'sample' shape \[4, 4, 32, 24\] is outside the engine's "
                                         r"profile \(min \[2, 4, 32, 24\], max \[2, 4, 32, 24\]\)"):
        unet.prepare(4, HEIGHT, WIDTH)
    # Where our profile reading and TensorRT disagree, TensorRT's refusal is an error, not ignored.
    monkeypatch.setattr(Engine, "profile", lambda self, name: ((0,) * 4, None, (99,) * 4) if name == "sample"
                        else tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(name, 0)))
    with pytest.raises(EngineMismatchError, match=r"TensorRT refused shape \[4, 4, 32, 24\] for input 'sample'"):
        unet.engine.prepare({"sample": (4, 4, 32, 24), "timestep": (1,), "encoder_hidden_states": (2, 77, 32)},
                            {"latent": (4, 4, 32, 24)})


def test_run_before_prepare_and_unbound_memory_are_errors(trt, tiny, onnx_dir, tmp_path):
    models, engines = build(tiny, onnx_dir, tmp_path)
    engine = Engine(TensorRTAPI("tensorrt"), engines["vae"], "vae", CPU, False)
    with pytest.raises(RuntimeError, match="no device memory bound"):
        engine.prepare(models[2].input_shapes(1, HEIGHT, WIDTH), models[2].output_shapes(1, HEIGHT, WIDTH))
    with pytest.raises(RuntimeError, match="run before prepare"):
        engine.run({"latent": torch.randn(1, 4, 32, 24)})


def test_corrupt_engine_file_is_a_clear_error(trt, tiny, onnx_dir, tmp_path):
    _, engines = build(tiny, onnx_dir, tmp_path)
    engines["vae"].write_bytes(b"garbage")
    with pytest.raises(EngineMismatchError, match="could not deserialize .*force_engine_build"):
        Engine(TensorRTAPI("tensorrt"), engines["vae"], "vae", CPU, False)


def _vae_like_onnx(path, elem_type):
    x = helper.make_tensor_value_info("latent", elem_type, [1, 4, 8, 8])
    y = helper.make_tensor_value_info("images", elem_type, [1, 4, 8, 8])
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Relu", ["latent"], ["images"])], "g", [x], [y])),
              str(path))
    return path


@pytest.mark.parametrize("elem_type, half", [(onnx.TensorProto.FLOAT16, True), (onnx.TensorProto.FLOAT, False)])
def test_build_settings_follow_the_api_generation(trt, tiny, tmp_path, elem_type, half):
    onnx_path = _vae_like_onnx(tmp_path / "vae.onnx", elem_type)
    shapes = {"latent": ((1, 4, 8, 8),) * 3}
    options = BuildOptions("tensorrt", 0, disabled_tactic_sources=("CUDNN",))
    build_engine_file(tmp_path / "vae.engine", onnx_path, STAGE_MODELS["vae"](tiny), shapes, options, QUIET)
    built = trt.last_build
    flags = trt.NetworkDefinitionCreationFlag
    if trt.__version__.startswith("8."):  # no strong typing: explicit batch, and fp16 allowed by flag
        assert built["flags"] == 1 << int(flags.EXPLICIT_BATCH)
        assert built["config_flags"] == (["FP16"] if half else [])
    else:  # strongly typed: the ONNX types decide, no precision flag
        assert built["flags"] == 1 << int(flags.STRONGLY_TYPED)
        assert built["config_flags"] == []
    sources = trt.TacticSource
    assert built["tactic_sources"] == 1 << int(sources.EDGE_MASK_CONVOLUTIONS)  # the defaults, CUDNN still off
    enabled = BuildOptions("tensorrt", 0, disabled_tactic_sources=("EDGE_MASK_CONVOLUTIONS",),
                           enabled_tactic_sources=("CUBLAS", "CUBLAS_LT"))
    build_engine_file(tmp_path / "vae3.engine", onnx_path, STAGE_MODELS["vae"](tiny), shapes, enabled, QUIET)
    assert trt.last_build["tactic_sources"] == (1 << int(sources.CUBLAS)) | (1 << int(sources.CUBLAS_LT))
    with pytest.raises(UsageError, match="has no tactic source CUDNN8"):
        build_engine_file(tmp_path / "vae2.engine", onnx_path, STAGE_MODELS["vae"](tiny), shapes,
                          BuildOptions("tensorrt", 0, disabled_tactic_sources=("CUDNN8",)), QUIET)
    with pytest.raises(UsageError, match="has no tactic source CUBLAS9"):
        build_engine_file(tmp_path / "vae2.engine", onnx_path, STAGE_MODELS["vae"](tiny), shapes,
                          BuildOptions("tensorrt", 0, enabled_tactic_sources=("CUBLAS9",)), QUIET)


def test_parse_errors_name_the_node(trt, tiny, tmp_path):
    x = helper.make_tensor_value_info("latent", onnx.TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, [1, 4])
    node = helper.make_node("NoSuchOp", ["latent"], ["images"], name="broken_node")
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], [y])), str(path))
    with pytest.raises(EngineBuildError, match=r"vae: ONNX parse of .* failed at node 'broken_node' \(NoSuchOp\)"):
        build_engine_file(tmp_path / "bad.engine", path, STAGE_MODELS["vae"](tiny), {},
                          BuildOptions("tensorrt", 0), QUIET)


def test_tensorrt_older_than_8_6_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt.make_module("8.5.3"))
    with pytest.raises(UsageError, match=r"tensorrt 8.5.3 is too old: this toolkit needs 8.6 or newer"):
        TensorRTAPI("tensorrt")


def test_build_progress_keeps_talking_during_a_silent_build(trt):
    messages = []
    with BuildProgress(TensorRTAPI("tensorrt"), "unet", messages.append, heartbeat_s=0.02):
        time.sleep(0.15)
    assert messages[0] == f"[build] unet: building the engine with tensorrt {trt.__version__} ..."
    assert sum("[build] unet: still building (" in m for m in messages) >= 2
    assert messages[-1].startswith("[build] unet: engine built in ")


def test_cached_engines_are_found_without_exporting_again(trt, tiny, onnx_dir, tmp_path, monkeypatch):
    build(tiny, onnx_dir, tmp_path)
    exported = []
    # An export here would break a build.
    monkeypatch.setattr("models.base.StageModel.prepare_onnx", lambda *a, **k: exported.append(a))
    models, engines = build(tiny, onnx_dir, tmp_path)
    assert exported == [] and set(engines) == set(SD_STAGES)


def test_a_timing_cache_is_written_and_one_from_another_device_is_left_alone(trt, tiny, onnx_dir, tmp_path):
    cache = tmp_path / "timing.cache"
    profile = ImageProfile.for_request(tiny, 1, HEIGHT, WIDTH, static_batch=True, dynamic_shape=False)
    models = [STAGE_MODELS["unet"](tiny)]

    def build_with_cache(folder: str) -> list[str]:
        said = []
        settings = EngineSettings(onnx_dir, tmp_path / folder, profile, BuildOptions("tensorrt", 0, timing_cache=cache))
        prepare_stage_engines(models, settings, CPU, torch.float32, QUIET, said.append)
        return said

    build_with_cache("first")
    assert cache.read_bytes()  # what the build timed, for the next one
    cache.write_bytes(fake_tensorrt.OTHER_DEVICE_CACHE + b" (an H200's, say)")
    said = build_with_cache("second")
    assert [line for line in said if "timing cache" in line] == [
        f"[build] unet: timing cache {cache} is from another GPU or TensorRT version: not used, and left as it is"]
    assert cache.read_bytes() == fake_tensorrt.OTHER_DEVICE_CACHE + b" (an H200's, say)"
    assert (tmp_path / "second" / "unet.engine").stat().st_size > 0


def test_latents_and_scheduler_stay_fp32_with_fp16_stages(tiny, monkeypatch):
    """fp16 engines see fp16 inputs, but the latents the scheduler steps are fp32, as in diffusers."""
    seen = []

    class HalfStage(Stage):
        def __call__(self, feed):
            seen.append((self.name, {k: v.dtype for k, v in feed.items()}))
            (name,) = self.model.output_names
            batch = next(iter(feed.values())).shape[0]
            shape = self.model.output_shapes(batch, HEIGHT, WIDTH)[name]
            return {name: torch.randn(shape).half()}

    stages = {name: HalfStage(STAGE_MODELS[name](tiny)) for name in SD_STAGES}
    pipeline = Text2ImagePipeline(tiny, stages, "DDIM", CPU, torch.float16)
    stepped = []
    original = pipeline.scheduler.step
    monkeypatch.setattr(pipeline.scheduler, "step", lambda out, t, sample, **kw: stepped.append(
        (out.dtype, sample.dtype)) or original(out, t, sample, **kw))
    pipeline(Request("a cat", "", height=HEIGHT, width=WIDTH, denoising_steps=3, guidance_scale=7.5, seed=1),
             StageTimer(CPU))
    assert stepped == [(torch.float32, torch.float32)] * 3
    unet_inputs = [dtypes for name, dtypes in seen if name == "unet"]
    assert unet_inputs == [{"sample": torch.float16, "timestep": torch.float32,
                            "encoder_hidden_states": torch.float16}] * 3
    assert [dtypes for name, dtypes in seen if name == "vae"] == [{"latent": torch.float16}]
