"""ControlNet (issue 42) on the CPU: every mode (text-to-image, image-to-image, inpainting) and family (SD 1.x/2.x,
SDXL) against diffusers' own ControlNet pipelines, same seed, same image within 2/255; several ControlNets (diffusers'
MultiControlNetModel) with a guidance window; guess mode; with the step cache (diffusers' pipelines on a UNet cached
from its own modules, tests.parity.reference_unet); and each bad input as one line."""

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import UsageError
from demo.request import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline
from demo.runtime.spec import PipelineSpec
from models.controlnet import resolve_controlnet
from models.source import resolve_model

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731


def picture(seed: int, size: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def mask(size: int = 64) -> Image.Image:
    pixels = np.zeros((size, size), dtype=np.uint8)
    pixels[size // 4: size * 3 // 4, size // 3:] = 255
    return Image.fromarray(pixels)


def request_for(mode: str, controls: tuple, **fields) -> Request:
    common = dict(denoising_steps=6, seed=5, guidance_scale=5.0, scheduler="DDIM", control_images=controls, **fields)
    if mode == IMAGE_TO_IMAGE:
        return Request("a blue square", image=picture(7), strength=0.8, **common)
    if mode == INPAINTING:
        return Request("a blue square", image=picture(7), mask=mask(), **common)
    return Request("a red circle", height=64, width=64, **common)


def ours(model: str, controlnets, request: Request, **spec_fields) -> np.ndarray:
    spec = PipelineSpec(model=model, backend="torch", precision="fp32", controlnets=tuple(controlnets),
                        modes=(request.mode,), **spec_fields)
    with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
        return pipeline(request).pixels


def theirs(model: str, controlnets, request: Request, **components) -> np.ndarray:
    """diffusers' ControlNet pipeline for the request's mode, with `components` in place of its own."""
    source = resolve_model(model)
    nets = [diffusers.ControlNetModel.from_pretrained(resolve_controlnet(name).path) for name, _ in controlnets]
    scales = [scale for _, scale in controlnets]
    reference = getattr(diffusers, source.family.diffusers_pipeline(request.mode, controlled=True))
    extra = dict(source.family.diffusers_options)
    pipe = reference.from_pretrained(source.path, controlnet=nets if len(nets) > 1 else nets[0], **extra,
                                     **components)
    pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    controls = list(request.control_images) if len(nets) > 1 else request.control_images[0]
    inputs = dict(image=controls, height=64, width=64)
    if request.mode != TEXT_TO_IMAGE:
        inputs = dict(image=request.image, control_image=controls, strength=request.strength or 1.0, height=64,
                      width=64)
        if request.mode == INPAINTING:
            inputs["mask_image"] = request.mask
    images = pipe(request.prompt, num_inference_steps=request.denoising_steps, guidance_scale=request.guidance_scale,
                  generator=torch.Generator().manual_seed(request.seed), output_type="np",
                  controlnet_conditioning_scale=scales if len(nets) > 1 else scales[0],
                  control_guidance_start=request.control_guidance_start,
                  control_guidance_end=request.control_guidance_end, guess_mode=request.guess_mode, **inputs).images
    return (images * 255).round().astype(np.uint8)


CASES = [  # model, ControlNets and scales, mode, request fields
    ("tiny", [("tiny-controlnet", 0.8)], TEXT_TO_IMAGE, {}),
    ("tiny", [("tiny-controlnet", 1.0)], IMAGE_TO_IMAGE, {}),
    ("tiny", [("tiny-controlnet", 1.2)], INPAINTING, {}),
    ("tiny-xl", [("tiny-xl-controlnet", 0.9)], TEXT_TO_IMAGE, {}),
    ("tiny-xl", [("tiny-xl-controlnet", 1.0)], IMAGE_TO_IMAGE, {}),
    ("tiny-xl", [("tiny-xl-controlnet", 0.7)], INPAINTING, {}),
    ("tiny", [("tiny-controlnet", 0.6), ("tiny-controlnet", 1.1)], TEXT_TO_IMAGE,
     dict(control_guidance_start=0.2, control_guidance_end=0.7)),
    ("tiny", [("tiny-controlnet", 1.0)], TEXT_TO_IMAGE, dict(guess_mode=True)),
    ("tiny-xl", [("tiny-xl-controlnet", 1.0)], TEXT_TO_IMAGE, dict(guess_mode=True, control_guidance_end=0.5)),
]


@pytest.mark.parametrize("model, controlnets, mode, fields", CASES)
def test_same_seed_same_image_as_diffusers_controlnet_pipelines(model, controlnets, mode, fields):
    controls = tuple(picture(11 + index) for index in range(len(controlnets)))
    request = request_for(mode, controls, **fields)
    mine = ours(model, controlnets, request)
    assert np.abs(mine.astype(int) - theirs(model, controlnets, request).astype(int)).max() <= 2
    without = ours(model, [(name, 0.0) for name, _ in controlnets], request)
    assert np.abs(mine.astype(int) - without.astype(int)).max() > 2  # the ControlNets steer the picture


@pytest.mark.parametrize("model, controlnet", [("tiny", "tiny-controlnet"), ("tiny-xl", "tiny-xl-controlnet")])
def test_cached_passes_with_a_controlnet_are_the_controlled_unet(model, controlnet):
    """At every branch: the full pass with the ControlNet's residuals is the controlled UNet bit for bit; the
    ControlNet's shallow pass gives its first residuals bit for bit; the UNet's shallow pass on them, from the full
    pass's own features, gives the prediction again."""
    from models.controlnet import ControlNetStageModel, ShallowControlNetStageModel
    from models.unet import UNetModel, UNetShallowModel
    from models.unet_cache import Branches

    source, net = resolve_model(model), resolve_controlnet(controlnet)
    full_net = ControlNetStageModel(source, net, 0)
    net_module = full_net.load_module().eval()
    plain = UNetModel(source, controlled=True)
    unet = plain.load_module().eval()
    inputs = full_net.sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        residuals = dict(zip(full_net.output_names, net_module(*(inputs[name] for name in full_net.input_names))))
        feed = {**inputs, **residuals}
        expected = unet(*(feed[name] for name in plain.input_names))
        for branch in range(Branches.of(source.config("unet")).count):
            full, shallow = UNetModel(source, branch, controlled=True), UNetShallowModel(source, branch, True)
            prediction, features = full.wrap(unet.unet)(*(feed[name] for name in full.input_names))
            assert torch.equal(prediction, expected), branch
            shallow_net = ShallowControlNetStageModel(source, net, 0, branch)
            mine = shallow_net.wrap(net_module.controlnet)(*(inputs[name] for name in shallow_net.input_names))
            assert len(mine) == branch + 1 and all(torch.equal(a, residuals[name]) for a, name in
                                                   zip(mine, shallow_net.output_names)), branch
            shallow_feed = {**feed, **dict(zip(shallow_net.output_names, mine)), "deep_features": features}
            again = shallow.wrap(unet.unet)(*(shallow_feed[name] for name in shallow.input_names))
            assert torch.equal(again, expected), branch
            assert "mid_residual" not in shallow.input_names and ("timestep" in shallow_net.input_names) == (branch > 0)


def test_the_cached_controlled_passes_compile_to_one_graph_each():
    """torch.compile traces the ControlNet's shallow pass and the controlled UNet's two passes whole: no graph break,
    the same outputs."""
    from models.controlnet import ShallowControlNetStageModel
    from models.unet import UNetModel, UNetShallowModel

    source, net = resolve_model("tiny-xl"), resolve_controlnet("tiny-xl-controlnet")
    stages = [UNetModel(source, 4, controlled=True), UNetShallowModel(source, 4, controlled=True),
              ShallowControlNetStageModel(source, net, 0, 4)]
    feed = {name: value for stage in stages
            for name, value in stage.sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(2)).items()}
    unet, controlnet = stages[0].load_module().eval(), stages[2].load_module().eval()
    feed["deep_features"] = unet(*(feed[name] for name in stages[0].input_names))[1]
    for stage, module in zip(stages, (unet, stages[1].wrap(unet.unet), controlnet)):
        args = [feed[name] for name in stage.input_names]
        with torch.no_grad():
            compiled = torch.compile(module, backend="eager", dynamic=False, fullgraph=True)
            expected, again = module(*args), compiled(*args)
        expected, again = (x if isinstance(x, tuple) else (x,) for x in (expected, again))
        assert all(torch.equal(a, b) for a, b in zip(expected, again, strict=True)), stage.name


CACHED = [  # model, ControlNets and scales, mode, request fields, interval, branch
    ("tiny", [("tiny-controlnet", 0.8)], TEXT_TO_IMAGE, {}, 3, 0),
    ("tiny", [("tiny-controlnet", 1.2)], INPAINTING, {}, 2, 2),
    ("tiny", [("tiny-controlnet", 0.6), ("tiny-controlnet", 1.1)], TEXT_TO_IMAGE,
     dict(control_guidance_start=0.2, control_guidance_end=0.7), 3, 1),
    ("tiny-xl", [("tiny-xl-controlnet", 1.0)], IMAGE_TO_IMAGE, {}, 2, 3),
    ("tiny-xl", [("tiny-xl-controlnet", 1.0)], TEXT_TO_IMAGE, dict(guess_mode=True), 3, 1),
]


@pytest.mark.parametrize("model, controlnets, mode, fields, interval, branch", CACHED)
def test_a_cached_run_with_controlnets_equals_diffusers_with_a_reference_cache(model, controlnets, mode, fields,
                                                                                interval, branch):
    """The step cache with ControlNets: diffusers' ControlNet pipeline, its UNet cached from its own modules (every
    residual goes in at every call; a cached call keeps the deep part's output), draws our cached picture."""
    from tests.parity import reference_unet

    controls = tuple(picture(11 + index) for index in range(len(controlnets)))
    request = request_for(mode, controls, **fields)
    mine = ours(model, controlnets, request, cache_interval=interval, cache_branch=branch)
    reference = theirs(model, controlnets, request, unet=reference_unet(resolve_model(model), interval, branch))
    assert np.abs(mine.astype(int) - reference.astype(int)).max() <= 2
    assert np.abs(mine.astype(int) - ours(model, controlnets, request).astype(int)).max() > 2  # the cache is on


def test_the_conditioning_image_is_embedded_once_per_call_and_a_bgr_controlnet_matches_diffusers(tmp_path):
    """The embedding stage runs once a call, the ControlNet's every step. A ControlNet whose config says its images
    are BGR (diffusers flips them inside the ControlNet) gets them flipped once, before the embedding, and its
    per-step stage flips nothing more: the same picture as diffusers'."""
    import json
    import shutil

    from models.controlnet import ControlNetImageModel, ControlNetStageModel

    folder = tmp_path / "bgr"
    shutil.copytree(resolve_controlnet("tiny-controlnet").path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "controlnet_conditioning_channel_order": "bgr"}))
    request = request_for(TEXT_TO_IMAGE, (picture(11),))
    calls = {}

    class Counted:  # the stage, its calls counted
        def __init__(self, name, stage):
            self.name, self.stage = name, stage

        def __call__(self, feed):
            calls[self.name] = calls.get(self.name, 0) + 1
            return self.stage(feed)

        def __getattr__(self, attribute):
            return getattr(self.stage, attribute)

    spec = PipelineSpec(model="tiny", backend="torch", precision="fp32", controlnets=((str(folder), 0.9),),
                        modes=(TEXT_TO_IMAGE,))
    with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
        pipeline.stages.update({name: Counted(name, pipeline.stages[name])
                                for name in ("controlnet0", "controlnet0_image")})
        mine = pipeline(request).pixels
    assert calls == {"controlnet0_image": 1, "controlnet0": request.denoising_steps}
    assert np.abs(mine.astype(int) - theirs("tiny", [(str(folder), 0.9)], request).astype(int)).max() <= 2

    source = resolve_model("tiny")
    bgr, rgb = resolve_controlnet(str(folder)), resolve_controlnet("tiny-controlnet")
    image = ControlNetImageModel(source, rgb, 0).sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        embed_bgr, embed_rgb = (ControlNetImageModel(source, net, 0).load_module() for net in (bgr, rgb))
        flipped = embed_rgb(image["controlnet_cond"].flip(1))
        assert torch.allclose(embed_bgr(image["controlnet_cond"]), flipped)
        assert not torch.allclose(embed_rgb(image["controlnet_cond"]), flipped)
        feed = ControlNetStageModel(source, rgb, 0).sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(4))
        steps = [ControlNetStageModel(source, net, 0).load_module()(*feed.values()) for net in (bgr, rgb)]
        assert all(torch.equal(a, b) for a, b in zip(*steps))


def test_channels_last_hands_the_residuals_over_in_that_layout_and_draws_the_same_image():
    """In channels-last memory the ControlNet's residuals reach the UNet in that layout (no conversions between the
    two), while what the pipeline reads stays contiguous; the picture is the contiguous run's."""
    from demo.backends.torch.options import TorchOptions

    request = request_for(TEXT_TO_IMAGE, (picture(11),))
    images = {}
    for channels_last in (False, True):
        spec = PipelineSpec(model="tiny", backend="torch", precision="fp32", controlnets=(("tiny-controlnet", 0.8),),
                            modes=(TEXT_TO_IMAGE,), torch=TorchOptions(channels_last=channels_last))
        with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
            images[channels_last] = pipeline(request).pixels
            controlnet, unet = pipeline.stages["controlnet0"], pipeline.stages["unet"]
            feed = controlnet.model.sample_inputs(2, 64, 64)
            residuals = controlnet(feed)
            noise = unet({**{name: feed[name] for name in ("sample", "timestep", "encoder_hidden_states")},
                          **residuals})
    assert all(value.is_contiguous(memory_format=torch.channels_last) and not value.is_contiguous()
               for value in residuals.values() if value.shape[-1] > 1)
    assert all(value.is_contiguous() for value in noise.values())
    assert np.abs(images[True].astype(int) - images[False].astype(int)).max() <= 1


@pytest.mark.parametrize("spec_fields, request_fields, message", [
    (dict(controlnets=(("tiny-controlnet", 1.0),)), {}, "control_images: 0 given; this pipeline has 1 ControlNet(s)"),
    (dict(controlnets=(("tiny-controlnet", 1.0),)), dict(control_images=(picture(1), picture(2))),
     "control_images: 2 given"),
    ({}, dict(control_images=(picture(1),)), "control_images: 1 given; this pipeline has 0 ControlNet(s): load it "
                                             "with controlnets"),
    (dict(controlnets=(("tiny-xl-controlnet", 1.0),)), dict(control_images=(picture(1),)),
     "controlnets tiny-xl-controlnet is a ControlNet of SDXL models; model 'tiny' is of the SD 1.x/2.x family"),
    (dict(controlnets=(("no/such/folder", 1.0),)), dict(control_images=(picture(1),)),
     "controlnets no/such/folder: no such ControlNet"),
    (dict(controlnets=(("tiny-controlnet", float("nan")),)), dict(control_images=(picture(1),)),
     "the scale must be a finite number, got nan"),
    (dict(controlnets=(("tiny-controlnet", 1.0),)), dict(control_images=(picture(1),), control_guidance_start=0.5,
                                                          control_guidance_end=0.5),
     "must be 0 <= start < end <= 1, got 0.5 and 0.5"),
])
def test_bad_controlnet_input_is_one_line(spec_fields, request_fields, message):
    from demo.runtime.loader import plan_pipeline

    spec = PipelineSpec(model="tiny", backend="torch", **spec_fields)
    with pytest.raises(UsageError) as raised:
        request = Request("a red circle", **request_fields)
        request.check_inputs()
        plan_pipeline(spec, CPU, request=request, progress=QUIET)
    assert message in raised.value.render()


def controlnet_like_tiny(folder, **changes):
    """A whole ControlNet folder (its weights made for its config) of tiny-controlnet's config with `changes`."""
    from diffusers import ControlNetModel

    ControlNetModel.from_config({**resolve_controlnet("tiny-controlnet").config, **changes}).save_pretrained(folder)
    return folder


def test_a_controlnet_for_another_text_width_is_refused(tmp_path):
    folder = controlnet_like_tiny(tmp_path / "wide", cross_attention_dim=48)
    with pytest.raises(UsageError) as raised:
        resolve_controlnet(str(folder)).check_for(resolve_model("tiny"))
    assert "attends to text 48 wide; model 'tiny' has 32" in raised.value.render()


def test_the_step_cache_refuses_a_controlnet_whose_time_embedding_it_cannot_make(tmp_path):
    from demo.runtime.loader import plan_pipeline

    folder = controlnet_like_tiny(tmp_path / "text-embedding", addition_embed_type="text")
    spec = PipelineSpec(model="tiny", backend="torch", controlnets=((str(folder), 1.0),), cache_interval=2)
    with pytest.raises(UsageError) as raised:
        plan_pipeline(spec, CPU, progress=QUIET)
    assert "the step cache does not take a ControlNet with 'text' added embeddings" in raised.value.render()


def test_the_command_line_draws_with_a_controlnet_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    from demo.cli.generate import main

    control = tmp_path / "control.png"
    picture(3).save(control)
    common = ["a red circle", "--model", "tiny", "--denoising-steps", "3", "--output-dir", str(tmp_path / "out")]
    assert main([*common, "--controlnet", "tiny-controlnet:0.5", "--control-image", str(control), "--seed", "1"]) == 0
    assert len(list((tmp_path / "out").glob("*.png"))) == 1
    capsys.readouterr()
    for args, message in ((["--controlnet", "tiny-controlnet"], "--control-image: 0 given"),
                          (["--controlnet", "tiny-controlnet", "--control-image", str(tmp_path / "none.png")],
                           "--control-image " + str(tmp_path / "none.png") + ": no such file"),
                          (["--controlnet", f"{control}:x"], "--controlnet")):
        assert main([*common, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_engines_draw_the_torch_image_and_a_lora_refits_the_unet_with_the_controlnet_in_place(tmp_path):
    """The ControlNet's engine and the UNet's with residual inputs (stand-in TensorRT, fp32): the torch pipeline's
    image; the shipped-style LoRA refits the UNet engine (the ControlNet's stays), and the image follows the torch
    pipeline with the LoRA fused."""
    from tests.fake_tensorrt import stand_in_pipeline
    from tests.test_lora_refit import loras_for

    source = resolve_model("tiny")
    loras = loras_for(source, tmp_path)
    request = request_for(TEXT_TO_IMAGE, (picture(11),))
    fields = dict(model="tiny", precision="fp32", controlnets=(("tiny-controlnet", 0.8),), modes=(TEXT_TO_IMAGE,))
    with stand_in_pipeline(tmp_path, dict(build_enable_refit=True), **fields) as pipeline:
        plain = pipeline(request).pixels
        pipeline.set_loras(loras)
        refits = {name: len(getattr(stage.engine.engine, "refits", ())) for name, stage in pipeline.stages.items()}
        with_lora = pipeline(request).pixels
    with load_pipeline(PipelineSpec(backend="torch", **fields), CPU, progress=QUIET) as pipeline:
        torch_plain = pipeline(request).pixels
        pipeline.set_loras(loras)
        torch_lora = pipeline(request).pixels
    assert sorted(p.name for p in (tmp_path / "engine").glob("*.engine"))[-2:] == ["unet.controlled.engine",
                                                                                 "vae.engine"]
    assert refits["unet"] == 1 and refits["controlnet0"] == 0
    assert np.abs(plain.astype(int) - torch_plain.astype(int)).max() <= 1
    assert np.abs(with_lora.astype(int) - torch_lora.astype(int)).max() <= 1
    assert np.abs(with_lora.astype(int) - plain.astype(int)).max() > 2


def test_engines_with_the_step_cache_draw_the_torch_paths_cached_image(tmp_path):
    """Under the step cache, the ControlNet's shallow pass and the controlled UNet's two passes are engines of their
    own (stand-in TensorRT, fp32) beside the uncached ones' names: the torch path's cached picture."""
    from tests.fake_tensorrt import stand_in_pipeline

    request = request_for(TEXT_TO_IMAGE, (picture(11),))
    fields = dict(model="tiny", precision="fp32", controlnets=(("tiny-controlnet", 0.8),), modes=(TEXT_TO_IMAGE,),
                  cache_interval=3, cache_branch=1)
    with stand_in_pipeline(tmp_path, **fields) as pipeline:
        engines = pipeline(request).pixels
    with load_pipeline(PipelineSpec(backend="torch", **fields), CPU, progress=QUIET) as pipeline:
        torch_image = pipeline(request).pixels
    names = sorted(p.name for p in (tmp_path / "engine").glob("*.engine"))
    assert [name for name in names if name.startswith("unet")] == ["unet.controlled.cache1.engine",
                                                                   "unet_shallow.controlled.cache1.engine"]
    assert sum(name.startswith("controlnet-") and name.endswith(".cache1.engine") for name in names) == 1
    assert np.abs(engines.astype(int) - torch_image.astype(int)).max() <= 1


def test_sd_benchmark_times_a_controlnet_pipeline_apart_from_the_plain_one(tmp_path):
    """sd-benchmark --controlnet --control-image: every contender runs the ControlNet pipeline (the reference too, and
    diffusers' own pipeline: StableDiffusionControlNetPipeline, timed in the same regions); a plain run into the same
    folders keeps its rows and images apart (its own workload, its own reference image)."""
    import json

    from bench.benchmark import main

    control = tmp_path / "control.png"
    picture(4).save(control)
    common = ["--model", "tiny", "--height", "64", "--width", "64", "--denoising-steps", "2", "--warmup-runs", "0",
              "--runs", "1", "--seed", "0", "--scheduler", "DDIM", "--contenders",
              "diffusers-eager,ours-defaults,diffusers-pipeline,diffusers-pipeline-compile",
              "--results-dir", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work"),
              "--defaults-file", str(tmp_path / "defaults.json")]
    assert main([*common, "--controlnet", "tiny-controlnet:0.5", "--control-image", str(control)]) == 0
    assert main(common) == 0
    data = json.loads(next((tmp_path / "results").glob("*.json")).read_text())
    rows = data["rows"]
    steered = [row for row in rows if row.get("controlnets")]
    plain = [row for row in rows if not row.get("controlnets")]
    labels = ["diffusers-eager", "ours-defaults", "diffusers-pipeline"]
    assert [row["label"] for row in steered] == [row["label"] for row in plain] == labels
    assert steered[0]["workload"].startswith("tiny + tiny-controlnet x0.5, 64x64")
    assert plain[0]["workload"].startswith("tiny, 64x64")
    # the same modules on a CPU: the same picture, each compared with its own kind's reference; diffusers' own
    # pipelines draw it within 2/255 of ours
    assert steered[1]["max_pixel_diff_vs_eager"] <= 1 and plain[1]["max_pixel_diff_vs_eager"] <= 1
    assert steered[2]["max_pixel_diff_vs_eager"] <= 2 and plain[2]["max_pixel_diff_vs_eager"] <= 2
    for row in (steered[2], plain[2]):
        latency = row["latency_ms"]
        assert latency["pipeline"] > latency["unet"] > 0 and latency["clip"] > 0 and latency["vae"] > 0
        assert row["unet_calls"] == 2 and row["backend"] == "diffusers"
    assert steered[2]["denoiser_gflop_per_step"] == steered[0]["denoiser_gflop_per_step"]
    skipped = {entry["label"]: entry["reason"] for entry in data["skipped"]}
    assert "needs a CUDA GPU" in skipped["diffusers-pipeline-compile"]
    with_control, without = (np.asarray(Image.open(row["image"])).astype(int) for row in (steered[0], plain[0]))
    assert np.abs(with_control - without).max() > 2
    assert steered[0]["denoiser_gflop_per_step"] > plain[0]["denoiser_gflop_per_step"] > 0  # the ControlNet's calls


@pytest.mark.parametrize("cache", [[], ["--cache-interval", "3", "--cache-branch", "0"]], ids=["plain", "cached"])
def test_build_engines_builds_the_controlnet_and_the_controlled_unet_with_tensorrt_for_rtx(tmp_path, cache):
    """A real builder parses and builds every graph: with the step cache, the ControlNet's shallow pass from branch 0
    too (conv_in and a zero convolution: no time or text input)."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")
    from demo.cli.build_engines import main

    assert main(["--model", "tiny", "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine"),
                 "--optimization-level", "0", "--build-static-batch", "--stages", "unet",
                 "--controlnet", "tiny-controlnet", *cache]) == 0
    names = sorted(p.name for p in (tmp_path / "engine").glob("*.engine"))
    controlnet = names[0].split(".")[0]
    assert controlnet.startswith("controlnet-")
    if cache:
        assert names == [f"{controlnet}.cache0.engine", f"{controlnet}.engine", f"{controlnet}_image.engine",
                         "unet.controlled.cache0.engine", "unet_shallow.controlled.cache0.engine"]
    else:
        assert names == [f"{controlnet}.engine", f"{controlnet}_image.engine", "unet.controlled.engine"]
