"""The adaptive step cache on SD3's and Flux's transformers (models.transformer_cache, FlowPipeline.step_cache_call):
planned only with a threshold above 0; every call whole through its parts is the plain transformer's image bit for
bit; a cached run is diffusers' own pipeline with diffusers' First Block Cache on its transformer (apply_first_block_
cache; SD3's last block patched so that diffusers' hook runs at all), same seed, within 2/255, with as many whole
calls; the cap on cached calls in a row against diffusers' hook with its decision capped alike; image-to-image; the
refusals (engines, ControlNets) in one line. On the CPU in fp32, on tiny-sd3, tiny-flux and tiny-flux-schnell."""

import types

import diffusers
import numpy as np
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
from diffusers.hooks.hooks import CacheContext, _set_cache_context

from core.errors import UsageError
from demo.backends.registry import REFERENCE
from demo.backends.torch.settings import FALLBACK
from demo.pipelines import StageTimer, make_pipeline, to_uint8
from demo.request import IMAGE_TO_IMAGE, INPAINTING, Request
from demo.runtime.loader import plan_pipeline
from demo.runtime.spec import PipelineSpec
from models import VAE_ENCODER, text_to_image_stages
from models.families import ADAPTIVE_CACHE, FLUX, SD3
from models.source import resolve_model
from models.stages import stage_models
from models.step_cache import AdaptiveSchedule, StepCache
from models.transformer import unpacked
from models.transformer_cache import HEAD, OUT, TAIL, part_stage
from models.unet import LATENT
from tests.parity import CPU, QUIET, diffusers_images

SIZES = {SD3.name: 64, FLUX.name: 128}
UNCAPPED = 1000  # max_skips no run reaches: diffusers' hook has no cap


@pytest.fixture(scope="module")
def sources():
    return {name: resolve_model(name) for name in ("tiny-sd3", "tiny-flux", "tiny-flux-schnell")}


@pytest.fixture(scope="module")
def cached_stages(sources):
    """Each model's stages as planned with the adaptive cache (the image-to-image ones), on the torch backend."""
    made = {}
    for name, source in sources.items():
        models = stage_models(source, (*text_to_image_stages(source), VAE_ENCODER), adaptive_cache=True)
        made[name] = REFERENCE.create_stages(models, lambda _: FALLBACK, CPU, torch.float32, QUIET, QUIET)
    return made


def request(source, **given) -> Request:
    size = SIZES[source.family.name]
    guided = {"guidance_scale": 5.0, "negative_prompt": "blurry"} if source.family is SD3 else {}
    resolved = Request("a photo of a cat on a table", **{"denoising_steps": 6, "seed": 11, "height": size,
                                                          "width": size, **guided, **given}).resolved(source)
    resolved.check(source)
    return resolved


class _Recorded:
    """A stage whose predictions (LATENT) are appended to `predictions`, in call order."""

    def __init__(self, stage, predictions: list):
        self.stage, self.model, self.predictions = stage, stage.model, predictions

    def prepare(self, *args):
        self.stage.prepare(*args)

    def __call__(self, feed):
        outputs = self.stage(feed)
        self.predictions.append(outputs[LATENT])
        return outputs


def ours(source, stages, made: Request, cache: StepCache, predictions: list | None = None):
    """Our image under `cache` and the run's schedule (its calls and whole calls); each call's prediction appended to
    `predictions` (from the tail or the out part)."""
    if predictions is not None:
        ends = [part_stage(source.family.denoiser_stage, part) for part in (TAIL, OUT)]
        stages = {name: _Recorded(stage, predictions) if name in ends else stage for name, stage in stages.items()}
    pipeline = make_pipeline(source, stages, made.scheduler, CPU, torch.float32, made.mode, cache)
    image = to_uint8(pipeline(made, StageTimer(CPU)))
    return image, pipeline.last_schedule


def fbc_transformer(source, threshold: float, max_skips: int = UNCAPPED, forecast: bool = False):
    """diffusers' transformer with diffusers' First Block Cache at `threshold`, its decision capped at `max_skips`
    cached calls in a row, counting its whole calls (`.whole_calls`); with `forecast`, a cached call's residual the
    line through the last two whole calls' (by call number) at that call, where two have run (the reference of
    --cache-forecast: the tail hook's residual, read back at the decision after each whole call, replaced before the
    head hook adds it). SD3's: its last block (context_pre_only) returns
    no text stream, from which diffusers' tail hook subtracts (a TypeError): the stream it was given in its place
    (nothing reads it after the last block). StableDiffusion3Pipeline and FluxInpaintPipeline set no cache context (the
hooks' state's key): one, once."""
    denoiser = getattr(diffusers, source.family.denoiser_classes[0])
    transformer = denoiser.from_pretrained(source.component_dir("transformer"))
    if source.family is SD3:
        last = transformer.transformer_blocks[-1]
        block_forward = last.forward

        def with_text_stream(self, hidden_states, encoder_hidden_states, temb, **kwargs):
            text, hidden = block_forward(hidden_states, encoder_hidden_states, temb, **kwargs)
            return encoder_hidden_states if text is None else text, hidden

        last.forward = types.MethodType(with_text_stream, last)
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    hook = HookRegistry.check_if_exists_or_initialize(transformer.transformer_blocks[0]).get_hook(
        "fbc_leader_block_hook")
    decide, row, history = hook._should_compute_remaining_blocks, {"skipped": 0, "calls": 0, "after_whole": False}, []
    transformer.whole_calls = 0

    def capped(residual):
        row["calls"] += 1
        state = hook.state_manager.get_state()
        if row["after_whole"]:  # the call before ran whole: its tail residual is the state's
            history[:] = [*history[-1:], (state.tail_block_residuals[0].clone(), row["calls"] - 1)]
        whole = decide(residual) or row["skipped"] >= max_skips
        row["skipped"] = 0 if whole else row["skipped"] + 1
        row["after_whole"] = whole
        transformer.whole_calls += whole
        if forecast and not whole and len(history) == 2:
            (before, called_before), (last, called) = history
            line = last + (last - before) * ((row["calls"] - called) / (called - called_before))
            state.tail_block_residuals = (line, state.tail_block_residuals[1])
        return whole

    hook._should_compute_remaining_blocks = capped
    _set_cache_context(transformer, CacheContext("cond"))  # for pipelines that set none (FluxPipeline sets its own)
    transformer.predictions, transformer_forward = [], transformer.forward

    def recorded(*args, **kwargs):
        output = transformer_forward(*args, **kwargs)
        transformer.predictions.append(output[0])
        return output

    transformer.forward = recorded
    return transformer


def check_against_diffusers(source, stages, made: Request, threshold: float, max_skips: int = UNCAPPED,
                            forecast: bool = False):
    """Our cached run against diffusers' pipeline with its First Block Cache (and the forecast's reference): as many
    whole calls, each call's prediction diffusers' (to float32's rounding: the tiny models' images move little with
    the cache), the image within 2/255; returns the run's schedule and its predictions."""
    predictions = []
    cache = StepCache(threshold=threshold, max_skips=max_skips, forecast=forecast)
    image, schedule = ours(source, stages, made, cache, predictions)
    transformer = fbc_transformer(source, threshold, max_skips, forecast)
    theirs = diffusers_images(source, made.scheduler, made, transformer=transformer)
    assert 0 < schedule.whole_calls < schedule.calls, "both whole and cached calls"  # else the test tests nothing
    assert schedule.whole_calls == transformer.whole_calls
    assert len(predictions) == len(transformer.predictions) == schedule.calls
    for call, (made_here, made_there) in enumerate(zip(predictions, transformer.predictions)):
        if source.family is FLUX:  # diffusers' in tokens
            made_there = unpacked(made_there, made_here.shape, source.family.packed_latents)
        assert (made_here - made_there).abs().max() <= 1e-5 * made_there.abs().max(), call
    assert np.abs(image.astype(int) - theirs.astype(int)).max() <= 2 and image.std() > 5
    return schedule, predictions


def test_threshold_0_plans_todays_stages_and_a_threshold_the_parts(sources):
    for source in sources.values():
        assert ADAPTIVE_CACHE in source.family.features and not source.family.engines_take(ADAPTIVE_CACHE)
        names = text_to_image_stages(source)
        plain = plan_pipeline(PipelineSpec(model=source.name, backend="torch"), CPU, runs=False)
        assert [model.name for model in plain.base.models] == list(names)
        cached = plan_pipeline(PipelineSpec(model=source.name, backend="torch", cache_threshold=0.1), CPU, runs=False)
        denoiser = source.family.denoiser_stage
        parts = [part_stage(denoiser, part) for part in (HEAD, TAIL, OUT)]
        assert [model.name for model in cached.base.models] == [*names[:-1], *parts, names[-1]]
        assert all(model.part_of == denoiser for model in cached.base.models[-4:-1])


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_every_call_whole_through_the_parts_is_the_plain_image_bit_for_bit(sources, cached_stages, name):
    """max_skips 0: every call whole (head, then tail), as a threshold that is never reached; the plain transformer
    stage draws the same image."""
    source, stages = sources[name], cached_stages[name]
    made = request(source, denoising_steps=3)
    image, schedule = ours(source, stages, made, StepCache(threshold=0.5, max_skips=0))
    assert schedule.whole_calls == schedule.calls == 3
    plain = {name: stage for name, stage in stages.items() if not name.endswith((HEAD, TAIL, OUT))}
    assert np.array_equal(image, ours(source, plain, made, StepCache())[0])


@pytest.mark.parametrize("name, threshold", [("tiny-sd3", 0.3), ("tiny-flux", 0.3), ("tiny-flux-schnell", 0.3)])
def test_a_cached_run_is_diffusers_first_block_cache(sources, cached_stages, name, threshold):
    check_against_diffusers(sources[name], cached_stages[name], request(sources[name]), threshold)


def test_the_cap_on_cached_calls_in_a_row(sources, cached_stages):
    """A threshold that caches every call after the first but for the cap: whole every max_skips + 1 calls."""
    source = sources["tiny-flux"]
    schedule, _ = check_against_diffusers(source, cached_stages["tiny-flux"], request(source), 10.0, max_skips=2)
    assert (schedule.calls, schedule.whole_calls) == (6, 2)


def test_the_forecast_is_the_line_through_two_whole_calls_kept_as_copies():
    """Its values exactly on the line through the kept ones, by call number, from fresh random tensors kept from
    one buffer rewritten in place after each whole call (as a stage replayed from a CUDA graph rewrites its
    outputs): the kept values are copies."""
    schedule, buffer = AdaptiveSchedule(0.1, forecast=True), torch.empty(2, 16, 8)
    values = [torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    for value in values[:2]:  # calls 1 and 2 whole
        buffer.copy_(value)
        schedule.whole(None)
        schedule.keep(buffer)
    buffer.copy_(values[2])  # the next replay, before the cached calls read what was kept
    for call, steps in ((3, 1.0), (4, 2.0)):
        schedule.whole(None)
        assert schedule.calls == call
        assert torch.equal(schedule.kept(), values[1] + (values[1] - values[0]) * steps)
    single = AdaptiveSchedule(0.1, forecast=True)
    single.whole(None)
    single.keep(values[0])
    single.whole(None)
    assert torch.equal(single.kept(), values[0])  # one whole call so far: its value


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_the_forecast_extrapolates_the_last_two_whole_calls_residuals(sources, cached_stages, name):
    """--cache-forecast against its reference on diffusers' hook: whole and cached calls alternating (a threshold
    every call passes, one cached call in a row), so calls 4 and 6 forecast from two whole calls and call 2 reuses
    the one before it; the forecast calls differ from the plain cache's, the others do not."""
    source, stages = sources[name], cached_stages[name]
    made = request(source)
    schedule, forecast = check_against_diffusers(source, stages, made, 10.0, max_skips=1, forecast=True)
    assert (schedule.calls, schedule.whole_calls) == (6, 3)
    _, plain = check_against_diffusers(source, stages, made, 10.0, max_skips=1)
    assert torch.equal(forecast[1], plain[1]) and not torch.equal(forecast[3], plain[3])


def test_image_to_image_under_the_cache(sources, cached_stages):
    from PIL import Image

    source = sources["tiny-sd3"]
    pixels = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    made = request(source, image=Image.fromarray(pixels), strength=0.9, denoising_steps=8)
    assert made.mode == IMAGE_TO_IMAGE
    check_against_diffusers(source, cached_stages["tiny-sd3"], made, 0.3)


def test_inpainting_under_the_cache_two_images_a_call(sources, cached_stages):
    from tests.test_flow_inpainting import a_mask, an_image

    source = sources["tiny-flux"]
    made = request(source, image=an_image(128), mask=a_mask(128), strength=1.0, batch_size=2, guidance_scale=3.5)
    assert made.mode == INPAINTING
    check_against_diffusers(source, cached_stages["tiny-flux"], made, 0.3)


def test_sd35s_transformer_under_the_cache(tiny_sd35):
    """SD3.5's Q/K RMSNorms and MMDiT-X's second attention in the first block: the head's."""
    models = stage_models(tiny_sd35, text_to_image_stages(tiny_sd35), adaptive_cache=True)
    stages = REFERENCE.create_stages(models, lambda _: FALLBACK, CPU, torch.float32, QUIET, QUIET)
    check_against_diffusers(tiny_sd35, stages, request(tiny_sd35), 0.3)


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_each_part_makes_the_shapes_and_takes_the_inputs_it_declares(sources, cached_stages, name):
    """What the torch backend sizes a part's CUDA graph by (input_shapes, sample_inputs) is what its module takes
    and makes, in a batch of 2 at another size than the native."""
    source, stages = sources[name], cached_stages[name]
    size = SIZES[source.family.name] * 3 // 2
    feed = stages[source.family.denoiser_stage].model.sample_inputs(2, size, size)
    for part in (HEAD, TAIL, OUT):
        stage = stages[part_stage(source.family.denoiser_stage, part)]
        assert stage.model.input_shapes(2, size, size) == {name: tuple(feed[name].shape)
                                                          for name in stage.model.input_names}
        assert set(stage.model.sample_inputs(2, size, size)) == set(stage.model.input_names)
        outputs = stage(feed)
        assert {name: tuple(value.shape) for name, value in outputs.items()} == stage.model.output_shapes(2, size,
                                                                                                          size)
        feed = {**feed, **outputs}


def test_engines_and_controlnets_are_refused_naming_cache_threshold(sources, tmp_path):
    from tests.test_flow_controlnet import flux_controlnet

    with pytest.raises(UsageError, match="cache_threshold on backend tensorrt-rtx.*not take the adaptive step cache"):
        plan_pipeline(PipelineSpec(model="tiny-flux", backend="tensorrt-rtx", cache_threshold=0.1), CPU, runs=False)
    net = flux_controlnet(tmp_path / "net", 1)
    with pytest.raises(UsageError, match="controlnets run without cache_threshold") as refused:
        plan_pipeline(PipelineSpec(model="tiny-flux", backend="torch", cache_threshold=0.1, controlnets=(net,)), CPU,
                      runs=False)
    assert "\n" not in str(refused.value)


def test_a_transformer_of_one_block_is_refused_naming_cache_threshold(tmp_path):
    from models.builtin import BUILTIN_MODELS, build_sd3_model

    spec = BUILTIN_MODELS["tiny-sd3"]
    build_sd3_model({**spec, "transformer": {**spec["transformer"], "num_layers": 1}}, tmp_path / "model")
    with pytest.raises(UsageError, match="^cache_threshold: the transformer of model .* has 1 block; .* two at least$"):
        plan_pipeline(PipelineSpec(model=str(tmp_path / "model"), backend="torch", cache_threshold=0.1), CPU,
                      runs=False)
