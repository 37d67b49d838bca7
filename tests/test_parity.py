"""Same seed, same image as diffusers' StableDiffusionPipeline (CPU, fp32, torch backend): tests/parity.py."""

import json
import shutil

import numpy as np
import pytest
import torch

from demo.pipelines import StageTimer, Text2ImagePipeline, to_uint8
from demo.pipelines.images import device_pixels, postprocess
from demo.request import Request
from models.source import resolve_model
from tests.parity import CPU, check_parity, torch_stages

PROMPTS = ("a photo of an astronaut riding a horse", "a red car")
NEGATIVE = ("blurry", "")


@pytest.fixture(scope="module")
def v_prediction_dir(tiny, tmp_path_factory):
    """A model directory the test writes itself: tiny with a v-prediction Euler scheduler config."""
    directory = tmp_path_factory.mktemp("vpred") / "model"
    shutil.copytree(tiny.path, directory)
    config_path = directory / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config.update({"_class_name": "EulerDiscreteScheduler", "prediction_type": "v_prediction"})
    config_path.write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("scheduler", ["DDIM", "EulerA", "DPM++2M", "PNDM"])
def test_matches_diffusers(tiny, tiny_stages, scheduler):
    # seed 0 is a valid seed; a non-square, non-native size checks the latent shape arithmetic.
    request = Request(PROMPTS, NEGATIVE, height=48, width=80, denoising_steps=6, guidance_scale=7.5, seed=0)
    check_parity(tiny, tiny_stages, scheduler, request)


def test_matches_diffusers_v_prediction_without_guidance(v_prediction_dir, tiny_stages):
    source = resolve_model(str(v_prediction_dir))
    assert source.prediction_type == "v_prediction"
    request = Request(PROMPTS[0], NEGATIVE[0], height=64, width=64, denoising_steps=5, guidance_scale=1.0, seed=3)
    check_parity(source, tiny_stages, "Euler", request)


def test_seed_changes_image(tiny, tiny_stages):
    pipeline = Text2ImagePipeline(tiny, tiny_stages, "DDIM", torch.device("cpu"), torch.float32)
    timer = StageTimer(torch.device("cpu"))
    images = [to_uint8(pipeline(Request(PROMPTS[0], "", height=64, width=64, denoising_steps=3, guidance_scale=7.5,
                                        seed=seed), timer))
              for seed in (0, 1, 0)]
    assert not np.array_equal(images[0], images[1])
    assert np.array_equal(images[0], images[2])


@pytest.fixture(scope="module")
def other_vae(tiny, tmp_path_factory):
    """A VAE folder the test writes: tiny's VAE with other decoder weights (a model folder with it in vae/)."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny.path, subfolder="vae")
    with torch.no_grad():
        for parameter in vae.decoder.parameters():
            parameter.mul_(1.1)
    folder = tmp_path_factory.mktemp("other") / "model"
    vae.save_pretrained(folder / "vae")
    return folder


def test_another_vae_decodes_as_diffusers_does_with_it(tiny, other_vae):
    from diffusers import AutoencoderKL

    source = resolve_model("tiny", vae=str(other_vae))
    assert source.vae == other_vae / "vae" and source.fingerprint != tiny.fingerprint  # engines are keyed by it
    request = Request(PROMPTS[0], NEGATIVE[0], height=64, width=64, denoising_steps=3, guidance_scale=7.5, seed=1)
    ours = check_parity(source, torch_stages(source), "DDIM", request,
                        vae=AutoencoderKL.from_pretrained(other_vae / "vae"))
    own_stages = torch_stages(tiny)
    own = to_uint8(Text2ImagePipeline(tiny, own_stages, "DDIM", CPU, torch.float32)(request, StageTimer(CPU)))
    assert np.abs(own.astype(int) - ours.astype(int)).max() > 10  # the other VAE was used


@pytest.mark.parametrize("make, message", [
    (lambda folder: None, "not a VAE folder"),
    (lambda folder: (folder / "config.json").write_text("{}"), "names class None"),
    (lambda folder: shutil.copytree(resolve_model("tiny").path / "unet", folder, dirs_exist_ok=True),
     "its config names UNet2DConditionModel, not an AutoencoderKL"),
    (lambda folder: shutil.copytree(resolve_model("tiny").path / "vae", folder, dirs_exist_ok=True) and
     (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                     "latent_channels": 16})),
     "its latents have 16 channels, model 'tiny''s UNet takes 4"),
])
def test_a_bad_vae_folder_is_one_line(make, message, tiny, tmp_path):
    """Not a VAE, or a VAE of another family (other latent channels): one line. A VAE of another model with the
    UNet's latent channels is taken (test above), as diffusers takes it, with its own scaling factor."""
    from core.errors import UsageError

    make(tmp_path)
    with pytest.raises(UsageError, match=message):
        resolve_model("tiny", vae=str(tmp_path))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs gpu: no CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pixels_made_on_the_device_are_the_clis_bit_for_bit(device, dtype):
    """sd-serve's 8-bit images (device_pixels) against the CLI's (to_uint8 of postprocess, on the CPU), on fresh
    random decoder outputs beyond [-1, 1] and on values whose pixel lies half way between two (rounding's edge)."""
    decoded = torch.randn(2, 3, 40, 48, generator=torch.Generator().manual_seed(7)) * 1.2
    halves = (torch.arange(255, dtype=torch.float32) + 0.5) / 255 * 2 - 1  # (x / 2 + 0.5) * 255 near k + 0.5
    decoded[0, 0, 0, :48] = halves[:48]
    decoded[1, 1, 0, :48] = halves[-48:]
    decoded = decoded.to(dtype)
    clis = to_uint8(postprocess(decoded.float(), dtype))
    served = device_pixels(decoded.to(device), dtype)
    assert served.dtype == np.uint8 and served.shape == (2, 40, 48, 3) and served.flags.c_contiguous
    assert np.array_equal(served, clis)
    assert len(np.unique(served)) > 200
