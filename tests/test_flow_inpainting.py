"""Inpainting for the flow families (SD3, Flux): same seed, same image as diffusers' StableDiffusion3InpaintPipeline
and FluxInpaintPipeline on the tiny built-ins on the CPU in fp32: SD3's 16-channel transformer (the latent blend) and a
33-channel inpainting one (the mask and masked image's latents beside the latents), guided and unguided; Flux
[dev]-style and [schnell]-style; strengths below 1 and 1; a mask that both keeps and repaints. The CLI, the Python API
and sd-serve's request parsing reach it; a bad mask is refused in one line (what the families lack stays refused with a
mask too: tests/test_sd3.py, tests/test_flux.py)."""

import json
import shutil

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import UsageError
from demo.pipelines import FluxInpaintPipeline, SD3InpaintPipeline, make_pipeline
from demo.request import INPAINTING, MODES, Request, modes_of
from models import image_to_image_stages
from models.families import FLUX, SD3
from models.source import resolve_model
from tests.parity import CPU, check_parity, diffusers_images, torch_stages

SIZES = {"sd3": 64, "flux": 128}  # tiny-sd3's native size; the least tiny-flux takes


def a_mask(size: int) -> Image.Image:
    """White (repaint) in a rectangle and a few scattered pixels, black (keep) elsewhere."""
    pixels = np.zeros((size, size), np.uint8)
    pixels[size // 6: size // 2, size // 5: 3 * size // 4] = 255
    pixels[np.random.default_rng(1).random((size, size)) < 0.05] = 255
    return Image.fromarray(pixels)


def an_image(size: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(3).integers(0, 256, (size, size, 3), dtype=np.uint8))


class ShiftedBackVAE(diffusers.AutoencoderKL):
    """diffusers' VAE decoding as SD3's other pipelines (and ours) decode: diffusers 0.42's
    StableDiffusion3InpaintPipeline hands it `latents / scaling_factor`, the shift_factor left out
    (huggingface/diffusers#13611); this adds it back, so that everything else is diffusers' pipeline as it is."""

    def decode(self, z, *args, **kwargs):
        return super().decode(z + self.config.shift_factor, *args, **kwargs)


@pytest.fixture(scope="module")
def sd3_inpainting(tmp_path_factory):
    """tiny-sd3 with a 33-channel transformer (16 latent channels, the mask's 1, the masked image's 16; its own random
    weights), its model_index.json naming StableDiffusion3InpaintPipeline."""
    source = resolve_model("tiny-sd3")
    folder = tmp_path_factory.mktemp("sd3-inpainting") / "model"
    shutil.copytree(source.path, folder, ignore=shutil.ignore_patterns("manifest*", "transformer"))
    config = diffusers.SD3Transformer2DModel.load_config(source.component_dir("transformer"))
    with torch.random.fork_rng():
        torch.manual_seed(1)
        diffusers.SD3Transformer2DModel.from_config({**config, "in_channels": 33}).save_pretrained(
            folder / "transformer")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": SD3.diffusers_pipeline(INPAINTING)}))
    return resolve_model(str(folder))


_STAGES = {}  # each model's torch stages, made once


def source_and_stages(model: str, sd3_inpainting):
    source = sd3_inpainting if model == "sd3-inpainting" else resolve_model(model)
    if model not in _STAGES:
        _STAGES[model] = torch_stages(source, image_to_image_stages(source))
    return source, _STAGES[model]


def inpainting(source, **given) -> Request:
    size = SIZES[source.family.name]
    made = Request("a photo of a cat on a table", **{"seed": 11, "height": size, "width": size, "image": an_image(size),
                                                      "mask": a_mask(size), **given}).resolved(source)
    made.check(source)
    return made


def reference_components(source) -> dict:
    return {"vae": ShiftedBackVAE.from_pretrained(source.component_dir("vae"))} if source.family is SD3 else {}


@pytest.mark.parametrize("model, given", [
    ("tiny-sd3", dict(strength=0.75, denoising_steps=4, guidance_scale=5.0, negative_prompt="blurry")),
    ("tiny-sd3", dict(strength=1.0, denoising_steps=3, guidance_scale=1.0)),  # unguided: one half, from noise
    ("sd3-inpainting", dict(strength=1.0, denoising_steps=3, guidance_scale=5.0, batch_size=2)),  # image unencoded
    ("sd3-inpainting", dict(strength=0.7, denoising_steps=5, guidance_scale=1.0)),  # 5 at 0.7 run 4
    ("tiny-flux", dict(strength=0.6, denoising_steps=4, guidance_scale=3.5, batch_size=2)),  # [dev]: embedded
    ("tiny-flux", dict(strength=1.0, denoising_steps=3)),
    ("tiny-flux-schnell", dict(strength=0.7, denoising_steps=5)),  # no guidance at all
    ("tiny-flux-schnell", dict(strength=1.0, denoising_steps=2)),
])
def test_inpainting_draws_diffusers_image(model, given, sd3_inpainting):
    source, stages = source_and_stages(model, sd3_inpainting)
    made = inpainting(source, **given)
    pipeline = make_pipeline(source, stages, made.scheduler, CPU, torch.float32, INPAINTING)
    assert isinstance(pipeline, SD3InpaintPipeline if source.family is SD3 else FluxInpaintPipeline)
    assert source.inpainting == (model == "sd3-inpainting")
    check_parity(source, stages, made.scheduler, made, **reference_components(source))


def test_sd3_decodes_its_inpainting_shifted_back_where_diffusers_leaves_the_shift_out(sd3_inpainting):
    """diffusers' own decode, unshifted, is another image: the shift is not a rounding's worth on tiny-sd3."""
    source, stages = source_and_stages("tiny-sd3", sd3_inpainting)
    made = inpainting(source, strength=0.75, denoising_steps=2, guidance_scale=1.0)
    ours = check_parity(source, stages, made.scheduler, made, **reference_components(source))
    unshifted = diffusers_images(source, made.scheduler, made)
    assert np.abs(ours.astype(int) - unshifted.astype(int)).max() > 2


def test_the_modes_each_model_runs(sd3_inpainting):
    """Ordinary SD3 and Flux transformers run all three modes (inpainting by the latent blend); SD3's 33-channel one
    only inpaints; a Flux transformer of 33 x 4 packed channels is no inpainting one (FluxInpaintPipeline blends)."""
    assert modes_of(resolve_model("tiny-sd3")) == modes_of(resolve_model("tiny-flux")) == MODES
    assert modes_of(sd3_inpainting) == (INPAINTING,)
    assert (sd3_inpainting.input_channels, sd3_inpainting.latent_channels) == (33, 16)
    with pytest.raises(UsageError, match="^model '.*' is an inpainting model .*it only inpaints, with image and mask$"):
        Request("a cat", seed=0, height=64, width=64, image=an_image(64)).resolved(sd3_inpainting).check(
            sd3_inpainting)


def test_a_flux_transformer_of_inpainting_channels_is_refused(tmp_path):
    source = resolve_model("tiny-flux")
    folder = tmp_path / "model"
    shutil.copytree(source.path, folder, ignore=shutil.ignore_patterns("manifest*"))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "in_channels": 33 * 4,
                                                                    "out_channels": 64}))
    odd = resolve_model(str(folder))
    assert odd.family is FLUX and not odd.inpainting
    with pytest.raises(UsageError, match="takes 33 channels for 16 latent ones, neither an ordinary nor an inpainting"):
        inpainting(odd)


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_demo_diffusion_inpaints_and_refuses_a_mask_of_other_proportions(model, tmp_path, capsys):
    from demo.cli.generate import main

    size = SIZES[resolve_model(model).family.name]
    an_image(size).save(tmp_path / "image.png")
    a_mask(size).save(tmp_path / "mask.png")
    a_mask(size).resize((size, size // 2)).save(tmp_path / "wide.png")
    out = tmp_path / "out"
    common = ["a castle", "--model", model, "--input-image", str(tmp_path / "image.png"), "--denoising-steps", "2",
              "--seed", "4", "--num-warmup-runs", "0"]
    assert main([*common, "--mask-image", str(tmp_path / "mask.png"), "--output-dir", str(out)]) == 0, \
        capsys.readouterr().err
    assert "VAE-Enc" in capsys.readouterr().out
    report = json.loads(next(out.glob("*.json")).read_text())
    assert report["mask_image"] == str(tmp_path / "mask.png") and report["strength"] == 1.0
    assert Image.open(out / report["images"][0]).size == (size, size)
    status = main([*common, "--mask-image", str(tmp_path / "wide.png"), "--output-dir", str(tmp_path / "refused")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "the mask must have the image's proportions" in lines[0], lines
    assert not (tmp_path / "refused").exists()


def test_the_python_api_inpaints_as_diffusers_with_its_names():
    from demo import PipelineSpec, load_pipeline
    from demo.runtime.loader import quiet

    source = resolve_model("tiny-flux")
    made = inpainting(source, strength=0.6, denoising_steps=3, guidance_scale=3.5)
    with load_pipeline(PipelineSpec(model="tiny-flux", backend="torch", plugins="none"), CPU, log=quiet,
                       progress=quiet) as pipe:
        ours = pipe(made.prompt, image=made.image, mask_image=made.mask, strength=0.6, num_inference_steps=3,
                    guidance_scale=3.5, height=made.height, width=made.width,
                    generator=torch.Generator().manual_seed(made.seed), output_type="np").images
    theirs = diffusers_images(source, made.scheduler, made)
    assert np.abs((ours * 255).round().astype(int) - theirs.astype(int)).max() <= 2


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_sd_serve_takes_an_inpainting_request_and_refuses_a_bad_mask(model):
    from demo.runtime.loader import plan_pipeline
    from demo.runtime.spec import PipelineSpec
    from demo.serve.schema import INPUTS, RequestRejected, parse_request

    plan = plan_pipeline(PipelineSpec(model=model, backend="torch"), "cpu")
    assert INPAINTING in plan.modes
    size = SIZES[plan.source.family.name]
    image, mask = np.asarray(an_image(size)), np.asarray(a_mask(size))
    dtypes = {item.name: item.dtype for item in INPUTS}  # as Triton hands them over: [1, 1], images [1, H, W(, 3)]
    given = {"prompt": np.array([[b"a"]], dtypes["prompt"]), "image": image[None], "mask": mask[None],
             "strength": np.array([[0.5]], dtypes["strength"])}
    parsed = parse_request(given, plan, mode=INPAINTING)
    assert (parsed.mode, parsed.height, parsed.strength) == (INPAINTING, size, 0.5)
    with pytest.raises(RequestRejected, match="the mask must have the image's proportions"):
        parse_request({**given, "mask": mask[None, : size // 2]}, plan, mode=INPAINTING)
