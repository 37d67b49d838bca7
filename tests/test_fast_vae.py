"""A VAE that keeps up (issue 57, part 3): the VAE stages in a precision of their own (`vae_precision`: bf16 where an
SDXL VAE overflows in fp16, fp16 where it is the fp16-fix kind), and diffusers' AutoencoderTiny (TAESD) as `--vae`,
the built-ins `taesd-arch` and `taesdxl-arch` among them: same seed, same image as diffusers' pipelines given the tiny
VAE, on the CPU; the refusals one line naming the field; its ONNX export against torch; the artifacts keyed by it."""

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from core.errors import UsageError
from demo.backends.base import Workload
from demo.backends.registry import REFERENCE
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.backend import check_bf16_gpu
from demo.backends.torch.options import TorchOptions
from demo.backends.torch.settings import FALLBACK
from demo.cli.flags import ModelFlags, parse_flags
from demo.cli.generate import main
from demo.cli.to_spec import spec_from_flags
from demo.request import IMAGE_TO_IMAGE, TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline, plan_pipeline
from demo.runtime.spec import PipelineSpec
from models import STAGE_MODELS, VAEDecoderModel, VAEEncoderModel, image_to_image_stages
from models.builtin import BUILTIN_VAES, TAESD
from models.source import resolve_model
from tests import fake_tensorrt
from tests.parity import CPU, QUIET, check_parity, torch_stages
from tests.test_settings import parser

PROMPT = "a photo of an astronaut riding a horse"
# TAESD's layout at small widths, downsampling by 2 as tiny's own VAE does (so tiny's native size stays 64)
TINY_TAESD = {**TAESD, "encoder_block_out_channels": [16, 16], "decoder_block_out_channels": [16, 16],
              "num_encoder_blocks": [1, 2], "num_decoder_blocks": [2, 1]}


def save_tiny_vae(folder, seed=0, **config):
    from diffusers import AutoencoderTiny

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        AutoencoderTiny(**{**TINY_TAESD, **config}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    """An AutoencoderTiny folder the test writes (random weights)."""
    return save_tiny_vae(tmp_path_factory.mktemp("taesd") / "vae")


@pytest.fixture(scope="module")
def tiny_with_tiny_vae(tiny, tiny_vae):
    return resolve_model("tiny", vae=str(tiny_vae))


def reference_vae(folder):
    from diffusers import AutoencoderTiny

    return AutoencoderTiny.from_pretrained(folder)


def render(spec: PipelineSpec, **fields) -> np.ndarray:
    with load_pipeline(spec, "cpu", progress=lambda *_: None) as pipe:
        return pipe(PROMPT, seed=4, denoising_steps=3, **fields).pixels


# ---- the tiny autoencoder as --vae ---------------------------------------------------------------------------------

def test_a_tiny_vae_draws_diffusers_text_to_image_picture(tiny, tiny_vae, tiny_with_tiny_vae):
    source = tiny_with_tiny_vae
    assert source.vae == tiny_vae and source.vae_class == "AutoencoderTiny" and source.vae_scale_factor == 2
    request = Request(PROMPT, "blurry", height=64, width=48, denoising_steps=3, guidance_scale=7.5, seed=1)
    ours = check_parity(source, torch_stages(source), "DDIM", request, vae=reference_vae(tiny_vae))
    own = check_parity(tiny, torch_stages(tiny), "DDIM", request)
    assert np.abs(own.astype(int) - ours.astype(int)).max() > 10  # the tiny VAE decoded


@pytest.mark.parametrize("mask", [None, "a rectangle"])
def test_a_tiny_vae_draws_diffusers_image_to_image_and_inpainting_picture(mask, tiny_vae, tiny_with_tiny_vae):
    """diffusers takes an AutoencoderTiny's latents as its encoder gives them (retrieve_latents: no sample drawn, for
    the input image nor for inpainting's masked one), so a stochastic scheduler's draws are the generator's first."""
    source = tiny_with_tiny_vae
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 48, 3), dtype=np.uint8))
    if mask is not None:
        pixels = np.zeros((64, 48), np.uint8)
        pixels[10:40, 8:30] = 255
        mask = Image.fromarray(pixels)
    request = Request(PROMPT, height=64, width=48, denoising_steps=5, guidance_scale=7.0, seed=3, image=image,
                      mask=mask, strength=0.6)
    encoder = VAEEncoderModel(source)
    assert not encoder.draws_sample and encoder.output_names == ("latents",)
    check_parity(source, torch_stages(source, image_to_image_stages(source)), "EulerA", request,
                 vae=reference_vae(tiny_vae))


def test_a_model_folder_with_a_tiny_vae_and_a_saved_config_without_what_diffusers_registers(tiny, tiny_vae, tmp_path):
    """madebyollin's TAESD folders leave out block_out_channels (diffusers registers the decoder's widths so when it
    loads one): the scale factor comes from them all the same; a model folder holding it in vae/ is taken too."""
    shutil.copytree(tiny_vae, tmp_path / "model" / "vae")
    config_file = tmp_path / "model" / "vae" / "config.json"
    config = json.loads(config_file.read_text())
    del config["block_out_channels"], config["force_upcast"]
    config_file.write_text(json.dumps(config))
    source = resolve_model("tiny", vae=str(tmp_path / "model"))
    assert source.vae == tmp_path / "model" / "vae" and source.vae_scale_factor == 2
    assert source.config("vae")["block_out_channels"] == [16, 16]


@pytest.mark.parametrize("name, model", [("taesd-arch", "tiny"), ("taesdxl-arch", "tiny-xl")])
def test_the_builtin_tiny_vaes_are_taesds_architecture_and_decode(name, model):
    from diffusers import AutoencoderTiny

    source = resolve_model(model, vae=name)
    config = json.loads((source.vae / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderTiny" and {key: config[key] for key in TAESD} == TAESD
    assert BUILTIN_VAES[name] == TAESD and source.vae_scale_factor == 8
    with torch.device("meta"):
        vae = AutoencoderTiny(**TAESD)
    assert [sum(p.numel() for p in part.parameters()) for part in (vae.encoder, vae.decoder)] == [1_222_532, 1_222_531]
    assert resolve_model(model, vae=name).vae == source.vae  # made once
    images = render(PipelineSpec(model=model, vae=name, backend="torch"), height=128, width=128)
    assert images.shape == (1, 128, 128, 3) and images.std() > 2  # random weights: a dim picture, not a constant


# ---- vae_precision -------------------------------------------------------------------------------------------------

def test_a_bf16_vae_moves_the_image_a_little(tiny):
    """On the CPU in bf16: close to the fp32 image, not equal to it (the VAE ran in bf16, its modules too)."""
    with load_pipeline(PipelineSpec(model="tiny", backend="torch", vae_precision="bf16"), "cpu",
                       progress=lambda *_: None) as pipe:
        assert {p.dtype for p in pipe.stages["vae"].module.parameters()} == {torch.bfloat16}
        bf16 = pipe(PROMPT, seed=4, denoising_steps=3).pixels.astype(int)
    fp32 = render(PipelineSpec(model="tiny", backend="torch")).astype(int)
    assert 0 < np.abs(bf16 - fp32).max() <= 6 and np.abs(bf16 - fp32).mean() < 1


def test_an_sdxl_vae_runs_bf16_where_fp16_would_overflow():
    source = resolve_model("tiny-xl", vae_precision="bf16")
    assert [model(source).stage_dtype(torch.float16) for model in (VAEDecoderModel, VAEEncoderModel)] == [
        torch.bfloat16] * 2
    assert VAEDecoderModel(resolve_model("tiny-xl")).stage_dtype(torch.float16) == torch.float32  # force_upcast
    with pytest.raises(UsageError) as refused:
        resolve_model("tiny-xl", vae_precision="fp16")
    assert "vae_precision fp16" in str(refused.value) and "vae_precision bf16" in str(refused.value)


def test_an_fp16_fix_vae_runs_fp16_in_an_fp16_pipeline(tmp_path):
    """An SDXL VAE whose config says no force_upcast (the fp16-fix kind): fp16 like the rest, unasked and asked."""
    tiny_xl = resolve_model("tiny-xl")
    shutil.copytree(tiny_xl.component_dir("vae"), tmp_path / "vae")
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**config, "force_upcast": False}))
    for precision in (None, "fp16"):
        source = resolve_model("tiny-xl", vae=str(tmp_path / "vae"), vae_precision=precision)
        decoder = VAEDecoderModel(source)
        assert decoder.stage_dtype(torch.float16) == torch.float16
        stage = REFERENCE.create_stages([decoder], lambda _: FALLBACK, CPU, torch.float16, QUIET, QUIET)["vae"]
        assert {p.dtype for p in stage.module.parameters()} == {torch.float16}


def test_vae_precision_is_one_flag_into_the_spec():
    assert spec_from_flags(parse_flags(parser(ModelFlags), ["--vae-precision", "bf16"])).vae_precision == "bf16"
    with pytest.raises(UsageError, match="vae_precision must be one of fp32, bf16, fp16, got 'fp8'"):
        PipelineSpec(vae_precision="fp8").check()


def test_a_bf16_vae_is_refused_where_the_backend_has_no_bf16(tmp_path, monkeypatch):
    """TensorRT 8.6 has no bf16 (told by feature: a strongly typed network and a bf16 type); a GPU before Ampere
    neither."""
    engine = EngineOptions(onnx_dir=str(tmp_path / "onnx"), engine_dir=str(tmp_path / "engine"))
    spec = PipelineSpec(model="tiny", backend="tensorrt", precision="fp32", plugins="none", engine=engine,
                        vae_precision="bf16")
    with monkeypatch.context() as patch:
        fake_tensorrt.install(patch, "8.6.1")
        with pytest.raises(UsageError, match="vae_precision bf16: tensorrt 8.6.1 builds no bf16 engines"):
            plan_pipeline(spec, "cpu")
    with monkeypatch.context() as patch:
        module = fake_tensorrt.install(patch, "10.8.0")
        patch.setattr(module, "DataType", type("DataType", (), {"BF16": object()}))
        assert plan_pipeline(spec, "cpu").source.vae_precision == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(UsageError, match=r"vae_precision bf16: this GPU \(compute capability 7.5\) has no bf16"):
        REFERENCE.settings(resolve_model("tiny", vae_precision="bf16"), TorchOptions(), "none", None,
                           Workload(1, 64, 64), torch.device("cuda"), torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    check_bf16_gpu(torch.device("cuda"))


@pytest.mark.parametrize("args, message", [
    (["--vae-precision", "fp8"], "argument --vae-precision: invalid choice: 'fp8'"),
    (["--model", "tiny-xl", "--vae-precision", "fp16"],
     "--vae-precision fp16: model 'tiny-xl''s VAE overflows in fp16 (its config asks for fp32); use "
     "--vae-precision bf16"),
    ("OTHER_LATENTS", "its latents have 16 channels, model 'tiny''s UNet takes 4"),
])
def test_a_bad_fast_vae_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    if args == "OTHER_LATENTS":  # a tiny VAE for another latent size
        args = ["--vae", str(save_tiny_vae(tmp_path / "vae", latent_channels=16))]
    assert main(["a prompt", "--output-dir", str(tmp_path / "out"), "--denoising-steps", "1", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo-diffusion: error: ") and message in lines[0], lines
    assert not (tmp_path / "out").exists()


# ---- engines -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["vae", "vae_encoder"])
def test_the_tiny_vae_exports_to_onnx_that_computes_torchs_output(stage, tiny_with_tiny_vae, tmp_path):
    model = STAGE_MODELS[stage](tiny_with_tiny_vae)
    optimized = model.prepare_onnx(tmp_path, "cpu", torch.float32, log=lambda *_: None)
    inputs = model.sample_inputs(3, 48, 80, generator=torch.Generator().manual_seed(7))  # not the export's shapes
    with torch.no_grad():
        reference = model.load_module()(*(inputs[n] for n in model.input_names)).numpy()
    for path in (tmp_path / f"{stage}.onnx", optimized):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert [o.name for o in session.get_outputs()] == list(model.output_names)
        (out,) = session.run(None, {name: value.numpy() for name, value in inputs.items()})
        assert out.shape == reference.shape == model.output_shapes(3, 48, 80)[model.output_names[0]]
        assert np.abs(out - reference).max() <= 1e-4 * np.abs(reference).max()


def test_engines_with_a_tiny_vae_draw_the_torch_backends_pictures(tiny_vae, tmp_path):
    """Every stage's engine built and run by the stand-in TensorRT (tests/fake_tensorrt.py), the tiny VAE's decoder
    and encoder among them: text-to-image and image-to-image, the torch backend's images."""
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    requests, modes = ({}, {"image": image, "strength": 0.6}), (TEXT_TO_IMAGE, IMAGE_TO_IMAGE)
    with fake_tensorrt.stand_in_pipeline(tmp_path, vae=str(tiny_vae), modes=modes) as pipe:
        engines = [pipe(PROMPT, seed=4, denoising_steps=3, **fields).pixels for fields in requests]
    spec = PipelineSpec(model="tiny", vae=str(tiny_vae), backend="torch", modes=modes)
    for built, fields in zip(engines, requests):
        assert np.abs(built.astype(int) - render(spec, **fields).astype(int)).max() <= 2


def test_vae_artifacts_are_keyed_by_the_vae_and_its_precision(tiny, tiny_with_tiny_vae):
    """A VAE's ONNX (and so its engine) is keyed by the VAE's files (the model's fingerprint) and the precision it
    runs in; the UNet's key does not follow the VAE's precision (no UNet rebuild for it)."""
    def key(source, stage="vae"):
        model = STAGE_MODELS[stage](source)
        return model.optimized_onnx_key(model.stage_dtype(torch.float16))

    bf16 = resolve_model("tiny", vae_precision="bf16")
    assert key(tiny)["dtype"] == "float16" and key(bf16)["dtype"] == "bfloat16"
    assert key(tiny_with_tiny_vae)["model"] != key(tiny)["model"]
    assert key(bf16, "unet") == key(tiny, "unet")
