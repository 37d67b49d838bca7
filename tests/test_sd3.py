"""SD3 (models.families.sd3): its family chosen from model_index.json, its stages, and same seed, same image as
diffusers' StableDiffusion3Pipeline on the tiny-sd3 built-in (and on a copy without T5), on the CPU in fp32, guided
with a negative prompt and unguided; what the family lacks, and a scheduler that does not step a flow, refused in one
line (exit 2 from demo-diffusion)."""

import json
import shutil

import pytest
import torch

from core.errors import UsageError
from demo.request import Request
from models import T5, TRANSFORMER
from models.families import CLASSIFIER_FREE, SD3
from models.source import resolve_model
from models.stages import STAGE_MODELS, text_to_image_stages
from tests.parity import check_parity, torch_stages

SIZE = 64  # tiny-sd3's native size (its transformer's 32 latents a side, its VAE's 2x)


@pytest.fixture(scope="module")
def tiny_sd3():
    return resolve_model("tiny-sd3")


@pytest.fixture(scope="module")
def stages(tiny_sd3):
    return torch_stages(tiny_sd3)


@pytest.fixture(scope="module")
def without_t5(tiny_sd3, tmp_path_factory):
    """tiny-sd3 as a model published without T5 is: model_index.json names text_encoder_3 and tokenizer_3 null."""
    folder = tmp_path_factory.mktemp("no-t5") / "model"
    shutil.copytree(tiny_sd3.path, folder, ignore=shutil.ignore_patterns("text_encoder_3", "tokenizer_3", "manifest*"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "text_encoder_3": [None, None],
                                                         "tokenizer_3": [None, None]}))
    return resolve_model(str(folder))


def request(source, **given) -> Request:
    resolved = Request("a photo of a cat on a table", **{"denoising_steps": 4, "seed": 11, "height": SIZE,
                                                          "width": SIZE, **given}).resolved(source)
    resolved.check(source)
    return resolved


def test_an_sd3_folder_is_of_the_sd3_family_with_its_facts_from_its_configs(tiny_sd3, without_t5):
    assert tiny_sd3.family is SD3 and without_t5.family is SD3
    assert tiny_sd3.latent_channels == 16 and tiny_sd3.native_image_size == SIZE
    assert tiny_sd3.text_width == 96 and tiny_sd3.text_length == 77  # T5's width; the CLIPs' tokens
    assert text_to_image_stages(tiny_sd3) == ("clip", "clip2", T5, TRANSFORMER, "vae")
    assert T5 not in text_to_image_stages(without_t5)
    transformer = STAGE_MODELS[TRANSFORMER](tiny_sd3)
    shapes = transformer.input_shapes(2, SIZE, SIZE)
    assert shapes["encoder_hidden_states"] == (2, 77 + SD3.t5_length, 96)
    assert shapes["pooled_projections"] == (2, 64) and shapes["hidden_states"] == (2, 16, 32, 32)
    assert STAGE_MODELS["clip"](tiny_sd3).output_names == ("text_embeddings", "text_embeds")  # pooled, as clip2's
    assert request(tiny_sd3).scheduler == "FlowMatchEuler"  # the model's own


@pytest.mark.parametrize("given", [
    {"guidance_scale": 5.0, "negative_prompt": "blurry, low quality"},
    {"guidance_scale": 4.0},  # an empty negative prompt
    {"guidance_scale": 1.0},  # no classifier-free guidance: one half
])
def test_text_to_image_draws_diffusers_image(tiny_sd3, stages, given):
    made = request(tiny_sd3, **given)
    check_parity(tiny_sd3, stages, made.scheduler, made)


@pytest.mark.parametrize("strength, steps", [(0.75, 4), (0.7, 5), (1.0, 3), (0.2, 4)])
def test_image_to_image_draws_diffusers_image(tiny_sd3, strength, steps):
    """StableDiffusion3Img2ImgPipeline's latents: the image's, shifted and scaled, moved along the flow to the first
    timestep its strength leaves (counted as diffusers' SD3 pipeline counts it: 5 steps at 0.7 run 4, where SD's run
    3; 4 at 0.2 run 1, where SD's run none, and the request is refused for SD: not for SD3), guided with a negative
    prompt."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    made = request(tiny_sd3, image=Image.fromarray(pixels), strength=strength, guidance_scale=5.0,
                   negative_prompt="blurry", denoising_steps=steps)
    stages = torch_stages(tiny_sd3, (*text_to_image_stages(tiny_sd3), "vae_encoder"))
    check_parity(tiny_sd3, stages, made.scheduler, made)


def test_a_model_without_t5_attends_to_zeros_in_its_place_as_diffusers_does(without_t5):
    made = request(without_t5, guidance_scale=5.0, negative_prompt="blurry")
    check_parity(without_t5, torch_stages(without_t5), made.scheduler, made, text_encoder_3=None, tokenizer_3=None)


def test_two_prompts_two_images_each(tiny_sd3, stages):
    made = Request(("a cat", "a dog in the snow"), batch_size=2, denoising_steps=3, seed=5, height=SIZE, width=SIZE,
                   guidance_scale=6.0).resolved(tiny_sd3)
    check_parity(tiny_sd3, stages, made.scheduler, made)


@pytest.mark.parametrize("scheduler", ["Euler", "DDIM", "DPM++2M"])
def test_a_scheduler_that_does_not_step_a_flow_is_refused_for_sd3(tiny_sd3, scheduler):
    with pytest.raises(UsageError) as raised:
        request(tiny_sd3, scheduler=scheduler)
    message = str(raised.value)
    assert f"{scheduler}: model 'tiny-sd3' is of the SD3 family, whose denoiser predicts a flow" in message
    assert "choose FlowMatchEuler" in message and "\n" not in message


def test_the_flow_matching_scheduler_is_refused_for_a_model_that_predicts_noise():
    with pytest.raises(UsageError, match="predicts noise or v, which FlowMatchEuler does not step; choose DDIM"):
        request(resolve_model("tiny"), scheduler="FlowMatchEuler")


@pytest.mark.parametrize("args, message", [
    (["--cache-interval", "2"], "which does not support the step cache"),
    (["--controlnet", "tiny-controlnet"], "is a ControlNet of SD 1.x/2.x models"),
    (["--int8"], "which does not support INT8"),
    (["--refiner", "tiny-xl-refiner"], "which does not support a refiner"),
    (["--scheduler", "Euler"], "whose denoiser predicts a flow"),
    (["--input-image", "IMAGE", "--mask-image", "IMAGE", "--cache-interval", "2"], "does not support the step cache"),
])
def test_what_sd3_lacks_is_refused_in_one_line_exit_2(tiny_sd3, args, message, tmp_path, capsys):  # made first
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
    status = main(["a prompt", "--model", "tiny-sd3", "--output-dir", str(out), "--denoising-steps", "2", *args])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("demo-diffusion: error: "), err
    assert message in lines[0] and "SD3 family" in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_demo_diffusion_renders_tiny_sd3(tmp_path, capsys):
    from demo.cli.generate import main

    assert main(["a cat", "--model", "tiny-sd3", "--output-dir", str(tmp_path), "--denoising-steps", "12",
                 "--seed", "1"]) == 0, capsys.readouterr().err
    assert list(tmp_path.glob("*.png"))
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert any("Transformer x 12" in line for line in table) and not any("UNet" in line for line in table), table
    assert len({len(line) for line in table}) == 1, table  # the column as wide as its widest name
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["denoiser"] == "Transformer"


def test_the_transformer_stage_takes_one_timestep_for_the_batch_as_diffusers_takes_it_expanded(tiny_sd3, stages):
    """The stage's (1,) timestep gives what diffusers' transformer gives for it expanded to the batch."""
    transformer = stages[TRANSFORMER]
    inputs = transformer.model.sample_inputs(3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    ours = transformer(inputs)["latent"]
    module = transformer.module.transformer
    with torch.inference_mode():
        theirs = module(hidden_states=inputs["hidden_states"], timestep=inputs["timestep"].expand(3),
                        encoder_hidden_states=inputs["encoder_hidden_states"],
                        pooled_projections=inputs["pooled_projections"], return_dict=False)[0]
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_the_text_conditioning_is_diffusers_own(tiny_sd3, stages):
    """What the transformer attends to, token for token (its attention is blind to the text tokens' order, so the
    image alone would not tell the CLIPs' and T5's states apart), and the pooled projections, as diffusers' own
    encode_prompt makes them."""
    import diffusers

    from demo.pipelines import make_pipeline
    from demo.pipelines.batch import Batch

    made = request(tiny_sd3, guidance_scale=5.0, negative_prompt="blurry")
    ours = make_pipeline(tiny_sd3, stages, made.scheduler, torch.device("cpu"), torch.float32).encode_prompt(
        Batch.of(made))
    reference = diffusers.StableDiffusion3Pipeline.from_pretrained(tiny_sd3.path)
    with torch.inference_mode():
        states, negative, pooled, negative_pooled = reference.encode_prompt(
            made.prompt, None, None, negative_prompt=made.negative_prompt)
    assert torch.allclose(ours[0], torch.cat([negative, states]), atol=1e-5)
    assert torch.allclose(ours[1], torch.cat([negative_pooled, pooled]), atol=1e-5)


@pytest.fixture(scope="module")
def sd3_sized(tiny_sd3, tmp_path_factory):
    """tiny-sd3 with SD3's own size multiple (its VAE's config 8x, as SD3's: configs only, refused before loading)."""
    folder = tmp_path_factory.mktemp("sd3-8x") / "model"
    shutil.copytree(tiny_sd3.path, folder, ignore=shutil.ignore_patterns("manifest*"))
    config = json.loads((folder / "vae" / "config.json").read_text())
    channels = config["block_out_channels"]
    config.update(block_out_channels=[*channels, channels[-1], channels[-1]],
                  down_block_types=config["down_block_types"] + config["down_block_types"][-1:] * 2,
                  up_block_types=config["up_block_types"] + config["up_block_types"][-1:] * 2)
    (folder / "vae" / "config.json").write_text(json.dumps(config))
    return resolve_model(str(folder))


def test_the_image_size_multiple_is_the_vae_scale_times_the_patch_size(tiny_sd3, sd3_sized):
    """16 for SD3's 8x VAE and patches of 2 (diffusers' SD3 pipelines' check); SD keeps its 8."""
    from demo.request import check_image_size

    assert (sd3_sized.vae_scale_factor, sd3_sized.image_size_multiple) == (8, 16)
    assert (tiny_sd3.vae_scale_factor, tiny_sd3.image_size_multiple) == (2, 4)
    assert resolve_model("tiny").image_size_multiple == 8
    with pytest.raises(UsageError, match=r"^height must be a multiple of 16 for model '.*' \(its VAE's scale factor 8 "
                                         r"x its transformer's patch size 2\), got 200$"):
        check_image_size(sd3_sized, 200, 208)
    check_image_size(sd3_sized, 208, 208)
    check_image_size(resolve_model("tiny"), 120, 120)  # a multiple of 8, not of 16: SD takes it
    with pytest.raises(UsageError, match="must be a multiple of 4 for model 'tiny-sd3'"):
        check_image_size(tiny_sd3, 64, 62)


def test_a_size_of_the_model_multiple_not_of_8_draws_diffusers_image(tiny_sd3, stages):
    """tiny-sd3's multiple is 4 (its 2x VAE, patches of 2): 36 x 44 runs, as in diffusers' SD3 pipeline."""
    check_parity(tiny_sd3, stages, "FlowMatchEuler", request(tiny_sd3, height=36, width=44))


def test_an_input_image_is_rounded_down_to_the_model_multiple(tiny_sd3):
    from PIL import Image

    image = Image.new("RGB", (71, 70), "red")
    assert Request("a cat", image=image).resolved(tiny_sd3).height == 68  # SD's: 64
    assert Request("a cat", image=image).resolved(resolve_model("tiny")).width == 64


def test_demo_diffusion_refuses_a_size_not_of_sd3_multiple_in_one_line(sd3_sized, tmp_path, capsys):
    from demo.cli.generate import main

    out = tmp_path / "out"
    assert main(["a cat", "--model", str(sd3_sized.path), "--height", "200", "--width", "208", "--output-dir",
                 str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--height must be a multiple of 16 for model" in lines[0], lines
    assert not out.exists()


def test_the_steps_a_strength_leaves_are_counted_as_the_family_pipeline_counts_them():
    """demo.schedulers.first_step keyed on the family's flow matching: SD3's count (diffusers' SD3 img2img) runs a
    step where SD's would run none, and the request check refuses by the model's own count."""
    from PIL import Image

    from demo.schedulers import first_step

    assert [first_step(steps, strength) for steps, strength in ((5, 0.7), (4, 0.2), (10, 0.75))] == [2, 4, 3]
    assert [first_step(steps, strength, flow=True) for steps, strength in ((5, 0.7), (4, 0.2), (10, 0.75))] == [1, 3, 2]
    image = Image.new("RGB", (SIZE, SIZE), "red")
    with pytest.raises(UsageError, match="^strength 0.2 leaves none of the 4 denoising steps to run"):
        request(resolve_model("tiny"), image=image, strength=0.2, denoising_steps=4)
    assert request(resolve_model("tiny-sd3"), image=image, strength=0.2, denoising_steps=4).strength == 0.2


def sd3_folder_with(source, tmp_path, drop_t5: bool = False, **transformer):
    """A copy of `source`'s folder with its transformer config changed (configs only: refused before loading)."""
    folder = tmp_path / "model"
    shutil.copytree(source.path, folder, ignore=shutil.ignore_patterns("manifest*"))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, **transformer}))
    if drop_t5:
        shutil.rmtree(folder / "text_encoder_3")
        shutil.rmtree(folder / "tokenizer_3")
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, "text_encoder_3": [None, None],
                                                             "tokenizer_3": [None, None]}))
    return folder


@pytest.mark.parametrize("transformer, drop_t5, message", [
    ({"joint_attention_dim": 128}, False,
     r"attends to text 128 wide \(joint_attention_dim\), but its T5's states are 96 wide \(text_encoder_3 d_model\)$"),
    ({"joint_attention_dim": 48}, True,
     r"attends to text 48 wide \(joint_attention_dim\), but its CLIP text encoders' states, side by side, are 32 "
     r"\(text_encoder\) \+ 32 \(text_encoder_2\) wide \(hidden_size\): wider than the text they are padded to$"),
    ({"pooled_projection_dim": 48}, False,
     r"takes pooled text 48 wide \(pooled_projection_dim\), but its text encoders' pooled outputs are 32 "
     r"\(text_encoder\) \+ 32 \(text_encoder_2\) wide \(projection_dim\)$"),
])
def test_an_sd3_folder_whose_transformer_misfits_its_text_encoders_is_refused_at_load(tiny_sd3, tmp_path, transformer,
                                                                                     drop_t5, message):
    folder = sd3_folder_with(tiny_sd3, tmp_path, drop_t5, **transformer)
    with pytest.raises(UsageError, match=r"^component 'transformer': .*transformer/config.json " + message):
        resolve_model(str(folder))


def test_demo_diffusion_refuses_an_sd3_folder_of_the_wrong_text_width_in_one_line(tiny_sd3, tmp_path, capsys):
    from demo.cli.generate import main

    folder = sd3_folder_with(tiny_sd3, tmp_path, joint_attention_dim=128)
    resolve_model(str(sd3_folder_with(tiny_sd3, tmp_path / "fits")))  # the same copy, unchanged, is fine
    assert main(["a cat", "--model", str(folder), "--output-dir", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "attends to text 128 wide (joint_attention_dim)" in lines[0], lines


def test_a_request_left_to_the_model_gets_diffusers_sd3_defaults(tiny_sd3, tmp_path):
    """diffusers' StableDiffusion3Pipeline runs 28 steps at guidance 7.0 and its image-to-image pipeline 50 at 7.0:
    a request that gives neither gets them from the folder's class (models.recommended); a given one keeps its own."""
    resolved = Request("a cat", seed=0).resolved(tiny_sd3)
    assert (resolved.denoising_steps, resolved.guidance_scale, resolved.scheduler) == (28, 7.0, "FlowMatchEuler")
    assert Request("a cat", seed=0, denoising_steps=3, guidance_scale=2.0).resolved(tiny_sd3).denoising_steps == 3
    folder = tmp_path / "img2img"
    shutil.copytree(tiny_sd3.path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusion3Img2ImgPipeline"}))
    resolved = Request("a cat", seed=0).resolved(resolve_model(str(folder)))
    assert (resolved.denoising_steps, resolved.guidance_scale) == (50, 7.0)


@pytest.mark.parametrize("model, limit", [("tiny-sd3", 256), ("tiny-flux", 512)])
def test_a_prompt_longer_than_t5_reads_is_one_line(model, limit):
    """SD3 reads 256 T5 tokens, Flux 512: a longer prompt is refused naming it (diffusers would cut it unsaid);
    one that fits, and a long negative prompt where no guidance reads it, pass."""
    source = resolve_model(model)
    words = "a red circle on a blue background "
    long = words * (limit // 4)
    assert len(source.t5_tokenizer(long).input_ids) > limit
    with pytest.raises(UsageError, match=f"prompt.* is \\d+ T5 tokens; model '{model}' reads {limit}") as error:
        Request(long, seed=0).resolved(source).check(source)
    assert "\n" not in str(error.value)
    Request(words, seed=0).resolved(source).check(source)
    Request(words, negative_prompt=long, seed=0, guidance_scale=1.0).resolved(source).check(source)
    if source.guidance == CLASSIFIER_FREE:  # SD3's negative prompt is read at a scale above 1
        with pytest.raises(UsageError, match="negative_prompt"):
            Request(words, negative_prompt=long, seed=0, guidance_scale=7.0).resolved(source).check(source)


def test_t5_in_fp16_keeps_its_feed_forward_output_projections_in_fp32_as_transformers_does(tiny_sd3):
    """The torch backend's T5 stage in fp16 keeps `wo` in fp32 (T5EncoderModel._keep_in_fp32_modules): with
    feed-forward outputs past fp16's range (T5-XXL's real activations are), its states stay near fp32's, where the
    whole module cast to fp16 saturates them."""
    from demo.backends.torch.stage import TorchStage
    from models import T5Model

    def states(dtype, cast_whole=False):
        stage = TorchStage(T5Model(tiny_sd3), torch.device("cpu"), dtype)
        module = stage.module.half() if cast_whole else stage.module
        blocks = module.encoder.encoder.block
        with torch.no_grad():
            for block in blocks:
                block.layer[-1].DenseReluDense.wo.weight.mul_(4e4)  # outputs of 1e5 and more: past fp16's 65504
        ids = torch.randint(0, 100, (1, tiny_sd3.family.t5_length), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            return module(ids.int()).float(), blocks

    exact, _ = states(torch.float32)
    kept, blocks = states(torch.float16)
    whole, _ = states(torch.float16, cast_whole=True)
    feed_forwards = [block.layer[-1].DenseReluDense for block in blocks]
    assert all(ff.wo.weight.dtype == torch.float32 and ff.wi_0.weight.dtype == torch.float16 for ff in feed_forwards)
    error = lambda states: ((states - exact).abs().max() / exact.abs().max()).item()  # noqa: E731
    assert error(kept) < 1e-2 < error(whole)
