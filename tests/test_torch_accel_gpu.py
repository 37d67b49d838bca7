"""The torch backend's accelerations on a GPU (fp16; skipped without CUDA, and the plugin tests without the
plugin library): each plugin family substituted into the tiny model's modules against the unsubstituted
module; the whole tiny pipeline with plugins, channels-last, CUDA graphs and torch.compile against the plain
diffusers modules (PSNR and largest pixel difference); and the CUDA-graph path's outputs (static output
poisoned before each replay, no aliasing between calls), on a second GPU too where there is one; input images made
on the GPU as diffusers' image processors make them on the CPU."""

import copy
import warnings

import numpy as np
import pytest
import torch

from demo.backends.torch.settings import FALLBACK, TorchSettings, computed_part
from demo.backends.torch.stage import TorchStage
from demo.pipelines import StageTimer, Text2ImagePipeline, image_psnr, to_uint8
from demo.request import Request
from models import CLIP, STAGE_MODELS, UNET, VAE
from plugins import torch_ops
from plugins.contract import PLUGIN_KEYS
from plugins.diffusers_modules import substitute
from tests.parity import check_input_images

SD_STAGES = (CLIP, UNET, VAE)  # the text-to-image stages of an SD 1.x/2.x model (tiny's)

pytestmark = pytest.mark.gpu
needs_plugins = pytest.mark.skipif(not torch_ops.available(), reason=f"plugins cannot run here: {torch_ops.status()}")

CUDA = torch.device("cuda")
ALL = tuple(sorted(PLUGIN_KEYS))
# fp16 against fp16: kernels that accumulate in fp32 differ from PyTorch's by rounding, O(1e-3) through a
# stage; a wrong substitution (layout, scale, weights) is off by O(1).
STAGE_BOUND = 1e-2
MIN_PSNR, MAX_PIXEL_DIFF = 35.0, 16


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite output"
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


STAGES_OF = {"fMHA": ("unet", "vae"), "fMHCA": ("unet",), "GroupNorm": ("unet", "vae"), "LayerNorm": ("clip", "unet"),
             "SplitGeLU": ("unet",), "Seq2Spatial": ("unet",)}
FAMILY_CASES = [(family, stage) for family, stages in STAGES_OF.items() for stage in stages]


@needs_plugins
@pytest.mark.parametrize("family, stage", FAMILY_CASES, ids=[f"{f}-{s}" for f, s in FAMILY_CASES])
def test_each_family_matches_the_unsubstituted_module(tiny, family, stage):
    model = STAGE_MODELS[stage](tiny)
    module = model.load_module().to(CUDA, torch.float16).eval()
    reference = copy.deepcopy(module)
    report = substitute(computed_part(stage, module), [family])
    assert report.replaced[family] > 0 and not report.skipped[family]
    feed = model.sample_inputs(2, 64, 48, CUDA, torch.float16, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        actual, expected = module(*feed.values()), reference(*feed.values())
    assert rel_error(actual, expected) < STAGE_BOUND


@needs_plugins
def test_group_norm_on_channels_last_memory(tiny):
    model = STAGE_MODELS["unet"](tiny)
    module = model.load_module().to(CUDA, torch.float16).eval()
    reference = copy.deepcopy(module)
    substitute(module, ["GroupNorm", "LayerNorm", "SplitGeLU", "fMHA", "fMHCA"], channels_last=True)
    module.to(memory_format=torch.channels_last)
    feed = model.sample_inputs(2, 64, 64, CUDA, torch.float16, torch.Generator().manual_seed(2))
    with torch.inference_mode():
        actual = module(*(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
                          for t in feed.values()))
        expected = reference(*feed.values())
    assert rel_error(actual, expected) < STAGE_BOUND


REQUEST = Request(("a red car", "a castle on a hill"), ("", "blurry"), height=64, width=64, denoising_steps=8,
                  guidance_scale=7.5, seed=5)
CONFIGS = {
    "plugins": TorchSettings(ALL),
    "channels-last": TorchSettings(channels_last=True),
    "cuda-graph": TorchSettings(cuda_graph=True),
    "compile": TorchSettings(compile="default"),
    "compile-reduce-overhead": TorchSettings(channels_last=True, compile="reduce-overhead"),
    "everything": TorchSettings(ALL, channels_last=True, cuda_graph=True, compile="default"),
}


def pipeline_images(tiny, settings: TorchSettings):
    stages = {name: TorchStage(STAGE_MODELS[name](tiny), CUDA, torch.float16, settings)
              for name in SD_STAGES}
    pipeline = Text2ImagePipeline(tiny, stages, "DDIM", CUDA, torch.float16)
    first = to_uint8(pipeline(REQUEST, StageTimer(CUDA)))
    second = to_uint8(pipeline(REQUEST, StageTimer(CUDA)))
    return first, second, stages


@pytest.fixture(scope="module")
def plain_images(tiny):
    first, second, _ = pipeline_images(tiny, FALLBACK)
    assert np.array_equal(first, second) and first.std() > 5  # deterministic, and a picture, not a constant
    return first


@pytest.mark.parametrize("label", list(CONFIGS))
def test_pipeline_matches_plain_diffusers_modules(tiny, plain_images, label):
    settings = CONFIGS[label]
    if settings.plugins and not torch_ops.available():
        pytest.skip(f"plugins cannot run here: {torch_ops.status()}")
    torch._dynamo.reset()
    first, second, stages = pipeline_images(tiny, settings)
    # A second run (graph replays, compiled code) draws the same image. With our kernels only up to
    # rounding: they are not bitwise deterministic run to run (on the H100, 1 level in a few pixels);
    # stale or aliased buffers would differ by far more.
    assert np.abs(first.astype(int) - second.astype(int)).max() <= (1 if settings.plugins else 0)
    difference = np.abs(first.astype(int) - plain_images.astype(int))
    psnr = image_psnr(first, plain_images)
    assert psnr >= MIN_PSNR and difference.max() <= MAX_PIXEL_DIFF, (psnr, difference.max())
    if settings.cuda_graph:  # captured while preparing, one graph per stage at this shape
        assert all(len(stage._graphs) == 1 and stage.prepare_seconds["capture"] > 0 for stage in stages.values())
    if settings.plugins:
        assert stages["unet"].substitution.replaced["fMHA"] == 6


def poison(graph) -> None:
    """NaN into the graph's static outputs (a stage's graph returns a tuple of them)."""
    with torch.inference_mode():
        for output in graph.output:
            output.fill_(float("nan"))


def test_graph_outputs_are_fresh_and_written_in_full(tiny):
    """The CUDA-graph path: the static output is poisoned with NaN before each replay, so an element the
    replay does not write shows; what a call returned stays as it was after later calls."""
    model = STAGE_MODELS["unet"](tiny)
    graphed = TorchStage(model, CUDA, torch.float16, TorchSettings(cuda_graph=True))
    eager = TorchStage(model, CUDA, torch.float16)
    graphed.prepare(4, 64, 64)
    (graph,) = graphed._graphs.values()
    feeds = [model.sample_inputs(4, 64, 64, CUDA, torch.float16, torch.Generator().manual_seed(s)) for s in (1, 2)]
    outputs = []
    for feed in feeds:
        poison(graph)
        outputs.append(graphed(feed)["latent"])
    poison(graph)
    for feed, output in zip(feeds, outputs):
        assert torch.isfinite(output).all()  # neither aliased to the static output nor overwritten since
        assert rel_error(output, eager(feed)["latent"]) < 1e-3
    assert outputs[0].data_ptr() != outputs[1].data_ptr()
    assert rel_error(outputs[0], outputs[1]) > 0.1  # the second replay saw the second inputs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_graphs_on_a_second_gpu(tiny):
    """sd-serve prepares one pipeline per GPU in one process: a capture on cuda:1 after one on cuda:0 must record
    cuda:1's work (torch.cuda.graph's default stream lives on the device that was current at its first use)."""
    model = STAGE_MODELS["unet"](tiny)
    first = TorchStage(model, CUDA, torch.float16, TorchSettings(cuda_graph=True))
    first.prepare(2, 64, 64)
    second_gpu = torch.device("cuda", 1)
    with torch.cuda.device(second_gpu):
        graphed = TorchStage(model, second_gpu, torch.float16, TorchSettings(cuda_graph=True))
        graphed.prepare(2, 64, 64)
        eager = TorchStage(model, second_gpu, torch.float16)
        feed = model.sample_inputs(2, 64, 64, second_gpu, torch.float16, torch.Generator().manual_seed(3))
        (graph,) = graphed._graphs.values()
        poison(graph)
        output = graphed(feed)["latent"]
        assert output.device == second_gpu
        assert rel_error(output, eager(feed)["latent"]) < 1e-3


def test_input_images_are_made_on_the_gpu_as_diffusers_makes_them_on_the_cpu():
    check_input_images(CUDA)


@pytest.mark.parametrize("cache_interval", [1, 3])
def test_controlnet_residuals_reach_the_unet_through_cuda_graphs_unchanged(cache_interval):
    """A ControlNet's graph returns its own output buffers, channels-last (no clone; StageModel.feeds_a_stage); the UNet
    copies them in before the ControlNet runs again: two ControlNets with a guidance window, channels-last and CUDA
    graphs draw the plain modules' picture, twice the same; with the step cache too (the shallow passes' graphs on
    the full passes' modules)."""
    from demo.backends.torch.options import TorchOptions
    from demo.request import TEXT_TO_IMAGE
    from demo.runtime.loader import load_pipeline
    from demo.runtime.spec import PipelineSpec
    from tests.test_controlnet import picture

    request = Request("a red circle", height=64, width=64, denoising_steps=6, seed=5, scheduler="DDIM",
                      control_images=(picture(11), picture(12)), control_guidance_start=0.2)
    images = {}
    for graphed in (False, True):
        spec = PipelineSpec(model="tiny", backend="torch", precision="fp16", plugins="none", use_cuda_graph=graphed,
                            controlnets=(("tiny-controlnet", 0.6), ("tiny-controlnet", 1.1)), modes=(TEXT_TO_IMAGE,),
                            torch=TorchOptions(channels_last=graphed, compile="none"), cache_interval=cache_interval,
                            cache_branch=1)
        with load_pipeline(spec, CUDA, progress=lambda *_: None) as pipeline:
            images[graphed] = [pipeline(request).pixels for _ in range(2)]
    assert np.array_equal(*images[True])
    assert np.abs(images[True][0].astype(int) - images[False][0].astype(int)).max() <= 1


def test_the_denoising_loop_never_waits_for_the_gpu(monkeypatch):
    """Each step is queued while the GPU runs the one before: the synchronizing calls torch reports inside the
    loop (DDIM's step indexing its host tables with a timestep on the GPU made two a step) are as few for 8 steps
    as for 4, with a ControlNet and CUDA graphs (after a first call, whose one-time work may wait once more)."""
    from demo.request import TEXT_TO_IMAGE
    from demo.runtime.loader import load_pipeline
    from demo.runtime.spec import PipelineSpec
    from tests.test_controlnet import picture

    syncs = []
    denoise = Text2ImagePipeline.denoise

    def counted(self, *args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return denoise(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.append(sum("synchroniz" in str(w.message) for w in caught))

    monkeypatch.setattr(Text2ImagePipeline, "denoise", counted)
    spec = PipelineSpec(model="tiny", backend="torch", precision="fp16", plugins="none", use_cuda_graph=True,
                        controlnets=(("tiny-controlnet", 1.0),), modes=(TEXT_TO_IMAGE,))
    with load_pipeline(spec, CUDA, progress=lambda *_: None) as pipeline:
        for steps in (4, 4, 8):
            pipeline(Request("a red circle", height=64, width=64, denoising_steps=steps, seed=5, scheduler="DDIM",
                             control_images=(picture(11),)))
    assert syncs[1] == syncs[2] < 4, syncs


def test_a_stages_graphs_share_one_pool_and_keep_their_outputs():
    """A stage's graphs, one per batch size, capture into one memory pool on one stream: each replays its own
    computation (outputs poisoned first), another's replay leaves its output as it was, and the pool holds less than
    the graphs would in pools of their own: about what the largest graph holds alone (the smaller ones reuse its
    freed intermediates, which the allocator hands only to allocations on the stream that freed them)."""
    from demo.backends.torch.settings import GraphedCall

    generator = torch.Generator(device=CUDA).manual_seed(5)
    weight = torch.randn(512, 512, device=CUDA, generator=generator)

    def fn(x):  # intermediates much larger than the output
        h = torch.relu(x @ weight).repeat(1, 8)
        return (h * h).sum(dim=1, keepdim=True)

    def captured(pool, stream=None, sizes=(2048, 1024, 256)) -> tuple[dict, int]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the freed pools go back to the device: each capture starts from nothing
        before = torch.cuda.memory_reserved(CUDA)
        graphs = {rows: GraphedCall(fn, (torch.randn(rows, 512, device=CUDA, generator=generator),),
                                    clone_outputs=False, pool=pool, stream=stream) for rows in sizes}
        torch.cuda.synchronize()
        return graphs, torch.cuda.memory_reserved(CUDA) - before

    with torch.inference_mode():
        alone = captured(None, sizes=(2048,))[1]
        separate = captured(None)[1]
        shared_graphs, shared = captured(torch.cuda.graph_pool_handle(), torch.cuda.Stream())
        inputs = {rows: torch.randn(rows, 512, device=CUDA, generator=generator) for rows in shared_graphs}
        outputs = {}
        for rows, graph in shared_graphs.items():
            graph.output.fill_(float("nan"))
            outputs[rows] = graph(inputs[rows]).clone()
            torch.testing.assert_close(outputs[rows], fn(inputs[rows]), rtol=1e-3, atol=1e-2)
        kept = shared_graphs[256](inputs[256])  # the graph's own output buffer
        shared_graphs[2048](inputs[2048])
        shared_graphs[1024](inputs[1024])
        torch.testing.assert_close(kept, outputs[256], rtol=0, atol=0)
    assert shared < separate and shared <= 1.25 * alone + 2**21, (shared, separate, alone)
