"""The step cache (issue 41; models.unet_cache, --cache-interval/--cache-branch), on the CPU.

- The full pass is the UNet's own output bit for bit and returns features of the shape the stages declare; a shallow
  pass from a full pass's own features gives the full output again (so only staleness changes an image).
- A cached run of our pipeline (text-to-image, image-to-image and inpainting; SD and SDXL) equals diffusers' own
  pipeline whose UNet is a reference cache written here from diffusers' modules alone: every call runs the whole UNet,
  and on the calls between full ones the module feeding the entry up layer gives what it gave at the last full call.
  The DeepCache package's helper (DeepCacheSDHelper) gives the same images where it is installed.
- Interval 1 is bit for bit the uncached pipeline; engines (the stand-in TensorRT) draw the torch path's cached
  image; a LoRA reaches both passes; bad values are one line.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import UsageError
from demo.backends.registry import REFERENCE
from demo.backends.torch.settings import FALLBACK
from demo.pipelines import StageTimer, make_pipeline, to_uint8
from demo.request import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE, Request
from demo.runtime.loader import load_pipeline
from demo.runtime.spec import PipelineSpec
from models import UNET_SHALLOW, image_to_image_stages, stage_models
from models.source import resolve_model
from models.step_cache import StepCache
from models.unet import UNetModel, UNetShallowModel
from models.unet_cache import Branches
from tests.fake_tensorrt import stand_in_pipeline
from tests.parity import diffusers_images, reference_unet

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731


@pytest.mark.parametrize("model", ["tiny", "tiny-xl", "shapes"])
def test_full_pass_is_the_unet_and_a_shallow_pass_from_fresh_features_is_too(model):
    source = resolve_model(model)
    plain = UNetModel(source)
    module = plain.load_module().eval()
    height = width = source.native_image_size
    inputs = plain.sample_inputs(2, height, width, generator=torch.Generator().manual_seed(3))
    args = [inputs[name] for name in plain.input_names]
    with torch.no_grad():
        expected = module(*args)
        for branch in range(Branches.of(source.config("unet")).count):
            full = UNetModel(source, branch)
            prediction, features = full.wrap(module.unet)(*args)
            assert torch.equal(prediction, expected), branch
            assert tuple(features.shape) == full.output_shapes(2, height, width)["deep_features"]
            shallow = UNetShallowModel(source, branch)
            assert tuple(features.shape) == shallow.input_shapes(2, height, width)["deep_features"]
            feed = dict(inputs, deep_features=features)
            shallow_args = [feed[name] for name in shallow.input_names]
            assert torch.equal(shallow.wrap(module.unet)(*shallow_args), expected), branch


@pytest.mark.parametrize("model", ["tiny", "tiny-xl"])
def test_both_passes_compile_to_one_graph_each(model):
    """torch.compile (the torch backend's compile modes) traces each pass whole: no graph break, the same outputs."""
    source = resolve_model(model)
    full, shallow = UNetModel(source, 3), UNetShallowModel(source, 3)
    module = full.load_module().eval()
    inputs = full.sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        prediction, features = module(*[inputs[name] for name in full.input_names])
        compiled = torch.compile(module, backend="eager", dynamic=False, fullgraph=True)
        again, kept = compiled(*[inputs[name] for name in full.input_names])
        feed = dict(inputs, deep_features=features)
        shallow_module = torch.compile(shallow.wrap(module.unet), backend="eager", dynamic=False, fullgraph=True)
        assert torch.equal(shallow_module(*[feed[name] for name in shallow.input_names]), prediction)
    assert torch.equal(again, prediction) and torch.equal(kept, features)


def our_images(source, request: Request, interval: int, branch: int, scheduler: str) -> np.ndarray:
    models = stage_models(source, image_to_image_stages(source), branch if interval > 1 else None)
    stages = REFERENCE.create_stages(models, lambda _: FALLBACK, CPU, torch.float32, QUIET, QUIET)
    pipeline = make_pipeline(source, stages, scheduler, CPU, torch.float32, request.mode, StepCache(interval))
    return to_uint8(pipeline(request, StageTimer(CPU)))


def edit_request(source, mode: str) -> Request:
    size = source.native_image_size
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4: size * 3 // 4, size // 4:] = 255
    fields = dict(image=image, strength=0.7) if mode == IMAGE_TO_IMAGE else dict(
        image=image, mask=Image.fromarray(mask), strength=1.0)
    return Request("a blue square", denoising_steps=8, seed=4, guidance_scale=5.0, **fields)


CASES = [  # model, mode, interval, branch, scheduler
    ("tiny", TEXT_TO_IMAGE, 3, 0, "DDIM"),
    ("tiny", TEXT_TO_IMAGE, 2, 4, "Euler"),
    ("tiny", IMAGE_TO_IMAGE, 2, 1, "DDIM"),
    ("tiny", INPAINTING, 3, 2, "DDIM"),
    ("tiny-xl", TEXT_TO_IMAGE, 3, 0, "Euler"),
    ("tiny-xl", IMAGE_TO_IMAGE, 2, 3, "DDIM"),
    ("tiny-xl", INPAINTING, 2, 5, "Euler"),
]


@pytest.mark.parametrize("model, mode, interval, branch, scheduler", CASES)
def test_a_cached_run_equals_diffusers_with_a_reference_cache(model, mode, interval, branch, scheduler):
    source = resolve_model(model)
    size = source.native_image_size
    request = (Request("a red circle", denoising_steps=9, seed=2, height=size, width=size, guidance_scale=5.0)
               if mode == TEXT_TO_IMAGE else edit_request(source, mode)).resolved(source)
    ours = our_images(source, request, interval, branch, scheduler)
    theirs = diffusers_images(source, scheduler, request, unet=reference_unet(source, interval, branch))
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
    uncached = our_images(source, request, 1, branch, scheduler)
    assert np.abs(ours.astype(int) - uncached.astype(int)).max() > 2  # the cache changes the picture


@pytest.mark.parametrize("interval, branch", [(3, 0), (2, 4)])
def test_the_deepcache_packages_helper_draws_the_same_image(interval, branch):
    """DeepCacheSDHelper numbers a UNet of two layers a block's branches as we do (tiny has two)."""
    deepcache = pytest.importorskip("DeepCache", reason="the DeepCache package is not installed")
    import diffusers

    source = resolve_model("tiny")
    request = Request("a red circle", denoising_steps=9, seed=2, guidance_scale=5.0).resolved(source)
    ours = our_images(source, request, interval, branch, "DDIM")
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(source.path, safety_checker=None,
                                                            requires_safety_checker=False)
    pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    helper = deepcache.DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=interval, cache_branch_id=branch)
    helper.enable()
    theirs = pipe(request.prompt, num_inference_steps=9, guidance_scale=5.0, height=request.height,
                  width=request.width, generator=torch.Generator().manual_seed(2), output_type="np").images
    helper.disable()
    assert np.abs(ours.astype(int) - (theirs * 255).round().astype(int)).max() <= 2


def draw(pipeline) -> tuple[np.ndarray, set[str]]:
    """The test's picture, and the stages that drew it."""
    return pipeline("a red circle", seed=7, denoising_steps=8).pixels, set(pipeline.stages)


def render(spec: PipelineSpec) -> tuple[np.ndarray, set[str]]:
    with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
        return draw(pipeline)


def test_interval_one_is_the_uncached_pipeline_bit_for_bit():
    plain, plain_stages = render(PipelineSpec(model="tiny", backend="torch"))
    same, same_stages = render(PipelineSpec(model="tiny", backend="torch", cache_interval=1, cache_branch=3))
    assert np.array_equal(plain, same) and UNET_SHALLOW not in same_stages
    cached, cached_stages = render(PipelineSpec(model="tiny", backend="torch", cache_interval=2))
    assert UNET_SHALLOW in cached_stages and not np.array_equal(plain, cached)


def test_a_lora_reaches_the_shallow_pass_on_the_torch_backend():
    """One module under both passes: a LoRA fused in is in the cached calls too, and goes away again exactly."""
    from models.shapes import OUTLINE_LORA

    spec = PipelineSpec(model="shapes", backend="torch", cache_interval=3, modes=(TEXT_TO_IMAGE,))
    with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
        shallow = pipeline.stages[UNET_SHALLOW].module.unet
        assert shallow is pipeline.stages["unet"].module.unet
        base = [weight.clone() for weight in shallow.parameters()]
        pipeline.set_loras([(OUTLINE_LORA, 1.0)])
        assert sum(not torch.equal(a, b) for a, b in zip(shallow.parameters(), base)) > 10
        pipeline.set_loras([])
        assert all(torch.equal(a, b) for a, b in zip(shallow.parameters(), base))


def test_engines_draw_the_torch_paths_cached_image(tmp_path):
    """Both engines (the full pass with its features, the shallow pass) through the stand-in TensorRT, fp32, against
    the torch backend's cached image; their files sit beside the plain UNet's."""
    with stand_in_pipeline(tmp_path, model="tiny", scheduler="DDIM", modes=(TEXT_TO_IMAGE,), cache_interval=3,
                           cache_branch=2) as pipeline:
        engines, stages = draw(pipeline)
    torch_image, _ = render(PipelineSpec(model="tiny", backend="torch", precision="fp32", scheduler="DDIM",
                                         cache_interval=3, cache_branch=2))
    assert UNET_SHALLOW in stages
    assert np.abs(engines.astype(int) - torch_image.astype(int)).max() <= 1
    assert sorted(p.name for p in (tmp_path / "engine").glob("unet*.engine")) == ["unet.cache2.engine",
                                                                                 "unet_shallow.cache2.engine"]


@pytest.mark.parametrize("fields, message", [
    (dict(cache_interval=0), "cache_interval must be at least 1, got 0"),
    (dict(cache_interval=2, cache_branch=-1), "cache_branch must be 0 or more, got -1"),
    (dict(cache_interval=2, cache_branch=6), "cache_branch 6: this UNet's skip branches are 0 to 5"),
])
def test_bad_cache_values_are_one_line(fields, message):
    with pytest.raises(UsageError) as raised:
        load_pipeline(PipelineSpec(model="tiny", backend="torch", **fields), CPU, progress=QUIET)
    assert message in raised.value.render()


def test_int8_quantizes_both_unet_engines_from_one_calibration(tmp_path):
    from demo.pipelines import image_psnr

    with stand_in_pipeline(tmp_path, dict(int8=True, calibration_steps=4), model="tiny", scheduler="DDIM",
                           modes=(TEXT_TO_IMAGE,), cache_interval=2) as pipeline:
        engines, _ = draw(pipeline)
    torch_image, _ = render(PipelineSpec(model="tiny", backend="torch", precision="fp32", scheduler="DDIM",
                                         cache_interval=2))
    assert sorted(p.name for p in (tmp_path / "engine").glob("unet*.engine")) == ["unet.cache0.int8.engine",
                                                                                 "unet_shallow.cache0.int8.engine"]
    assert [p.name for p in (tmp_path / "onnx").glob("*.calibration.json")] == ["unet.calibration.json"]
    assert 25 < image_psnr(engines, torch_image) < float("inf")


def test_a_lora_refits_both_engines_and_draws_the_torch_paths_image(tmp_path):
    """Refittable engines of both passes take the shipped outline LoRA by refit (the shallow one too: its export names
    its weights by their whole module paths), and draw the torch path's cached image with the LoRA fused."""
    from models.shapes import OUTLINE_LORA

    fields = dict(model="shapes", precision="fp32", scheduler="DDIM", modes=(TEXT_TO_IMAGE,), cache_interval=3,
                  cache_branch=1, loras=((str(OUTLINE_LORA), 1.0),))
    with stand_in_pipeline(tmp_path, dict(build_enable_refit=True), **fields) as pipeline:
        refits = {name: len(pipeline.stages[name].engine.engine.refits) for name in ("unet", UNET_SHALLOW)}
        engines = pipeline("a large red square in the center on a white background", seed=3,
                           denoising_steps=12).pixels
    with load_pipeline(PipelineSpec(backend="torch", **fields), CPU, progress=QUIET) as pipeline:
        fused = pipeline("a large red square in the center on a white background", seed=3, denoising_steps=12).pixels
    assert refits == {"unet": 1, UNET_SHALLOW: 1}
    assert np.abs(engines.astype(int) - fused.astype(int)).max() <= 1


def test_build_engines_builds_both_passes_with_tensorrt_for_rtx(tiny, tmp_path, capsys):
    """build-engines --cache-interval: the UNet's two engines for the cache, with TensorRT for RTX on this CPU."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")
    from demo.cli.build_engines import main

    assert main(["--model", str(tiny.path), "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir",
                 str(tmp_path / "engine"), "--optimization-level", "0", "--build-static-batch", "--stages", "unet",
                 "--cache-interval", "3", "--cache-branch", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "engine").glob("*.engine")) == ["unet.cache1.engine",
                                                                            "unet_shallow.cache1.engine"]
    assert "unet_shallow" in capsys.readouterr().out


def test_a_refiner_caches_its_own_calls_from_its_own_first():
    """SDXL base then refiner: each has its shallow stage and counts its calls from its first (its features are its
    own): 10 steps at 0.8 are 8 base calls (3 whole) and 2 refiner calls (1 whole); interval 1 is the uncached image."""
    fields = dict(model="tiny-xl", refiner="tiny-xl-refiner", backend="torch", modes=(TEXT_TO_IMAGE,), cache_branch=1)
    images = {}
    for interval in (1, 3):
        with load_pipeline(PipelineSpec(cache_interval=interval, **fields), CPU, progress=QUIET) as pipeline:
            result = pipeline("a red circle", seed=1, denoising_steps=10)
            images[interval] = result.pixels
            assert (UNET_SHALLOW in pipeline.refiner_stages) == (interval > 1)
    assert "step cache every 3 (branch 1): 4 of 10 UNet calls whole" in result.report.table()
    assert np.abs(images[1].astype(int) - images[3].astype(int)).max() > 2
    again, _ = render(PipelineSpec(model="tiny-xl", backend="torch", cache_interval=1, cache_branch=1))
    plain, _ = render(PipelineSpec(model="tiny-xl", backend="torch"))
    assert np.array_equal(again, plain)
