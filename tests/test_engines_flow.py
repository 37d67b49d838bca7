"""SD3's and Flux's engines (models.families: ENGINES): the whole pipeline on engines of the stand-in TensorRT
(tests/fake_tensorrt.py runs their ONNX with ONNX Runtime) draws the torch backend's image, text-to-image and
image-to-image; which precision each stage's engine takes (bf16 where the flavour builds it, else the family's
fallback: T5 in fp32); TensorRT for RTX building them on this CPU through build-engines, T5's weights as external data
where the ONNX is over 2 GB; and what the engines do not take yet refused in one line, exit 2, before any work."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from demo.backends.tensorrt.build import BuildOptions, EngineSettings, ImageProfile, engine_dtype
from demo.backends.tensorrt.options import EngineOptions
from demo.pipelines import StageTimer, make_pipeline, to_uint8
from demo.request import IMAGE_TO_IMAGE, TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline
from demo.runtime.spec import PipelineSpec
from models import CLIP, CLIP2, FLUX_TRANSFORMER, STAGE_MODELS, T5, TRANSFORMER, VAE, VAE_ENCODER
from models.families import CONTROLNET, INPAINTING, INT8, LORA, SD3, STEP_CACHE
from models.source import resolve_model
from models.stages import image_to_image_stages
from tests.parity import torch_stages

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731
SIZES = {"tiny-sd3": 64, "tiny-flux": 128}  # the least each takes (tests/test_flux.py)
IMAGE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8))


@pytest.fixture
def trt(monkeypatch):
    from tests import fake_tensorrt

    return fake_tensorrt.install(monkeypatch, "10.8.0")


def requests(model: str) -> list[Request]:
    """Text-to-image (SD3 guided with a negative prompt, Flux [dev] its scale embedded) and image-to-image."""
    size = SIZES[model]
    return [Request("a cat on a table", "blurry" if model == "tiny-sd3" else None, height=size, width=size,
                    denoising_steps=3, seed=4, guidance_scale=5.0),
            Request("a red barn", None, image=IMAGE.resize((size, size)), strength=0.7, height=size, width=size,
                    denoising_steps=4, seed=2, guidance_scale=4.0)]


@pytest.mark.parametrize("model", list(SIZES))
def test_engines_draw_the_torch_backends_image(trt, model, tmp_path):
    made = requests(model)
    size = SIZES[model]
    modes = tuple(r.mode for r in made)
    spec = PipelineSpec(model=model, backend="tensorrt", precision="fp32", plugins="none", modes=modes, height=size,
                        width=size, engine=EngineOptions(onnx_dir=str(tmp_path / "onnx"),
                                                         engine_dir=str(tmp_path / "engine"),
                                                         build_static_batch=True, optimization_level=0))
    source = resolve_model(model)
    with load_pipeline(spec, CPU, progress=QUIET) as on_engines:
        assert type(on_engines.stages[source.family.denoiser_stage]).__name__ == "EngineStage"
        resolved = [on_engines.request(r) for r in made]
        engine_images = [on_engines.run([r]) for r in resolved]
    stages = torch_stages(source, image_to_image_stages(source) if IMAGE_TO_IMAGE in modes else None)
    for request, engine_image in zip(resolved, engine_images):
        torch_image = make_pipeline(source, stages, request.scheduler, CPU, torch.float32, request.mode)(
            request, StageTimer(CPU))
        assert engine_image.shape == torch_image.shape == (1, size, size, 3)
        assert abs(engine_image - torch_image).max() < 1e-3, request.mode
        assert to_uint8(torch_image).std() > 5  # the comparison is between real pictures


@pytest.mark.parametrize("bfloat16, t5, denoiser", [(True, torch.bfloat16, torch.bfloat16),
                                                     (False, torch.float32, torch.float16)])
@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_each_stage_engine_takes_its_precision(model, bfloat16, t5, denoiser, tmp_path):
    """fp16 pipelines: T5 and the transformer in bf16 where the flavour builds it (TensorRT 10+, for RTX); else
    T5 in fp32 (it overflows fp16 in its feed-forward) and the transformer in fp16; the CLIPs and the VAE in fp16.
    An fp32 pipeline's engines are all fp32."""
    source = resolve_model(model)
    profile = ImageProfile.for_request(source, 1, SIZES[model], SIZES[model], True, False)
    settings = EngineSettings(tmp_path, tmp_path, profile, BuildOptions("tensorrt"), bfloat16=bfloat16)
    wanted = {CLIP: torch.float16, CLIP2: torch.float16, T5: t5, TRANSFORMER: denoiser, FLUX_TRANSFORMER: denoiser,
              VAE: torch.float16, VAE_ENCODER: torch.float16}
    for name in image_to_image_stages(source):
        stage = STAGE_MODELS[name](source)
        assert engine_dtype(stage, settings, torch.float16) == wanted[name], name
        assert engine_dtype(stage, settings, torch.float32) == torch.float32


def test_t5s_engine_where_the_flavour_has_no_bf16_is_fp32_and_gives_torchs_states(monkeypatch, tmp_path):
    """TensorRT 8.6 (the stand-in's): an fp16 pipeline's T5 engine is exported and built in fp32 (input ids in, fp32
    states out, which the pipelines cast as they cast the torch backend's) and gives the fp32 torch T5's states."""
    from demo.backends.tensorrt.build import prepare_stage_engines
    from demo.backends.tensorrt.flavour import TensorRTAPI
    from demo.backends.tensorrt.runtime import create_engine_stages
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "8.6.0")
    source = resolve_model("tiny-flux")
    model = STAGE_MODELS[T5](source)
    profile = ImageProfile.for_request(source, 1, 128, 128, True, False)
    settings = EngineSettings(tmp_path / "onnx", tmp_path / "engine", profile, BuildOptions("tensorrt", 0),
                              guided=False)
    engines = prepare_stage_engines([model], settings, CPU, torch.float16, QUIET, QUIET)
    assert manifest_key(tmp_path / "engine", T5)["onnx"]["dtype"] == "float32"
    stage = create_engine_stages([model], engines, TensorRTAPI("tensorrt"), torch.float16, settings, CPU, QUIET)[T5]
    stage.prepare(1, 128, 128)
    ids = model.sample_inputs(1, 128, 128, generator=torch.Generator().manual_seed(5))["input_ids"]
    states = stage({"input_ids": ids})["text_embeddings"]
    with torch.no_grad():
        expected = model.load_module()(ids)
    assert states.dtype == torch.float32 and torch.allclose(states, expected, atol=1e-5)
    stage.close()


# ---- TensorRT for RTX on this CPU ------------------------------------------------------------------------------------

def manifest_key(engine_dir, stage) -> dict:
    return json.loads((engine_dir / f"{stage}.engine.json").read_text())["key"]


@pytest.fixture(scope="module")
def rtx():
    return pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")


def build_engines(model, tmp_path, *args):
    from demo.cli.build_engines import main

    return main(["--model", model, "--backend", "tensorrt-rtx", "--target-cc", "8.9", "--optimization-level", "0",
                 "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine"), *args])


def test_build_engines_builds_sd3s_engines_on_this_cpu(rtx, tmp_path, capsys):
    """Every text-to-image stage, T5 and the transformer in bf16, for the doubled batch of classifier-free guidance
    and T5's 256 tokens; a second run finds them all cached; a damaged one is rebuilt."""
    assert build_engines("tiny-sd3", tmp_path) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "tensorrt-rtx engines for tiny-sd3, fp16, bf16 t5, transformer, targets 8.9" in out, out
    engines = tmp_path / "engine"
    for stage in (CLIP, CLIP2, T5, TRANSFORMER, VAE):
        key = manifest_key(engines, stage)
        assert key["onnx"]["dtype"] == ("bfloat16" if stage in (T5, TRANSFORMER) else "float16"), stage
    assert manifest_key(engines, T5)["shapes"]["input_ids"] == [[2, 256], [2, 256], [8, 256]]
    shapes = manifest_key(engines, TRANSFORMER)["shapes"]
    assert shapes["hidden_states"] == [[2, 16, 32, 32], [2, 16, 32, 32], [8, 16, 32, 32]]
    assert shapes["encoder_hidden_states"][2] == [8, 77 + 256, 96]
    assert build_engines("tiny-sd3", tmp_path) == 0
    assert capsys.readouterr().out.count("cached engine: no ONNX needed") == 5
    transformer = engines / "transformer.engine"
    transformer.write_bytes(transformer.read_bytes()[:1000])
    assert build_engines("tiny-sd3", tmp_path, "--verbose") == 0
    out = capsys.readouterr().out
    assert "transformer.engine: building (transformer.engine is truncated or corrupt" in out
    assert out.count("cached engine: no ONNX needed") == 4


def test_build_engines_builds_fluxs_engines_with_t5s_weights_outside_the_onnx(rtx, tmp_path, capsys, monkeypatch):
    """Flux's transformer (unguided batches: [dev] embeds the scale) and T5 (512 tokens), their ONNX over the 2 GB
    limit (lowered here) keeping their weights in one external file each, which the optimizer and TensorRT's parser
    read back."""
    monkeypatch.setattr("models.onnx_io.EXTERNAL_DATA_THRESHOLD", 1024)
    assert build_engines("tiny-flux", tmp_path, "--stages", "t5,flux_transformer") == 0, capsys.readouterr().err
    onnx_dir, engines = tmp_path / "onnx", tmp_path / "engine"
    for stage in (T5, FLUX_TRANSFORMER):
        for onnx_file in (f"{stage}.onnx", f"{stage}.opt.onnx"):  # the export's and the optimizer's
            files = json.loads((onnx_dir / f"{onnx_file}.json").read_text())["files"]
            assert files.get(f"{onnx_file}.data", {}).get("size", 0) > 10000, files
        assert (engines / f"{stage}.engine").stat().st_size > 0
    assert manifest_key(engines, T5)["shapes"]["input_ids"] == [[1, 512], [1, 512], [4, 512]]
    shapes = manifest_key(engines, FLUX_TRANSFORMER)["shapes"]
    assert shapes["hidden_states"] == [[1, 16, 128, 128], [1, 16, 128, 128], [4, 16, 128, 128]]
    assert shapes["guidance"] == [[1], [1], [1]]


# ---- what the engines do not take yet ----------------------------------------------------------------------------

@pytest.fixture
def tensorrt_here(monkeypatch):
    """As on a machine whose GPU runs both TensorRT flavours (installed there), where nothing may be built or loaded
    for this test; and SD3 supporting, on the torch backend, what other work gives it (LoRA, ControlNets, INT8, the
    step cache, inpainting), its engines none of them."""
    from demo.backends.registry import REGISTRY
    from demo.backends.tensorrt.backend import TensorRTBackend
    from demo.runtime.loader import PipelinePlan

    def no_work(*_, **__):
        raise AssertionError("engine work began before the request was checked against the family's engines")

    for name in ("tensorrt", "tensorrt-rtx"):
        monkeypatch.setattr(REGISTRY[name], "why_cannot_run", lambda cc: None)
        monkeypatch.setattr(REGISTRY[name], "why_cannot_build", lambda: None)
        monkeypatch.setattr(REGISTRY[name], "version", lambda: "10.x")
    for method in ("settings", "prepare", "create_stages"):
        monkeypatch.setattr(TensorRTBackend, method, no_work)
    monkeypatch.setattr(PipelinePlan, "load", no_work)
    monkeypatch.setattr(PipelinePlan, "build", no_work)
    monkeypatch.setitem(SD3.__dict__, "features", SD3.features | {LORA, CONTROLNET, INT8, STEP_CACHE, INPAINTING})
    resolve_model("tiny-sd3")  # made first: no note of it


@pytest.mark.parametrize("args, given, missing", [
    (["--build-enable-refit", "--lora", "shapes-outline"], "--lora", LORA),
    (["--controlnet", "tiny-controlnet"], "--controlnet", CONTROLNET),
    (["--int8"], "--int8", INT8),
    (["--cache-interval", "2"], "--cache-interval", STEP_CACHE),
    (["--input-image", "IMAGE", "--mask-image", "IMAGE"], "--mask-image", INPAINTING),
])
@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt-rtx"])
def test_what_sd3s_engines_do_not_take_is_refused_in_one_line_before_any_work(tensorrt_here, backend, args, given,
                                                                              missing, tmp_path, capsys):
    from demo.cli.generate import main

    if "IMAGE" in args:
        IMAGE.save(tmp_path / "in.png")
        args = [str(tmp_path / "in.png") if arg == "IMAGE" else arg for arg in args]
    out = tmp_path / "out"
    status = main(["a prompt", "--model", "tiny-sd3", "--backend", backend, "--output-dir", str(out),
                   "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("demo-diffusion: error: "), lines
    # LoRA and ControlNets when the backend is chosen (auto passes TensorRT over for them), the rest after
    where = f"--backend {backend}: {given}" if missing in (LORA, CONTROLNET) else f"{given} on --backend {backend}"
    assert (f"{where}: model 'tiny-sd3' is of the SD3 family, whose TensorRT engines do not take {missing} yet; use "
            "--backend torch") in lines[0], lines[0]
    assert not (tmp_path / "onnx").exists() and not (tmp_path / "engine").exists() and not out.exists()


def test_a_plan_that_names_no_modes_gets_those_its_engines_take(trt, monkeypatch, tmp_path):
    """With inpainting on the torch backend alone (as for tensorrt_here), a TensorRT plan for no mode in particular
    (sd-serve's) plans the modes the engines take, not a refusal; the torch backend's plans all three."""
    from demo.runtime.loader import plan_pipeline

    monkeypatch.setitem(SD3.__dict__, "features", SD3.features | {INPAINTING})
    spec = PipelineSpec(model="tiny-sd3", backend="tensorrt", precision="fp32", plugins="none",
                        engine=EngineOptions(onnx_dir=str(tmp_path / "onnx"), engine_dir=str(tmp_path / "engine")))
    assert plan_pipeline(spec, CPU, progress=QUIET).modes == (TEXT_TO_IMAGE, IMAGE_TO_IMAGE)
    assert INPAINTING in plan_pipeline(PipelineSpec(model="tiny-sd3", backend="torch"), CPU, progress=QUIET).modes


def test_auto_chooses_tensorrt_for_sd3_and_flux(tensorrt_here):
    from demo.backends.registry import select_backend
    from models.families import FLUX

    assert select_backend("auto", cc=(8, 9), family=SD3, model="tiny-sd3")[0].name == "tensorrt"
    assert select_backend("tensorrt-rtx", cc=(8, 9), family=FLUX, model="tiny-flux")[0].name == "tensorrt-rtx"
