"""ControlNets of SD3 and Flux.1 (models.flow_controlnet, demo.pipelines.flow_controlnet) on the CPU: same seed, same
image as diffusers' StableDiffusion3ControlNetPipeline, FluxControlNetPipeline and FluxControlNetImg2ImgPipeline
within 2/255, on the tiny built-ins with tiny ControlNets written here (one and two, a guidance window, scales, one
as SD3.5 Large's: no text, the transformer's position embedding); each ControlNet of its family by its own config, and
what cannot run refused in one line: another family's ControlNet, guess mode, SD3's image-to-image, ControlNets of
different depths together, the kinds not supported yet, and TensorRT's backends where the family's ControlNet engines
are not built."""


import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import UsageError
from demo.request import IMAGE_TO_IMAGE, TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline, plan_pipeline
from demo.runtime.spec import PipelineSpec
from models.controlnet import resolve_controlnet
from models.families import FLUX, SD3
from models.source import resolve_model

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731
SIZES = {"tiny-sd3": 64, "tiny-flux": 128}  # the least each takes


def write_controlnet(folder, cls, seed: int, **config) -> str:
    """A ControlNet of random weights (seed `seed`), its zero-initialised layers (what it adds, and how it takes the
    control image's latents) drawn at random too, so that it steers the picture."""
    torch.manual_seed(seed)
    net = cls(**config)
    for name, parameter in net.named_parameters():
        if name.startswith(("controlnet_", "pos_embed_input")):
            torch.nn.init.normal_(parameter, std=0.3 / parameter.shape[-1] ** 0.5)
    net.save_pretrained(folder)
    return str(folder)


def sd3_controlnet(folder, seed: int, **config) -> str:
    """An SD3ControlNetModel for tiny-sd3's transformer (its widths, latents and patches), of one block."""
    widths = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=1, attention_head_dim=8,
                  num_attention_heads=4, joint_attention_dim=96, caption_projection_dim=32, pooled_projection_dim=64,
                  pos_embed_max_size=32)
    return write_controlnet(folder, diffusers.SD3ControlNetModel, seed, **{**widths, **config})


def flux_controlnet(folder, seed: int, **config) -> str:
    """A FluxControlNetModel for tiny-flux's transformer, of one double-stream block and one single-stream."""
    widths = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                  axes_dims_rope=[2, 2, 4])
    return write_controlnet(folder, diffusers.FluxControlNetModel, seed, **{**widths, **config})


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """name -> ControlNet folder: two of SD3 zeroing their pooled projections (diffusers' default); one as SD3.5
    Large's (no text, the transformer's position embedding, its latents shifted), one more of two blocks; two of
    Flux (the second without single-stream blocks)."""
    root = tmp_path_factory.mktemp("flow-controlnets")
    return {
        "sd3-a": sd3_controlnet(root / "sd3-a", 1),
        "sd3-b": sd3_controlnet(root / "sd3-b", 2),
        "sd3-large": sd3_controlnet(root / "sd3-large", 3, joint_attention_dim=None, use_pos_embed=False,
                                    force_zeros_for_pooled_projection=False),
        "sd3-deep": sd3_controlnet(root / "sd3-deep", 4, num_layers=2),
        "flux-a": flux_controlnet(root / "flux-a", 5),
        "flux-b": flux_controlnet(root / "flux-b", 6, num_single_layers=0),
    }


def picture(seed: int, size: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def request_for(model: str, controls: int, **fields) -> Request:
    size = SIZES[model]
    controls = tuple(picture(11 + index, size) for index in range(controls))
    common = dict(denoising_steps=4, seed=5, control_images=controls)
    if "image" in fields:
        fields["image"] = picture(7, size)
    else:
        common.update(height=size, width=size)
    return Request("a red circle", **{**common, **fields})


def ours(model: str, controlnets, request: Request) -> np.ndarray:
    spec = PipelineSpec(model=model, backend="torch", precision="fp32", controlnets=tuple(controlnets),
                        modes=(request.mode,))
    with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
        return pipeline(request).pixels


def theirs(model: str, controlnets, request: Request, monkeypatch) -> np.ndarray:
    """diffusers' ControlNet pipeline for the model's family and the request's mode, with a Multi model for
    several."""
    source = resolve_model(model)
    resolved = request.resolved(source)
    cls = getattr(diffusers, source.family.controlnet_class)
    nets = [cls.from_pretrained(path) for path, _ in controlnets]
    scales = [scale for _, scale in controlnets]
    reference = getattr(diffusers, source.family.diffusers_pipeline(request.mode, controlled=True))
    pipe = reference.from_pretrained(source.path, controlnet=nets if len(nets) > 1 else nets[0])
    pipe.set_progress_bar_config(disable=True)
    if source.family is SD3:  # its pipeline samples the latents from torch's global generator, which no seed sets
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mode())
    controls = list(request.control_images) if len(nets) > 1 else request.control_images[0]
    inputs = dict(control_image=controls, height=resolved.height, width=resolved.width)
    if request.mode == IMAGE_TO_IMAGE:
        inputs.update(image=request.image, strength=resolved.strength)
    if resolved.guided:
        inputs["negative_prompt"] = resolved.negative_prompts
    images = pipe(resolved.prompts, num_inference_steps=resolved.denoising_steps,
                  guidance_scale=resolved.guidance_scale, generator=torch.Generator().manual_seed(resolved.seed),
                  output_type="np",
                  controlnet_conditioning_scale=scales if len(nets) > 1 else scales[0],
                  control_guidance_start=resolved.control_guidance_start,
                  control_guidance_end=resolved.control_guidance_end, **inputs).images
    return (images * 255).round().astype(np.uint8)


CASES = [  # model, ControlNets and scales, request fields, whether to check that they steer (once a family)
    ("tiny-sd3", [("sd3-a", 0.8)], dict(guidance_scale=5.0, negative_prompt="blurry", denoising_steps=3), False),
    ("tiny-sd3", [("sd3-a", 0.6), ("sd3-b", 1.1)], dict(guidance_scale=4.0, control_guidance_start=0.25,
                                                        control_guidance_end=0.75), True),
    ("tiny-sd3", [("sd3-large", 1.2)], dict(guidance_scale=1.0, batch_size=2, denoising_steps=2), False),
    ("tiny-flux", [("flux-a", 0.8)], dict(guidance_scale=3.5, batch_size=2, denoising_steps=2), False),
    ("tiny-flux", [("flux-a", 0.7), ("flux-b", 1.3)], dict(guidance_scale=4.0, control_guidance_end=0.5), True),
    ("tiny-flux", [("flux-a", 1.0)], dict(image=True, strength=0.8, guidance_scale=3.5, denoising_steps=3), False),
]


@pytest.mark.parametrize("model, controlnets, fields, steers", CASES)
def test_same_seed_same_image_as_diffusers_controlnet_pipelines(nets, model, controlnets, fields, steers,
                                                                monkeypatch):
    controlnets = [(nets[name], scale) for name, scale in controlnets]
    request = request_for(model, len(controlnets), **fields)
    mine = ours(model, controlnets, request)
    assert mine.std() > 5
    assert np.abs(mine.astype(int) - theirs(model, controlnets, request, monkeypatch).astype(int)).max() <= 2
    if steers:
        without = ours(model, [(path, 0.0) for path, _ in controlnets], request)
        assert np.abs(mine.astype(int) - without.astype(int)).max() > 2  # the ControlNets steer the picture


def test_each_controlnet_is_of_its_family_by_its_own_config(nets):
    assert resolve_controlnet(nets["sd3-a"]).family is SD3 and resolve_controlnet(nets["flux-a"]).family is FLUX
    assert resolve_controlnet("tiny-controlnet").family.name == "sd"


def plan(model: str, controlnets, request: Request | None = None, **spec_fields):
    spec = PipelineSpec(model=model, backend=spec_fields.pop("backend", "torch"), precision="fp32",
                        controlnets=tuple(controlnets), **spec_fields)
    return plan_pipeline(spec, CPU, request=request, progress=QUIET)


@pytest.mark.parametrize("model, net, message", [
    ("tiny-sd3", "tiny-controlnet", "is a ControlNet of SD 1.x/2.x models; model 'tiny-sd3' is of the SD3 family"),
    ("tiny-sd3", "flux-a", "is a ControlNet of Flux.1 models; model 'tiny-sd3' is of the SD3 family"),
    ("tiny-flux", "sd3-a", "is a ControlNet of SD3 models; model 'tiny-flux' is of the Flux.1 family"),
    ("tiny", "sd3-a", "is a ControlNet of SD3 models; model 'tiny' is of the SD 1.x/2.x family"),
])
def test_a_controlnet_of_another_family_is_refused_in_one_line(nets, model, net, message):
    with pytest.raises(UsageError) as raised:
        plan(model, [(nets.get(net, net), 1.0)])
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_what_their_pipelines_lack_is_refused_in_one_line(nets, tmp_path):
    sd3 = [(nets["sd3-a"], 1.0)]
    refusals = [
        (lambda: plan("tiny-sd3", sd3, request_for("tiny-sd3", 1, guess_mode=True)),
         "guess_mode: model 'tiny-sd3' is of the SD3 family, which does not support guess mode"),
        (lambda: plan("tiny-sd3", sd3, request_for("tiny-sd3", 1, image=True, strength=0.5)),
         "controlnets: model 'tiny-sd3' is of the SD3 family, whose image-to-image takes no ControlNets"),
        (lambda: plan("tiny-sd3", sd3, modes=(TEXT_TO_IMAGE, IMAGE_TO_IMAGE)), "whose image-to-image takes no"),
        (lambda: plan("tiny-sd3", [*sd3, (nets["sd3-deep"], 1.0)]),
         "has 2 blocks, " + nets["sd3-a"] + " 1 blocks: ControlNets that steer one transformer together"),
        (lambda: plan("tiny-flux", [(nets["flux-b"], 1.0), (nets["flux-a"], 1.0)]),
         "has 1 and 1 single-stream blocks, " + nets["flux-b"] + " 1 and 0 single-stream blocks"),
        (lambda: plan("tiny-flux", [(flux_controlnet(tmp_path / "union", 0, num_mode=3), 1.0)]),
         "is a union ControlNet (num_mode), which needs a control mode per image: not supported yet"),
        (lambda: plan("tiny-sd3", [(sd3_controlnet(tmp_path / "inpaint", 0, extra_conditioning_channels=1), 1.0)]),
         "takes extra conditioning channels (an inpainting ControlNet): not supported yet"),
        (lambda: plan("tiny-sd3", [(sd3_controlnet(tmp_path / "wide", 0, num_attention_heads=2), 1.0)]),
         "is made for another transformer than model 'tiny-sd3''s: num_attention_heads 2 (the transformer's 4)"),
    ]
    for refused, message in refusals:
        with pytest.raises(UsageError) as raised:
            refused()
        assert message in str(raised.value) and "\n" not in str(raised.value), (message, str(raised.value))
    assert plan("tiny-sd3", sd3).modes == (TEXT_TO_IMAGE,)  # image-to-image left out where the spec names no mode
    assert plan("tiny-flux", [(nets["flux-a"], 1.0)]).modes == (TEXT_TO_IMAGE, IMAGE_TO_IMAGE)


def test_tensorrt_refuses_controlnets_where_the_family_has_no_controlnet_engines(nets, monkeypatch):
    """A family whose engines are built but not its ControlNets' (SD3's and Flux's):
    TensorRT is refused where named, passed over under auto, in one line naming what is missing."""
    from core.errors import field
    from demo.backends.registry import REGISTRY, select_backend, why_not_for

    tensorrt = REGISTRY["tensorrt"]
    for family in (SD3, FLUX):
        with_engines = family  # its engines are built, not its ControlNets'
        assert why_not_for(tensorrt, with_engines, "m") is None
        assert why_not_for(tensorrt, with_engines, "m", controlled=True) == (
            f"{field('controlnets')}: model 'm' is of the {family.label} family, whose TensorRT engines do not take "
            "ControlNets yet")
        monkeypatch.setattr(tensorrt, "why_cannot_run", lambda cc: None)
        monkeypatch.setattr(tensorrt, "version", lambda: "10.x")
        with pytest.raises(UsageError, match="backend tensorrt: controlnets: model 'm' is of the .* family, whose "
                                             "TensorRT engines do not take ControlNets yet; use backend torch"):
            select_backend("tensorrt", family=with_engines, model="m", controlled=True)
        assert select_backend("auto", family=with_engines, model="m", controlled=True)[0] is not tensorrt
        assert select_backend("auto", family=with_engines, model="m")[0] is tensorrt
    with pytest.raises(UsageError, match="whose TensorRT engines do not take ControlNets yet"):
        plan("tiny-sd3", [(nets["sd3-a"], 1.0)], backend="tensorrt")


def test_the_command_line_draws_with_an_sd3_controlnet_and_refuses_guess_mode_in_one_line(nets, tmp_path, capsys):
    from demo.cli.generate import main

    picture(3, 64).save(tmp_path / "control.png")
    common = ["a cat", "--model", "tiny-sd3", "--denoising-steps", "2", "--height", "64", "--width", "64",
              "--controlnet", f"{nets['sd3-a']}:0.9", "--control-image", str(tmp_path / "control.png")]
    assert main([*common, "--output-dir", str(tmp_path / "made")]) == 0
    assert len(list((tmp_path / "made").glob("*.png"))) == 1
    capsys.readouterr()
    assert main([*common, "--output-dir", str(tmp_path / "refused"), "--guess-mode"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--guess-mode: model 'tiny-sd3' is of the SD3 family" in lines[0], lines


def test_the_benchmarks_diffusers_contender_runs_the_family_controlnet_pipeline(nets, monkeypatch):
    """sd-benchmark's diffusers contender (bench.diffusers_pipeline) loads the family's ControlNet class and hands the
    control image over as SD3's pipeline takes it (control_image; no guess mode): our image."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from bench.diffusers_pipeline import DiffusersPipeline

    controlnets = ((nets["sd3-a"], 0.9),)
    request = request_for("tiny-sd3", 1, guidance_scale=5.0, denoising_steps=2).resolved(resolve_model("tiny-sd3"))
    contender = DiffusersPipeline(resolve_model("tiny-sd3"), controlnets, CPU, torch.float32, compile_mode=None)
    assert isinstance(contender.pipe, diffusers.StableDiffusion3ControlNetPipeline)
    monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mode())
    theirs = (contender(request) * 255).round().astype(np.uint8)
    assert np.abs(theirs.astype(int) - ours("tiny-sd3", controlnets, request).astype(int)).max() <= 2


@pytest.mark.parametrize("model, names", [("tiny-sd3", ["sd3-a", "sd3-large"]), ("tiny-flux", ["flux-a"])])
def test_the_stages_shapes_are_what_their_modules_make(nets, model, names):
    """Each ControlNet stage and the transformer taking their samples: their modules (and meta modules) on their
    sample inputs make outputs of the shapes the stage models say (what engines and the floor count would read)."""
    from models.stages import stage_models

    source = resolve_model(model)
    controlnets = [(resolve_controlnet(nets[name]), 1.0) for name in names[:1]]
    extra = [(resolve_controlnet(nets[name]), 1.0) for name in names[1:]]
    for steered in (controlnets, extra):
        if not steered:
            continue
        models = stage_models(source, (source.family.denoiser_stage,), controlnets=steered)
        assert [m.name for m in models] == [source.family.denoiser_stage, "controlnet0", "vae_encoder"]
        height = width = SIZES[model]
        for stage in models[:2]:
            inputs = stage.sample_inputs(2, height, width, generator=torch.Generator().manual_seed(0))
            assert set(inputs) == set(stage.input_names)
            with torch.inference_mode():
                outputs = stage.load_module().eval()(*(inputs[name] for name in stage.input_names))
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            expected = stage.output_shapes(2, height, width)
            assert [tuple(output.shape) for output in outputs] == [expected[name] for name in stage.output_names]
            assert stage.meta_module() is not None
