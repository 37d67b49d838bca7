"""Few-step schedulers and their options (issue 57, item 1): LCM, TCD, trailing spacing, Karras sigmas, eta, explicit
timesteps and a one-step "sample" prediction draw diffusers' image (CPU, fp32, within 2/255: tests/parity.py), on
tiny folders written here; each option also moves the image, so a run that dropped it would fail its parity check;
what a scheduler does not take, or a value out of range, is one line."""

import json
import shutil

import numpy as np
import pytest
import torch

from core.errors import UsageError
from demo.request import Request
from demo.schedulers import SCHEDULERS, TAKES
from models.source import resolve_model
from tests.parity import CPU, check_parity, diffusers_images, torch_stages

PROMPT, NEGATIVE = "a red circle on a blue square", "blurry"


def with_scheduler(folder, **config) -> None:
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))


@pytest.fixture(scope="module")
def lightning(tiny, tmp_path_factory):
    """A one-step folder as SDXL-Lightning's 1-step UNet is published: Euler, trailing spacing, a UNet that predicts
    the sample itself."""
    folder = tmp_path_factory.mktemp("lightning") / "model"
    shutil.copytree(tiny.path, folder)
    with_scheduler(folder, _class_name="EulerDiscreteScheduler", timestep_spacing="trailing",
                   prediction_type="sample")
    return resolve_model(str(folder))


def ours_and_diffusers(source, stages, scheduler: str, **options) -> np.ndarray:
    request = Request(PROMPT, NEGATIVE, height=32, width=48, denoising_steps=4, guidance_scale=6.0, seed=2,
                      **options)
    return check_parity(source, stages, scheduler, request)


def moved(image: np.ndarray, other: np.ndarray) -> bool:
    """The images differ beyond the parity tolerance: dropping the option that tells them apart fails parity."""
    return np.abs(image.astype(int) - other.astype(int)).max() > 2


def test_a_folder_with_lcm_scheduler_renders_as_diffusers_latent_consistency_pipeline():
    """LatentConsistencyModelPipeline itself, on the `tiny-lcm` built-in (a folder as LCM's are published: the UNet
    embeds the guidance scale, LCMScheduler, LatentConsistencyModelPipeline in model_index.json): the scale embedded,
    one half, LCM's own step and noise."""
    from diffusers import LatentConsistencyModelPipeline

    from demo.pipelines import StageTimer, make_pipeline, to_uint8

    lcm = resolve_model("tiny-lcm")
    assert lcm.config("scheduler")["_class_name"] == "LCMScheduler"
    assert json.loads((lcm.path / "model_index.json").read_text())["_class_name"] == "LatentConsistencyModelPipeline"

    request = Request(PROMPT, height=32, width=48, denoising_steps=4, guidance_scale=8.5, seed=4).resolved(lcm)
    assert request.scheduler == "LCM" and not request.guided
    request.check(lcm)
    ours = to_uint8(make_pipeline(lcm, torch_stages(lcm), request.make_scheduler(lcm), CPU, torch.float32)(
        request, StageTimer(CPU)))
    ref = LatentConsistencyModelPipeline.from_pretrained(lcm.path, safety_checker=None,
                                                         requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    theirs = ref(PROMPT, height=32, width=48, num_inference_steps=4, guidance_scale=8.5, output_type="np",
                 generator=torch.Generator("cpu").manual_seed(4)).images
    theirs = (theirs * 255).round().astype(np.uint8)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2 and ours.std() > 5


def test_lcm_and_tcd_on_an_ordinary_model_as_diffusers(tiny, tiny_stages):
    """StableDiffusionPipeline with LCMScheduler / TCDScheduler (how LCM-LoRA and TCD-LoRA run): TCD's eta (its
    gamma) moves the image."""
    lcm = ours_and_diffusers(tiny, tiny_stages, "LCM")
    tcd = ours_and_diffusers(tiny, tiny_stages, "TCD", eta=0.3)
    assert moved(tcd, ours_and_diffusers(tiny, tiny_stages, "TCD"))
    assert moved(lcm, tcd)


@pytest.mark.parametrize("scheduler, options, dropped", [
    ("Euler", {"timestep_spacing": "trailing"}, {}),
    ("DDIM", {"timestep_spacing": "trailing", "eta": 0.5}, {"timestep_spacing": "trailing"}),
    ("DPM++2M", {"karras_sigmas": True}, {}),
    ("Euler", {"karras_sigmas": True}, {}),
    ("LMSD", {"karras_sigmas": True}, {}),
    ("Euler", {"timesteps": (999, 749, 499, 249)}, {}),
    ("LCM", {"timesteps": (979, 619, 339, 59)}, {}),
    ("DPM++2M", {"timesteps": (999, 666, 333)}, {}),
])
def test_each_option_draws_diffusers_image_and_moves_it(tiny, tiny_stages, scheduler, options, dropped):
    assert all(option in TAKES[scheduler] for option in options)
    with_option = ours_and_diffusers(tiny, tiny_stages, scheduler, **options)
    assert moved(with_option, ours_and_diffusers(tiny, tiny_stages, scheduler, **dropped))


def test_a_model_s_own_spacing_and_sample_prediction_are_honoured(lightning, tiny_stages):
    """One step that predicts the sample, trailing (from timestep 999): the folder's config alone says so."""
    scheduler = Request(PROMPT).resolved(lightning).make_scheduler(lightning)
    assert scheduler.config.prediction_type == "sample" and scheduler.config.timestep_spacing == "trailing"
    request = Request(PROMPT, height=32, width=48, denoising_steps=1, guidance_scale=1.0, seed=6)
    ours = check_parity(lightning, tiny_stages, "Euler", request)
    leading = check_parity(lightning, tiny_stages, "Euler", Request(**{**request.__dict__,
                                                                     "timestep_spacing": "leading"}))
    assert moved(ours, leading)


def test_lcm_image_to_image_as_diffusers(tiny, tiny_stages):
    from PIL import Image

    from demo.request import IMAGE_TO_IMAGE

    pixels = np.random.default_rng(3).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    request = Request(PROMPT, height=32, width=48, denoising_steps=4, guidance_scale=1.0, seed=1,
                      image=Image.fromarray(pixels), strength=0.6)
    assert request.mode == IMAGE_TO_IMAGE
    check_parity(tiny, torch_stages(tiny, ("clip", "unet", "vae", "vae_encoder")), "LCM", request)


def test_sdxl_with_lcm_and_karras_as_diffusers(tmp_path):
    xl = resolve_model("tiny-xl")
    stages = torch_stages(xl)
    request = Request(PROMPT, height=32, width=32, denoising_steps=3, guidance_scale=1.0, seed=3)
    check_parity(xl, stages, "LCM", request)
    check_parity(xl, stages, "DPM++2M", Request(**{**request.__dict__, "karras_sigmas": True,
                                                   "guidance_scale": 5.0}))


def test_a_loaded_pipeline_takes_the_options_per_call(tiny):
    """Through the Python API: each call's options make their own scheduler object (not the last call's)."""
    from demo import PipelineSpec, load_pipeline

    quiet = lambda *_: None  # noqa: E731
    with load_pipeline(PipelineSpec(model="tiny", backend="torch", plugins="none"), CPU, progress=quiet) as pipe:
        common = dict(seed=5, height=32, width=32, guidance_scale=6.0, output_type="np", scheduler="Euler")
        trailing = pipe(PROMPT, timesteps=None, timestep_spacing="trailing", denoising_steps=4, **common)
        explicit = pipe(PROMPT, timesteps=[999, 749, 499, 249], **common)
        again = pipe(PROMPT, timestep_spacing="trailing", denoising_steps=4, **common)
    assert explicit.report.steps == 4
    assert np.array_equal(trailing.images, again.images) and not np.array_equal(trailing.images, explicit.images)
    theirs = diffusers_images(resolve_model("tiny"), "Euler", Request(PROMPT, timesteps=(999, 749, 499, 249),
                                                                      **{k: v for k, v in common.items()
                                                                         if k not in ("output_type", "scheduler")}))
    assert np.abs((explicit.images * 255).round().astype(int) - theirs.astype(int)).max() <= 2


@pytest.mark.parametrize("options, message", [
    ({"scheduler": "PNDM", "eta": 0.3}, "eta: scheduler PNDM does not take it"),
    ({"scheduler": "DDIM", "karras_sigmas": True}, "karras_sigmas: scheduler DDIM does not take it"),
    ({"scheduler": "LCM", "timestep_spacing": "trailing"}, "timestep_spacing: scheduler LCM does not take it"),
    ({"scheduler": "EulerA", "timesteps": (999, 499)}, "timesteps: scheduler EulerA does not take it"),
    ({"scheduler": "TCD", "eta": 1.5}, "eta must be 0..1, got 1.5"),
    ({"scheduler": "TCD", "eta": float("nan")}, "eta must be 0..1"),
    ({"scheduler": "Euler", "timestep_spacing": "even"}, "timestep_spacing must be one of leading, linspace, trailing"),
    ({"scheduler": "Euler", "timesteps": (249, 499)}, "timesteps must run from the noisiest down"),
    ({"scheduler": "Euler", "timesteps": (999, 999)}, "timesteps must run from the noisiest down"),
    ({"scheduler": "Euler", "timesteps": (999, -1)}, "none below 0"),
    ({"scheduler": "Euler", "timesteps": ()}, "timesteps must name one timestep at least"),
    ({"scheduler": "Euler", "timesteps": (1000, 500)}, "timesteps 1000 is out of range: scheduler Euler has 1000"),
    ({"scheduler": "Euler", "timesteps": (999, 500), "denoising_steps": 7}, "denoising_steps 7 and timesteps (2 of"),
    ({"scheduler": "Euler", "timesteps": (999, 500), "karras_sigmas": True}, "timesteps: scheduler Euler refuses"),
])
def test_a_bad_option_is_one_line_naming_it(tiny, options, message):
    with pytest.raises(UsageError) as raised:
        request = Request(PROMPT, **options).resolved(tiny)
        request.check(tiny)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_every_scheduler_s_options_are_declared_for_it():
    """TAKES names every scheduler of ours, and only options its diffusers class reads (its config's spacing and
    Karras sigmas, its step's eta, its set_timesteps' timesteps)."""
    import inspect

    import diffusers

    assert set(TAKES) == set(SCHEDULERS)
    for name, options in TAKES.items():
        cls = getattr(diffusers, SCHEDULERS[name])
        reads = {"timestep_spacing": inspect.signature(cls.__init__).parameters,
                 "karras_sigmas": {"karras_sigmas": None} if "use_karras_sigmas" in
                 inspect.signature(cls.__init__).parameters else {},
                 "eta": inspect.signature(cls.step).parameters,
                 "timesteps": inspect.signature(cls.set_timesteps).parameters}
        for option in options:
            assert option in reads[option], (name, option)


@pytest.mark.parametrize("model", ["tiny", "tiny-xl"])
def test_lcm_with_a_lora_fused_as_diffusers_fuses_an_lcm_lora(model, tmp_path):
    """How an LCM-LoRA runs: LCMScheduler over a model with a LoRA fused in (diffusers: load_lora_weights +
    fuse_lora), SD 1.x and SDXL."""
    from tests.test_lora import SCALE, Model, assert_image_matches, load_and_fuse, reference, write_lora

    ours = Model(model, "LCM")
    lora = write_lora(tmp_path / "lcm-lora.safetensors", ours, "peft", seed=4)
    ours.pipeline.set_loras([(lora, SCALE)])
    assert_image_matches(ours, reference(ours, load_and_fuse(lora)))


def test_sd_serve_takes_the_options_as_inputs():
    """The server's inputs set the same fields (timesteps as one list per request), checked as the CLI checks them."""
    from demo.runtime.loader import plan_pipeline
    from demo.runtime.spec import PipelineSpec
    from demo.serve.schema import RequestRejected, parse_request

    plan = plan_pipeline(PipelineSpec(model="tiny", backend="torch", scheduler="Euler"), "cpu")
    data = {"prompt": np.array([[b"a castle"]], np.bytes_), "timestep_spacing": np.array([[b"trailing"]], np.bytes_),
            "karras_sigmas": np.array([[False]], np.bool_), "timesteps": np.array([[999, 499, 99]], np.int32)}
    request = parse_request(data, plan)
    assert (request.timestep_spacing, request.karras_sigmas, request.timesteps, request.denoising_steps) == (
        "trailing", False, (999, 499, 99), 3)
    with pytest.raises(RequestRejected, match=r"^eta: scheduler Euler does not take it"):
        parse_request({**data, "eta": np.array([[0.3]], np.float32)}, plan)
    with pytest.raises(RequestRejected, match=r"^timesteps: one list per request \(shape \[1, N\]\)"):
        parse_request({**data, "timesteps": np.array([[999], [499]], np.int32)}, plan)
