"""Flux.1 (models.families.flux): its family chosen from model_index.json, its stages, and same seed, same image as
diffusers' FluxPipeline and FluxImg2ImgPipeline on the tiny-flux built-ins on the CPU in fp32, FLUX.1 [dev]-style (the
guidance scale embedded) and [schnell]-style (none); what the family lacks, a scheduler that does not step a flow and a
guidance scale for a model that takes none refused in one line (exit 2 from demo-diffusion)."""

import json
import shutil

import numpy as np
import pytest
import torch

from core.errors import UsageError
from demo.request import Request
from models import FLUX_TRANSFORMER, T5
from models.families import EMBEDDED, FLUX, NO_GUIDANCE
from models.source import resolve_model
from models.stages import STAGE_MODELS, text_to_image_stages
from tests.parity import check_parity, torch_stages

SIZE = 128  # the least tiny-flux takes (half its native 256): 64 latents a side, 1024 tokens


@pytest.fixture(scope="module")
def dev():
    return resolve_model("tiny-flux")


@pytest.fixture(scope="module")
def schnell():
    return resolve_model("tiny-flux-schnell")


@pytest.fixture(scope="module")
def dev_stages(dev):
    return torch_stages(dev)


@pytest.fixture(scope="module")
def schnell_stages(schnell):
    return torch_stages(schnell)


def request(source, **given) -> Request:
    resolved = Request("a photo of a cat on a table", **{"denoising_steps": 3, "seed": 11, "height": SIZE,
                                                          "width": SIZE, **given}).resolved(source)
    resolved.check(source)
    return resolved


def test_a_flux_folder_is_of_the_flux_family_with_its_facts_from_its_configs(dev, schnell):
    assert dev.family is FLUX and schnell.family is FLUX
    assert (dev.guidance, schnell.guidance) == (EMBEDDED, NO_GUIDANCE)  # guidance_embeds true / false
    assert dev.latent_channels == 16 and dev.input_channels == 16  # the transformer's 64, packed 2x2
    assert dev.native_image_size == 256 and dev.image_size_multiple == 4  # FluxPipeline's 128 latents; 2x VAE x 2
    assert text_to_image_stages(dev) == ("clip", T5, FLUX_TRANSFORMER, "vae")
    assert STAGE_MODELS[T5](dev).component == "text_encoder_2"
    clip = STAGE_MODELS["clip"](dev)
    assert clip.encoder_class == "CLIPTextModel" and clip.output_shapes(1, SIZE, SIZE)["text_embeds"] == (1, 32)
    transformer = STAGE_MODELS[FLUX_TRANSFORMER](dev)
    assert transformer.input_names[-1] == "guidance"
    assert "guidance" not in STAGE_MODELS[FLUX_TRANSFORMER](schnell).input_names
    assert transformer.input_shapes(2, SIZE, SIZE)["encoder_hidden_states"] == (2, FLUX.t5_length, 32)
    assert request(dev).scheduler == "FlowMatchEuler" and not request(dev).guided


@pytest.mark.parametrize("scale", [3.5, 1.0, 6.0])
def test_dev_draws_diffusers_image_with_the_scale_embedded(dev, dev_stages, scale):
    check_parity(dev, dev_stages, "FlowMatchEuler", request(dev, guidance_scale=scale))


def test_schnell_draws_diffusers_image_unguided(schnell, schnell_stages):
    made = request(schnell, denoising_steps=4)
    assert made.guidance == NO_GUIDANCE and made.guidance_scale == 0.0  # as [schnell] recommends
    check_parity(schnell, schnell_stages, "FlowMatchEuler", made)


@pytest.mark.parametrize("fixture", ["dev", "schnell"])
def test_two_prompts_two_images_each(fixture, request_fixture):
    source, stages = request_fixture(fixture)
    made = Request(("a cat", "a dog in the snow"), batch_size=2, denoising_steps=2, seed=5, height=SIZE,
                   width=SIZE).resolved(source)
    check_parity(source, stages, made.scheduler, made)


@pytest.fixture
def request_fixture(request):
    return lambda name: (request.getfixturevalue(name), request.getfixturevalue(f"{name}_stages"))


def test_a_size_not_square_shifts_the_sigmas_by_its_own_tokens(dev, dev_stages):
    """mu from the image's token count (calculate_shift): 128 x 192 is 64 x 96 latents, 1536 tokens."""
    check_parity(dev, dev_stages, "FlowMatchEuler", request(dev, height=SIZE, width=192, guidance_scale=3.5))


@pytest.mark.parametrize("strength, steps", [(0.6, 4), (0.7, 5)])
def test_image_to_image_draws_diffusers_image(dev, strength, steps):
    """FluxImg2ImgPipeline's latents: the image's, shifted and scaled, moved along the flow to the first timestep its
    strength leaves (counted as diffusers' flow pipelines count it: 5 at 0.7 run 4)."""
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    made = request(dev, image=Image.fromarray(pixels), strength=strength, guidance_scale=3.5, denoising_steps=steps)
    check_parity(dev, torch_stages(dev, (*text_to_image_stages(dev), "vae_encoder")), made.scheduler, made)


def test_the_conditioning_is_diffusers_own(dev, dev_stages):
    """T5's states and the CLIP's unprojected pooled output, as FluxPipeline's own encode_prompt makes them."""
    import diffusers

    from demo.pipelines import make_pipeline
    from demo.pipelines.batch import Batch

    made = request(dev)
    states, pooled = make_pipeline(dev, dev_stages, made.scheduler, torch.device("cpu"),
                                   torch.float32).encode_prompt(Batch.of(made))
    reference = diffusers.FluxPipeline.from_pretrained(dev.path)
    with torch.inference_mode():
        their_states, their_pooled, _ = reference.encode_prompt(made.prompt, None)
    assert torch.allclose(states, their_states, atol=1e-5) and torch.allclose(pooled, their_pooled, atol=1e-5)


def test_the_scheduler_shift_is_diffusers_calculate_shift():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from demo.schedulers import dynamic_shift
    from models.builtin import FLUX_SCHEDULER, SD3_SCHEDULER, scheduler_from

    scheduler = scheduler_from(FLUX_SCHEDULER)
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler)
    for tokens in (1024, 1536, 4096):
        assert dynamic_shift(scheduler, tokens) == {"mu": calculate_shift(tokens)}
    assert dynamic_shift(scheduler_from(SD3_SCHEDULER), 1024) == {}  # SD3's shift is fixed


def test_a_guidance_scale_for_a_model_without_guidance_embeds_is_refused(schnell, dev):
    with pytest.raises(UsageError, match=r"^guidance_scale 3.5: model 'tiny-flux-schnell' takes no guidance scale"):
        request(schnell, guidance_scale=3.5)
    assert request(dev, guidance_scale=3.5).guidance == EMBEDDED


@pytest.mark.parametrize("scheduler", ["Euler", "DDIM"])
def test_a_scheduler_that_does_not_step_a_flow_is_refused_for_flux(dev, scheduler):
    with pytest.raises(UsageError, match=f"{scheduler}: model 'tiny-flux' is of the Flux.1 family, whose denoiser "
                                         "predicts a flow"):
        request(dev, scheduler=scheduler)


@pytest.mark.parametrize("model, args, message", [
    ("tiny-flux", ["--cache-interval", "2"], "which does not support the step cache"),
    ("tiny-flux", ["--controlnet", "tiny-controlnet"], "is a ControlNet of SD 1.x/2.x models"),
    ("tiny-flux", ["--lora", "shapes-outline"], "changes unet, which a LoRA does not change in this model"),  # SD's
    ("tiny-flux", ["--int8"], "which does not support INT8"),
    ("tiny-flux", ["--refiner", "tiny-xl-refiner"], "which does not support a refiner"),
    ("tiny-flux", ["--scheduler", "Euler"], "whose denoiser predicts a flow"),
    ("tiny-flux", ["--input-image", "IMAGE", "--mask-image", "IMAGE", "--lora", "shapes-outline"],
     "changes unet, which a LoRA does not change in this model"),
    ("tiny-flux-schnell", ["--guidance-scale", "3.5"], "takes no guidance scale"),
])
def test_what_flux_lacks_is_refused_in_one_line_exit_2(dev, schnell, model, args, message, tmp_path,
                                                      capsys):  # the built-ins made first: no note of it
    from PIL import Image

    from demo.cli.generate import main

    if "IMAGE" in args:
        Image.new("RGB", (SIZE, SIZE), "red").save(tmp_path / "in.png")
        args = [str(tmp_path / "in.png") if arg == "IMAGE" else arg for arg in args]
    if "--controlnet" in args:  # made first, no note of it (it is resolved, then refused as of another family)
        from models.controlnet import resolve_controlnet

        resolve_controlnet("tiny-controlnet")
        capsys.readouterr()
    out = tmp_path / "out"
    status = main(["a prompt", "--model", model, "--output-dir", str(out), "--denoising-steps", "2", "--height",
                   str(SIZE), "--width", str(SIZE), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("demo-diffusion: error: "), lines
    assert message in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_demo_diffusion_renders_tiny_flux_and_notes_the_unused_negative_prompt(tmp_path, capsys):
    from demo.cli.generate import main

    assert main(["a cat", "--model", "tiny-flux", "--output-dir", str(tmp_path), "--denoising-steps", "2",
                 "--height", str(SIZE), "--width", str(SIZE), "--negative-prompt", "blurry"]) == 0, \
        capsys.readouterr().err
    assert list(tmp_path.glob("*.png"))
    captured = capsys.readouterr()
    assert "negative_prompt unused" in captured.err + captured.out or "--negative-prompt unused" in \
        captured.err + captured.out
    assert any("Transformer x 2" in line for line in captured.out.splitlines())


def test_a_request_left_to_the_model_gets_diffusers_flux_defaults(dev, schnell, tmp_path):
    """FluxPipeline runs 28 steps at guidance 3.5; a [schnell] folder (the same class, its transformer embedding no
    guidance) 4 steps, as diffusers' docs run it; FluxImg2ImgPipeline 28 at 7.0."""
    assert (lambda r: (r.denoising_steps, r.guidance_scale))(Request("a cat").resolved(dev)) == (28, 3.5)
    assert (lambda r: (r.denoising_steps, r.guidance_scale))(Request("a cat").resolved(schnell)) == (4, 0.0)
    folder = tmp_path / "img2img"
    shutil.copytree(dev.path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxImg2ImgPipeline"}))
    resolved = Request("a cat").resolved(resolve_model(str(folder)))
    assert (resolved.denoising_steps, resolved.guidance_scale) == (28, 7.0)


@pytest.mark.parametrize("transformer, message", [
    ({"joint_attention_dim": 128},
     r"attends to text 128 wide \(joint_attention_dim\), but its T5's states are 32 wide \(text_encoder_2 d_model\)$"),
    ({"pooled_projection_dim": 48},
     r"takes pooled text 48 wide \(pooled_projection_dim\), but its text encoders' pooled outputs are 32 "
     r"\(text_encoder\) wide \(hidden_size\)$"),
])
def test_a_flux_folder_whose_transformer_misfits_its_text_encoders_is_refused_at_load(dev, tmp_path, transformer,
                                                                                      message):
    """Flux's T5 is its text_encoder_2 and its pooled text CLIP's unprojected pooler output: checked as SD3's are."""
    folder = tmp_path / "model"
    shutil.copytree(dev.path, folder, ignore=shutil.ignore_patterns("manifest*"))
    resolve_model(str(folder))  # the copy, unchanged, is fine
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, **transformer}))
    with pytest.raises(UsageError, match=r"^component 'transformer': .*transformer/config.json " + message):
        resolve_model(str(folder))
