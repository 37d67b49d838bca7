"""SDXL on the CPU (issue 22, items 1-3): the built-in tiny-xl, its stages, and same seed, same image as diffusers'
StableDiffusionXLPipeline on a model directory the test writes."""

import json
import shutil

import diffusers
import numpy as np
import pytest
import torch

from demo.backends.tensorrt import build as engine
from demo.backends.torch.settings import TorchSettings
from demo.pipelines import ExpertsPipeline, SDXLPipeline, StageTimer, make_pipeline, to_uint8
from demo.request import Request
from demo.schedulers import SCHEDULERS
from models import STAGE_MODELS, text_to_image_stages
from models.families import SDXL
from models.source import resolve_model
from tests.parity import CPU, check_parity, torch_stages

PROMPTS = ("a photo of an astronaut riding a horse", "a red car")


@pytest.fixture(scope="module")
def tiny_xl():
    return resolve_model("tiny-xl")


@pytest.fixture(scope="module")
def xl_stages(tiny_xl):
    return torch_stages(tiny_xl)


@pytest.fixture(scope="module")
def no_zeros_dir(tiny_xl, tmp_path_factory):
    """A model directory the test writes: tiny-xl whose pipeline config encodes a missing negative prompt as ""."""
    directory = tmp_path_factory.mktemp("xl") / "model"
    shutil.copytree(tiny_xl.path, directory)
    (directory / "manifest.json").unlink()
    index = json.loads((directory / "model_index.json").read_text())
    (directory / "model_index.json").write_text(json.dumps({**index, "force_zeros_for_empty_prompt": False}))
    return directory


def test_tiny_xl_is_an_sdxl_model_with_both_encoders_and_added_conditions(tiny_xl):
    assert tiny_xl.family is SDXL and tiny_xl.index["_class_name"] == "StableDiffusionXLPipeline"
    assert text_to_image_stages(tiny_xl) == ("clip", "clip2", "unet", "vae")
    unet = STAGE_MODELS["unet"](tiny_xl)
    assert unet.input_names == ("sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids")
    shapes = unet.input_shapes(2, 64, 48)
    assert shapes["text_embeds"] == (2, 32) and shapes["time_ids"] == (2, 6)
    assert shapes["encoder_hidden_states"] == (2, 77, 64)  # 32 + 32: the two encoders side by side
    config = tiny_xl.config("unet")
    assert config["transformer_layers_per_block"] == [1, 2] and config["use_linear_projection"]
    assert STAGE_MODELS["vae"](tiny_xl).stage_dtype(torch.float16) == torch.float32  # force_upcast
    assert STAGE_MODELS["vae"](resolve_model("tiny")).stage_dtype(torch.float16) == torch.float16  # SD ignores it


def test_the_text_encoder_stages_give_penultimate_states_and_pooled_embeddings(tiny_xl, xl_stages):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    ids = torch.randint(0, 1000, (3, 77), generator=torch.Generator().manual_seed(5))
    first = CLIPTextModel.from_pretrained(tiny_xl.path, subfolder="text_encoder")
    second = CLIPTextModelWithProjection.from_pretrained(tiny_xl.path, subfolder="text_encoder_2")
    with torch.no_grad():
        expected_first = first(ids, output_hidden_states=True).hidden_states[-2]
        out = second(ids, output_hidden_states=True)
    states, pooled = xl_stages["clip2"].call(ids.to(torch.int32))
    torch.testing.assert_close(xl_stages["clip"].call(ids.to(torch.int32)), expected_first)
    torch.testing.assert_close(states, out.hidden_states[-2])
    torch.testing.assert_close(pooled, out.text_embeds)
    assert not torch.equal(states, out.last_hidden_state)  # not the last layer (SD 1.x's)


@pytest.mark.parametrize("scheduler", ["Euler", "DDIM", "DPM++2M"])
def test_matches_diffusers_sdxl(tiny_xl, xl_stages, scheduler):
    """No negative prompt (None): zero embeddings, as the config's force_zeros_for_empty_prompt says. A non-square,
    non-native size checks the time ids and the latent arithmetic."""
    assert isinstance(make_pipeline(tiny_xl, xl_stages, scheduler, CPU, torch.float32), SDXLPipeline)
    request = Request(PROMPTS, None, height=48, width=80, denoising_steps=5, guidance_scale=6.0, seed=0)
    check_parity(tiny_xl, xl_stages, scheduler, request)


def test_an_explicit_empty_negative_prompt_is_encoded_not_zeroed(tiny_xl, xl_stages):
    base = dict(height=64, width=64, denoising_steps=4, guidance_scale=6.0, seed=7)
    empty = check_parity(tiny_xl, xl_stages, "Euler", Request(PROMPTS[0], "", **base))
    zeros = check_parity(tiny_xl, xl_stages, "Euler", Request(PROMPTS[0], None, **base))
    assert not np.array_equal(empty, zeros)
    check_parity(tiny_xl, xl_stages, "Euler", Request(PROMPTS[0], "blurry", **base))


def test_without_zeros_in_the_config_no_negative_prompt_is_the_empty_one(no_zeros_dir, xl_stages):
    source = resolve_model(str(no_zeros_dir))
    base = dict(height=64, width=64, denoising_steps=3, guidance_scale=5.0, seed=2)
    unset = check_parity(source, xl_stages, "Euler", Request(PROMPTS[0], None, **base))
    empty = to_uint8(make_pipeline(source, xl_stages, "Euler", CPU, torch.float32)(
        Request(PROMPTS[0], "", **base), StageTimer(CPU)))
    assert np.array_equal(unset, empty)


def test_demo_renders_tiny_xl(tmp_path):
    from demo.cli.generate import main

    out = tmp_path / "out"
    assert main(["a castle", "--model", "tiny-xl", "--output-dir", str(out), "--denoising-steps", "3",
                 "--seed", "4", "--num-warmup-runs", "0"]) == 0
    report = json.loads((out / "tiny-xl-seed4.json").read_text())
    assert report["scheduler"] == "Euler" and report["model"] == "tiny-xl" and report["negative_prompt"] is None


@pytest.fixture(scope="module")
def tiny_refiner():
    return resolve_model("tiny-xl-refiner")


def test_the_refiner_has_its_second_encoder_and_aesthetic_time_ids(tiny_refiner):
    assert tiny_refiner.family is SDXL and "text_encoder" not in tiny_refiner.components
    assert text_to_image_stages(tiny_refiner) == ("clip2", "unet", "vae")
    unet = STAGE_MODELS["unet"](tiny_refiner)
    assert unet.input_shapes(2, 64, 64)["time_ids"] == (2, 5)  # original size, crop corner, aesthetic score
    assert unet.input_shapes(2, 64, 64)["encoder_hidden_states"] == (2, 77, 32)


@pytest.mark.parametrize("scheduler, fraction", [("Euler", 0.8), ("DDIM", 0.6), ("EulerA", 0.7)])
def test_base_then_refiner_matches_diffusers_ensemble_of_experts(tiny_xl, xl_stages, tiny_refiner, scheduler,
                                                                  fraction):
    refiner_stages = torch_stages(tiny_refiner)
    request = Request(PROMPTS, None, height=64, width=48, denoising_steps=6, guidance_scale=6.0, seed=3)
    pipeline = ExpertsPipeline(make_pipeline(tiny_xl, xl_stages, scheduler, CPU, torch.float32),
                               make_pipeline(tiny_refiner, refiner_stages, scheduler, CPU, torch.float32), fraction)
    ours = pipeline(request, StageTimer(CPU))

    base = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_xl.path)
    refiner = diffusers.StableDiffusionXLImg2ImgPipeline.from_pretrained(tiny_refiner.path)
    for ref in (base, refiner):
        ref.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(ref.scheduler.config)
        ref.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(3)
    common = dict(num_inference_steps=6, guidance_scale=6.0, generator=generator)
    latents = base(list(PROMPTS), height=64, width=48, denoising_end=fraction, output_type="latent", **common).images
    theirs = refiner(list(PROMPTS), image=latents, denoising_start=fraction, output_type="np", **common).images
    assert ours.shape == theirs.shape == (2, 64, 48, 3)
    # Compared before rounding to 8 bits: the refiner's aesthetic scores move the tiny model's pixels by less.
    assert np.abs(ours - theirs).max() <= 1e-4
    assert to_uint8(ours).std() > 5
    base_steps, refiner_steps, _ = pipeline.split(6)
    assert len(base_steps) + len(refiner_steps) == pipeline.unet_calls(6) == 6 and len(refiner_steps) > 0


def test_demo_renders_with_the_refiner(tmp_path, capsys):
    from demo.cli.generate import main

    out = tmp_path / "out"
    assert main(["a castle", "--model", "tiny-xl", "--refiner", "tiny-xl-refiner", "--high-noise-frac", "0.5",
                 "--output-dir", str(out), "--denoising-steps", "4", "--seed", "4", "--num-warmup-runs", "0"]) == 0
    report = json.loads((out / "tiny-xl-seed4.json").read_text())
    assert report["model"] == "tiny-xl + tiny-xl-refiner" and report["unet_calls"] == 4
    # What makes the image again, and the time of each model's part.
    assert report["high_noise_frac"] == 0.5 and 0 < report["refiner_unet_calls"] < 4
    latency = report["latency_ms"]
    assert 0 < latency["refiner_unet"] < latency["unet"] and 0 < latency["refiner_clip"] < latency["clip"]
    table, refined = capsys.readouterr().out, report["refiner_unet_calls"]
    assert f"UNet x {4 - refined} " in table and f"Refiner x {refined} " in table and "Refiner CLIP" in table


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny", "--refiner", "tiny-xl-refiner"],
     "--refiner: model 'tiny' is of the SD 1.x/2.x family, which does not support a refiner"),
    (["--model", "tiny-xl", "--refiner", "tiny-xl-refiner", "--high-noise-frac", "1.5"],
     "--high-noise-frac must be between 0 and 1"),
    (["--model", "tiny-xl", "--refiner", "tiny"], "--refiner tiny is not an SDXL model that refines"),
    (["--model", "tiny-xl", "--refiner", "tiny-xl-inpaint"],
     "--refiner tiny-xl-inpaint: its UNet takes 9 channels, the base's latents have 4"),
])
def test_refiner_usage_errors(args, message, tmp_path, capsys, no_loading):
    from demo.cli.generate import main

    assert main(["a prompt", "--output-dir", str(tmp_path / "out"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("demo-diffusion: error: ") and message in lines[-1]
    assert not (tmp_path / "out").exists()


def test_an_upcast_vae_keeps_its_modules_when_the_others_take_our_kernels(tiny_xl, capsys):
    """SDXL's VAE runs in fp32 (force_upcast) under an fp16 pipeline; our kernels take fp16, so it is left out of
    the substitution (found on an H200: group_norm refused its fp32 tensors)."""
    from demo.backends.registry import REFERENCE

    settings = TorchSettings(plugins=("GroupNorm",))
    stages = REFERENCE.create_stages([STAGE_MODELS["unet"](tiny_xl), STAGE_MODELS["vae"](tiny_xl)], lambda _: settings,
                                     CPU, torch.float16, log=print, progress=print)
    assert stages["vae"].dtype == torch.float32 and stages["vae"].substitution is None
    assert stages["unet"].dtype == torch.float16 and stages["unet"].substitution.replaced["GroupNorm"] > 0
    assert "[plugins] vae: none (it runs in float32, our kernels in float16)" in capsys.readouterr().out


def test_an_upcast_vae_engine_is_built_without_our_plugins(tiny_xl, tmp_path, monkeypatch):
    """The same for engines: TensorRT refused our fp16-only GroupNorm in SDXL's fp32 VAE (an H200, TensorRT 8.6:
    "could not find any supported formats"), so that stage's ONNX gets no plugin passes and its engine key says so."""
    built = {}

    def prepare_engine(model, onnx_key, make_onnx, *args, **kwargs):
        built[model.name] = onnx_key["plugins"]
        (tmp_path / model.name).write_bytes(b"engine")
        return tmp_path / model.name

    monkeypatch.setattr(engine, "prepare_engine", prepare_engine)
    profile = engine.ImageProfile.for_request(tiny_xl, batch_size=1, height=64, width=64, static_batch=True,
                                              dynamic_shape=False)
    settings = engine.EngineSettings(tmp_path / "onnx", tmp_path / "engine", profile,
                                     engine.BuildOptions("tensorrt", optimization_level=0), plugins=("GroupNorm",))
    said = []
    engine.prepare_stage_engines([STAGE_MODELS[name](tiny_xl) for name in ("unet", "vae")], settings, CPU,
                                 torch.float16, log=said.append, progress=said.append)
    assert built == {"unet": ["GroupNorm"], "vae": []}
    assert "[plugins] vae: none (it runs in float32, our TensorRT plugins in float16)" in said
