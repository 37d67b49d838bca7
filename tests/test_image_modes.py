"""Image-to-image and inpainting (issue 19, parts 1 and 2): same seed, same image as diffusers' image-to-image and
inpaint pipelines (SD and SDXL; 9-channel inpainting UNets, and the latent blend for ordinary ones) on the CPU
(tests/parity.py), the VAE encoder as a stage on the engine path too, and demo-diffusion's flags for them.

Input images are random pixels, masks neither all black nor all white, strengths mostly below 1."""

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from demo.backends.base import Stage
from demo.backends.registry import REFERENCE
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.settings import FALLBACK
from demo.pipelines import (
    Image2ImagePipeline,
    InpaintPipeline,
    SDXLImage2ImagePipeline,
    SDXLInpaintPipeline,
    StageTimer,
    make_pipeline,
    to_uint8,
)
from demo.request import IMAGE_TO_IMAGE, INPAINTING, Request
from demo.runtime.loader import load_pipeline
from demo.runtime.spec import PipelineSpec
from models import STAGE_MODELS, image_to_image_stages, stage_batch
from models.families import SDXL
from models.source import resolve_model
from tests.parity import CPU, check_input_images, check_parity, torch_stages

PROMPTS = ("a photo of an astronaut riding a horse", "a red car")
HEIGHT, WIDTH = 64, 48  # a non-square request; tiny's native size is 64


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def a_mask(height: int, width: int) -> Image.Image:
    """White (repaint) in a rectangle and a few scattered pixels, black (keep) elsewhere."""
    pixels = np.zeros((height, width), np.uint8)
    pixels[height // 6: height // 2, width // 5: 3 * width // 4] = 255
    pixels[np.random.default_rng(1).random((height, width)) < 0.05] = 255
    return Image.fromarray(pixels)


IMAGE = random_image(HEIGHT, WIDTH)
LARGER = random_image(96, 72, seed=2)  # same proportions: resized to the request's size, as diffusers does
MASK = a_mask(HEIGHT, WIDTH)


def test_input_images_are_made_on_the_device_as_diffusers_makes_them():
    check_input_images(CPU)


def request(mode: str, strength: float, image=IMAGE, mask=MASK, negatives=None, guidance=7.0, **kwargs):
    args = dict(height=HEIGHT, width=WIDTH, denoising_steps=5, guidance_scale=guidance, seed=3)
    return Request(PROMPTS, negatives, **{**args, **kwargs}, image=image, mask=mask if mode == INPAINTING else None,
                   strength=strength)


_STAGES = {}


def stages(name: str):
    """A model's image-to-image stages with the torch backend on the CPU (loaded once per model)."""
    if name not in _STAGES:
        source = resolve_model(name)
        _STAGES[name] = source, torch_stages(source, image_to_image_stages(source))
    return _STAGES[name]


@pytest.mark.parametrize("scheduler, strength", [("DDIM", 0.6), ("EulerA", 0.8)])
def test_image_to_image_matches_diffusers(scheduler, strength):
    source, used = stages("tiny")
    assert isinstance(make_pipeline(source, used, scheduler, CPU, torch.float32, IMAGE_TO_IMAGE), Image2ImagePipeline)
    check_parity(source, used, scheduler, request(IMAGE_TO_IMAGE, strength, negatives=("blurry", "")))


@pytest.mark.parametrize("model, scheduler, strength", [("tiny-xl", "Euler", 0.7), ("tiny-xl", "DPM++2M", 0.5),
                                                        ("tiny-xl-refiner", "DDIM", 0.5)])
def test_sdxl_image_to_image_matches_diffusers(model, scheduler, strength):
    """The refiner alone, as StableDiffusionXLImg2ImgPipeline runs it: aesthetic scores in its time ids."""
    source, used = stages(model)
    assert isinstance(make_pipeline(source, used, scheduler, CPU, torch.float32, IMAGE_TO_IMAGE),
                      SDXLImage2ImagePipeline)
    check_parity(source, used, scheduler, request(IMAGE_TO_IMAGE, strength))


@pytest.mark.parametrize("model, scheduler, strength", [
    ("tiny-inpaint", "DPM++2M", 0.7),  # 9-channel UNet, noised input image
    ("tiny-inpaint", "EulerA", 1.0),  # 9-channel UNet from noise: the input image reaches it only masked
    ("tiny", "EulerA", 0.75),  # ordinary UNet: the latent blend; EulerA draws after the masked image's sample
    ("tiny", "DDIM", 1.0),
])
def test_inpainting_matches_diffusers(model, scheduler, strength):
    source, used = stages(model)
    assert source.inpainting == (model == "tiny-inpaint")
    assert isinstance(make_pipeline(source, used, scheduler, CPU, torch.float32, INPAINTING), InpaintPipeline)
    # An input image of another size (same proportions) is resized to the request's, as diffusers resizes it.
    check_parity(source, used, scheduler, request(INPAINTING, strength, image=LARGER, negatives=("", "blurry")))


@pytest.mark.parametrize("model, scheduler, strength", [("tiny-xl-inpaint", "Euler", 0.8), ("tiny-xl", "EulerA", 0.6)])
def test_sdxl_inpainting_matches_diffusers(model, scheduler, strength):
    source, used = stages(model)
    assert source.family is SDXL and source.inpainting == (model == "tiny-xl-inpaint")
    assert isinstance(make_pipeline(source, used, scheduler, CPU, torch.float32, INPAINTING), SDXLInpaintPipeline)
    check_parity(source, used, scheduler, request(INPAINTING, strength, guidance=1.0))  # unguided: no doubled mask


def run_pipeline(model: str, scheduler: str, req: Request) -> np.ndarray:
    source, used = stages(model)
    return to_uint8(make_pipeline(source, used, scheduler, CPU, torch.float32, req.mode)(req, StageTimer(CPU)))


def test_the_input_image_mask_and_strength_each_change_the_image():
    base = run_pipeline("tiny", "DDIM", request(INPAINTING, 0.6))
    for changed in (request(INPAINTING, 0.6, image=random_image(HEIGHT, WIDTH, seed=5)),
                    request(INPAINTING, 0.6, mask=a_mask(HEIGHT, WIDTH).transpose(Image.Transpose.FLIP_TOP_BOTTOM)),
                    request(INPAINTING, 0.9)):
        assert np.abs(run_pipeline("tiny", "DDIM", changed).astype(int) - base.astype(int)).max() > 10
    # The blend keeps the masked-out part close to the input image; the repainted part is new.
    ours = run_pipeline("tiny", "DDIM", request(INPAINTING, 1.0, guidance=1.0)).astype(float)[0]
    keep = (np.asarray(MASK) == 0)[..., None]
    error = np.abs(ours - np.asarray(IMAGE, float))
    assert (error * keep).sum() / keep.sum() < (error * ~keep).sum() / (~keep).sum()


def test_timesteps_follow_the_strength():
    source, used = stages("tiny")
    pipeline = make_pipeline(source, used, "DDIM", CPU, torch.float32, IMAGE_TO_IMAGE)
    assert pipeline.unet_calls(10) == 10 and pipeline.unet_calls(10, 0.55) == 5 and pipeline.unet_calls(10, 0.1) == 1
    assert pipeline.timesteps(10, 0.5).tolist() == pipeline.timesteps(10).tolist()[5:]


def test_the_vae_encoder_is_a_stage_that_honours_force_upcast():
    """The input image is encoded once (batch 1), in fp32 where an SDXL VAE config says force_upcast; the pipeline
    hands it the stage's dtype, whatever the others run in."""
    tiny, tiny_xl = resolve_model("tiny"), resolve_model("tiny-xl")
    assert image_to_image_stages(tiny) == ("clip", "unet", "vae", "vae_encoder")
    assert image_to_image_stages(tiny_xl) == ("clip", "clip2", "unet", "vae", "vae_encoder")
    assert stage_batch("vae_encoder", 4, guided=True) == 1
    encoder = STAGE_MODELS["vae_encoder"]
    assert encoder(tiny_xl).stage_dtype(torch.float16) == torch.float32
    assert encoder(tiny).stage_dtype(torch.float16) == torch.float16  # SD's pipelines ignore force_upcast
    upcast = REFERENCE.create_stages([encoder(tiny_xl)], lambda _: FALLBACK, CPU, torch.float16, print, print)
    assert upcast["vae_encoder"].dtype == torch.float32

    for source, expected in ((tiny_xl, torch.float32), (tiny, torch.float16)):
        seen = []

        class Stub(Stage):
            def __call__(self, feed):
                seen.append((self.name, {k: (v.dtype, tuple(v.shape)) for k, v in feed.items()}))
                batch = next(iter(feed.values())).shape[0]
                shapes = self.model.output_shapes(batch, HEIGHT, WIDTH)
                return {name: torch.randn(shapes[name]).to(self.model.stage_dtype(torch.float16))
                        for name in self.model.output_names}

        stubs = {name: Stub(STAGE_MODELS[name](source)) for name in image_to_image_stages(source)}
        for mode in (IMAGE_TO_IMAGE, INPAINTING):
            seen.clear()
            make_pipeline(source, stubs, "DDIM", CPU, torch.float16, mode)(request(mode, 0.6), StageTimer(CPU))
            encoded = [feed["images"] for name, feed in seen if name == "vae_encoder"]
            assert encoded == [(expected, (1, 3, HEIGHT, WIDTH))]  # an ordinary UNet never sees the masked image


# ---- on engines (tests/fake_tensorrt.py runs the ONNX with ONNX Runtime) -----------------------------------------

@pytest.fixture
def trt(monkeypatch):
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "10.8.0")


def engine_pipeline(model, mode, folder):
    """The model's pipeline for `mode` on engines (the stand-in TensorRT), built for the test's request."""
    spec = PipelineSpec(model=model, backend="tensorrt", precision="fp32", plugins="none", modes=(mode,),
                        height=HEIGHT, width=WIDTH, batch_size=2, scheduler="DDIM",
                        engine=EngineOptions(onnx_dir=str(folder / "onnx"), engine_dir=str(folder / "engine"),
                                             build_static_batch=True, optimization_level=0))
    return load_pipeline(spec, CPU, progress=lambda *_: None)


@pytest.mark.parametrize("model, mode", [("tiny", IMAGE_TO_IMAGE), ("tiny-inpaint", INPAINTING)])
def test_engines_give_the_torch_backends_image(trt, model, mode, tmp_path):
    source, used = stages(model)
    with engine_pipeline(model, mode, tmp_path) as on_engines:
        assert on_engines.stages["vae_encoder"].engine.profile("images")[2] == (1, 3, HEIGHT, WIDTH)  # one image
        req = on_engines.request(request(mode, 0.7, guidance=7.5, scheduler="DDIM"))
        engine_images = on_engines.run([req])
    torch_images = make_pipeline(source, used, "DDIM", CPU, torch.float32, mode)(req, StageTimer(CPU))
    assert abs(engine_images - torch_images).max() < 1e-3 and to_uint8(torch_images).std() > 5


# ---- demo-diffusion ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    paths = {"image": folder / "image.png", "mask": folder / "mask.png", "wide": folder / "wide.png",
             "big": folder / "big.png", "text": folder / "notes.png"}
    IMAGE.save(paths["image"])
    a_mask(32, 24).convert("RGB").save(paths["mask"])  # half the image's size, in colour: resized and made grey
    a_mask(32, 48).save(paths["wide"])
    random_image(400, 300).save(paths["big"])
    paths["text"].write_text("not an image")
    paths["folder"] = folder / "a-folder.png"
    paths["folder"].mkdir()
    paths["truncated"] = folder / "truncated.png"
    paths["truncated"].write_bytes(paths["image"].read_bytes()[:200])
    paths["one"] = folder / "one-pixel.png"
    random_image(1, 1).save(paths["one"])
    paths["huge"] = folder / "huge.png"
    paths["huge"].write_bytes(png_claiming(paths["image"].read_bytes(), 20000, 20000))
    return paths


def png_claiming(png: bytes, width: int, height: int) -> bytes:
    """The PNG `png` with a header claiming another size (its pixel data unchanged): what PIL reads first."""
    start = png.index(b"IHDR")
    chunk = b"IHDR" + struct.pack(">II", width, height) + png[start + 12:start + 17]
    return png[:start] + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[start + 21:]


@pytest.mark.parametrize("args, mode, unet_calls", [
    (["--model", "tiny", "--strength", "0.5"], IMAGE_TO_IMAGE, 2),
    (["--model", "tiny-inpaint", "--mask-image", "MASK", "--height", "48", "--width", "32"], INPAINTING, 4),
])
def test_demo_renders_from_an_input_image(args, mode, unet_calls, files, tmp_path, capsys):
    from demo.cli.generate import main

    out = tmp_path / "out"
    args = [str(files["mask"]) if arg == "MASK" else arg for arg in args]
    assert main(["a castle", "--input-image", str(files["image"]), "--output-dir", str(out), "--denoising-steps", "4",
                 "--scheduler", "DDIM", "--seed", "4", "--num-warmup-runs", "0", *args]) == 0
    assert "VAE-Enc" in capsys.readouterr().out
    report = json.loads(next(out.glob("*.json")).read_text())
    assert report["input_image"] == str(files["image"]) and report["unet_calls"] == unet_calls
    assert report["strength"] == (0.5 if mode == IMAGE_TO_IMAGE else 1.0)  # inpainting's default: diffusers'
    assert report["mask_image"] == (str(files["mask"]) if mode == INPAINTING else None)
    assert report["latency_ms"]["vae_encoder"] > 0
    size = (report["width"], report["height"])
    assert size == ((48, 64) if mode == IMAGE_TO_IMAGE else (32, 48))  # the image's own size, or the one asked
    assert Image.open(out / report["images"][0]).size == size


@pytest.mark.parametrize("args, message", [
    (["--input-image", "NOWHERE"], "--input-image NOWHERE: no such file"),
    (["--input-image", "TEXT"], "cannot be read as an image"),
    (["--input-image", "IMAGE", "--strength", "0"], "--strength must be more than 0 and at most 1, got 0.0"),
    (["--input-image", "IMAGE", "--strength", "1.5"], "--strength must be more than 0 and at most 1"),
    (["--input-image", "IMAGE", "--strength", "0.2", "--denoising-steps", "4"], "leaves none of the 4 denoising"),
    (["--strength", "0.5"], "--strength needs --input-image"),
    (["--mask-image", "MASK"], "--mask-image needs --input-image"),
    (["--input-image", "IMAGE", "--mask-image", "WIDE"], "the mask must have the image's proportions"),
    (["--input-image", "BIG"], "--input-image is 300x400; model 'tiny' takes 32..128 pixels a side: give --height"),
    (["--input-image", "ONE"], "--input-image is 1x1; model 'tiny' takes 32..128 pixels a side: give --height"),
    (["--input-image", "FOLDER"], "cannot be read as an image (Is a directory)"),
    (["--input-image", "TRUNCATED"], "cannot be read as an image"),
    (["--input-image", "HUGE"], "more than the 89478485 pixels an image may have here"),
    (["--input-image", "IMAGE", "--mask-image", "TEXT"], "--mask-image TEXT: cannot be read as an image"),
    (["--input-image", "IMAGE", "--mask-image", "NOWHERE"], "--mask-image NOWHERE: no such file"),
    (["--model", "tiny-inpaint"], "model 'tiny-inpaint' is an inpainting model"),
    (["--model", "tiny-inpaint", "--input-image", "IMAGE"], "it only inpaints, with --input-image and --mask-image"),
    (["--model", "tiny-xl", "--refiner", "tiny-xl-refiner", "--input-image", "IMAGE"],
     "--refiner refines SDXL text-to-image, not image-to-image"),
])
def test_bad_image_inputs_are_one_line_before_loading(args, message, files, tmp_path, capsys, no_loading):
    from demo.cli.generate import main

    for model in ("tiny", "tiny-inpaint", "tiny-xl", "tiny-xl-refiner"):  # generated before, not said in the run
        resolve_model(model)
    capsys.readouterr()
    names = {"NOWHERE": str(tmp_path / "missing.png"), "IMAGE": str(files["image"]), "MASK": str(files["mask"]),
             **{name.upper(): str(files[name]) for name in ("text", "wide", "big", "one", "folder", "truncated",
                                                            "huge")}}
    message = message.replace("NOWHERE", names["NOWHERE"]).replace("TEXT", names["TEXT"])
    out = tmp_path / "out"
    assert main(["a prompt", "--output-dir", str(out), *[names.get(arg, arg) for arg in args]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo-diffusion: error: ") and message in lines[0], lines
    assert not out.exists()


# ---- image files as diffusers' load_image takes them ---------------------------------------------------------

def test_image_files_are_read_upright_in_rgb_with_16_bit_scaled(tmp_path):
    """A phone's portrait photo is stored sideways with an EXIF orientation: it is turned upright (diffusers'
    load_image does too). Palette, RGBA and grayscale files become RGB; 16-bit grayscale is scaled to 8 bits (PIL's
    own conversion would clip it to white)."""
    from demo.request import load_image

    pixels = np.zeros((8, 16, 3), np.uint8)
    pixels[:, :8] = (255, 0, 0)  # stored: red left, blue right
    pixels[:, 8:] = (0, 0, 255)
    photo = Image.fromarray(pixels)
    exif = photo.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    photo.save(tmp_path / "portrait.png", exif=exif)
    upright = np.asarray(load_image("image", str(tmp_path / "portrait.png")))
    assert upright.shape == (16, 8, 3)
    assert (upright[:8] == (255, 0, 0)).all() and (upright[8:] == (0, 0, 255)).all()  # red on top after turning

    gray = np.arange(256, dtype=np.uint16).reshape(16, 16) * 257  # 0..65535 in even steps
    Image.fromarray(gray).save(tmp_path / "gray16.png")
    scaled = np.asarray(load_image("image", str(tmp_path / "gray16.png")))
    assert scaled.shape == (16, 16, 3) and (scaled[..., 0] == np.arange(256).reshape(16, 16)).all()

    colour = random_image(8, 8)
    for name, image in (("palette", colour.convert("P")), ("rgba", colour.convert("RGBA")),
                        ("gray", colour.convert("L"))):
        image.save(tmp_path / f"{name}.png")
        loaded = load_image("image", str(tmp_path / f"{name}.png"))
        assert loaded.mode == "RGB" and loaded.size == (8, 8)
        assert (np.asarray(loaded) == np.asarray(image.convert("RGB"))).all()
    assert load_image("mask", str(tmp_path / "rgba.png"), "L").mode == "L"


def test_a_portrait_photo_and_the_mask_drawn_on_it_as_displayed_inpaint_upright(tmp_path, capsys):
    """The photo is stored 48x32 (landscape) with EXIF orientation 6; the mask is drawn on it as displayed, 32x48.
    Unturned, the mask would be refused for its proportions, and the image drawn sideways."""
    from demo.cli.generate import main

    stored = random_image(32, 48)
    exif = stored.getexif()
    exif[0x0112] = 6
    stored.save(tmp_path / "photo.png", exif=exif)
    a_mask(48, 32).save(tmp_path / "mask.png")
    out = tmp_path / "out"
    assert main(["a castle", "--model", "tiny-inpaint", "--input-image", str(tmp_path / "photo.png"), "--mask-image",
                 str(tmp_path / "mask.png"), "--output-dir", str(out), "--denoising-steps", "2", "--seed", "1",
                 "--num-warmup-runs", "0"]) == 0, capsys.readouterr().err
    report = json.loads(next(out.glob("*.json")).read_text())
    assert (report["width"], report["height"]) == (32, 48)
    assert Image.open(out / report["images"][0]).size == (32, 48)


@pytest.mark.parametrize("fill", [0, 255], ids=["all black: keeps the image", "all white: re-draws all of it"])
def test_masks_of_one_colour_are_valid(fill, files, tmp_path):
    """As in diffusers: an all-black mask repaints nothing, an all-white one everything; neither is an error."""
    from demo.cli.generate import main

    Image.new("L", (WIDTH, HEIGHT), fill).save(tmp_path / "mask.png")
    out = tmp_path / "out"
    assert main(["a castle", "--model", "tiny-inpaint", "--input-image", str(files["image"]), "--mask-image",
                 str(tmp_path / "mask.png"), "--output-dir", str(out), "--denoising-steps", "2", "--seed", "1",
                 "--num-warmup-runs", "0"]) == 0
    assert len(list(out.glob("*.png"))) == 1
