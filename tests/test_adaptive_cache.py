"""The adaptive step cache on UNets (issue 59; models.step_cache, --cache-threshold/--cache-max-skips), on the CPU.

- Threshold 0 is the uncached pipeline (no shallow stage); a threshold below every change runs every call whole, which
  is the uncached image bit for bit (the full pass is the UNet's own output).
- A cached run of our pipeline (text-to-image, image-to-image, inpainting; SD and SDXL) equals diffusers' own pipeline
  whose UNet is a reference of the same rule written here from diffusers' modules alone: after the first call, each
  call runs the UNet with the entry up layer's input replaced by the last whole call's (the shallow pass), compares
  that prediction with the last whole call's (relative mean absolute change, the batch together), and runs whole
  where it moved more than the threshold or the cap on cached calls in a row is reached. Both kinds of call happen.
- A huge threshold gives exactly the capped pattern: the fixed cache every max_skips + 1, bit for bit.
- The counts reach the report (a refiner counting its own); engines (the stand-in TensorRT) draw the torch path's
  image; what the adaptive cache does not take yet is refused in one line.
"""

import json

import numpy as np
import pytest
import torch

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
from tests.fake_tensorrt import stand_in_pipeline
from tests.parity import diffusers_images, entry_module
from tests.test_step_cache import edit_request

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731


def reference_unet(source, threshold: float, max_skips: int, branch: int):
    """diffusers' UNet under the adaptive rule, by diffusers' modules alone; its `state` records each call's change
    (None: not measured) and whether it ran whole."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(source.component_dir("unet"))
    module = entry_module(unet, branch)
    state = {"shallow": False, "kept": None, "reference": None, "in_row": 0, "changes": [], "whole": []}
    forward, module_forward = unet.forward, module.forward

    def entry_forward(*args, **kwargs):
        if state["shallow"]:
            return state["kept"]
        state["kept"] = module_forward(*args, **kwargs)
        return state["kept"]

    def prediction(output):
        return output[0] if isinstance(output, tuple) else output.sample

    def unet_forward(*args, **kwargs):
        change = None
        if state["reference"] is not None:
            state["shallow"] = True
            shallow = forward(*args, **kwargs)
            state["shallow"] = False
            now, then = prediction(shallow).float(), state["reference"].float()
            change = ((now - then).abs().mean() / then.abs().mean()).item()
            if change <= threshold and state["in_row"] < max_skips:
                state["in_row"] += 1
                state["changes"].append(change)
                state["whole"].append(False)
                return shallow
        output = forward(*args, **kwargs)
        state["reference"], state["in_row"] = prediction(output), 0
        state["changes"].append(change)
        state["whole"].append(True)
        return output

    unet.forward, module.forward = unet_forward, entry_forward
    return unet, state


def our_run(source, request: Request, cache: StepCache, branch: int, scheduler: str):
    """Our pipeline's images for `request` under `cache`, and its run's schedule."""
    models = stage_models(source, image_to_image_stages(source), branch if cache.on else None)
    stages = REFERENCE.create_stages(models, lambda _: FALLBACK, CPU, torch.float32, QUIET, QUIET)
    pipeline = make_pipeline(source, stages, scheduler, CPU, torch.float32, request.mode, cache)
    return to_uint8(pipeline(request, StageTimer(CPU))), pipeline.last_schedule


def case_request(source, mode: str) -> Request:
    size = source.native_image_size
    request = (Request("a red circle", denoising_steps=9, seed=2, height=size, width=size, guidance_scale=5.0)
               if mode == TEXT_TO_IMAGE else edit_request(source, mode))
    return request.resolved(source)


CASES = [  # model, mode, threshold, max_skips, branch, scheduler
    ("tiny", TEXT_TO_IMAGE, 0.4, 3, 0, "DDIM"),
    ("tiny", TEXT_TO_IMAGE, 0.5, 2, 2, "Euler"),
    ("tiny", IMAGE_TO_IMAGE, 0.3, 3, 1, "DDIM"),
    ("tiny", INPAINTING, 0.4, 2, 1, "DDIM"),
    ("tiny-xl", TEXT_TO_IMAGE, 0.4, 3, 0, "Euler"),
    ("tiny-xl", IMAGE_TO_IMAGE, 0.4, 3, 3, "DDIM"),
    ("tiny-xl", INPAINTING, 0.4, 2, 0, "Euler"),
]


@pytest.mark.parametrize("model, mode, threshold, max_skips, branch, scheduler", CASES)
def test_a_cached_run_equals_diffusers_with_a_reference_of_the_rule(model, mode, threshold, max_skips, branch,
                                                                    scheduler):
    source = resolve_model(model)
    request = case_request(source, mode)
    ours, schedule = our_run(source, request, StepCache(threshold=threshold, max_skips=max_skips), branch, scheduler)
    unet, state = reference_unet(source, threshold, max_skips, branch)
    theirs = diffusers_images(source, scheduler, request, unet=unet)
    measured = [change for change in state["changes"] if change is not None]
    assert min(abs(change - threshold) for change in measured) > 1e-3, "a change this close to T: pick another T"
    assert 0 < state["whole"].count(False) and state["whole"].count(True) > 1  # both kinds, beyond the first call
    assert (schedule.calls, schedule.whole_calls) == (len(state["whole"]), state["whole"].count(True))
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
    uncached, _ = our_run(source, request, StepCache(), branch, scheduler)
    assert np.abs(ours.astype(int) - uncached.astype(int)).max() > 2  # the cache changes the picture


def test_a_huge_threshold_is_the_capped_pattern_the_fixed_cache_every_cap_plus_one():
    source = resolve_model("tiny")
    request = case_request(source, TEXT_TO_IMAGE)
    adaptive, schedule = our_run(source, request, StepCache(threshold=1e9, max_skips=2), 1, "DDIM")
    fixed, _ = our_run(source, request, StepCache(interval=3), 1, "DDIM")
    assert (schedule.calls, schedule.whole_calls) == (9, 3)
    assert np.array_equal(adaptive, fixed)


def render(spec: PipelineSpec, steps: int = 8):
    with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
        result = pipeline("a red circle", seed=7, denoising_steps=steps)
        return result.pixels, set(pipeline.stages), result.report


def test_threshold_zero_is_no_cache_and_a_tiny_one_runs_every_call_whole_bit_for_bit():
    plain, _, _ = render(PipelineSpec(model="tiny", backend="torch"))
    off, off_stages, report = render(PipelineSpec(model="tiny", backend="torch", cache_threshold=0.0))
    assert np.array_equal(plain, off) and UNET_SHALLOW not in off_stages and report.cache_whole_calls is None
    every, stages, report = render(PipelineSpec(model="tiny", backend="torch", cache_threshold=1e-12))
    assert UNET_SHALLOW in stages and report.cache_whole_calls == report.unet_calls
    assert np.array_equal(plain, every)


def test_the_counts_reach_the_report_and_a_refiner_counts_its_own():
    """Base then refiner under a huge threshold, at most 2 cached in a row: 10 steps at 0.8 are 8 base calls (whole
    at 0, 3, 6) and 2 refiner calls (whole at its own first): 4 of 10."""
    _, _, report = render(PipelineSpec(model="tiny-xl", refiner="tiny-xl-refiner", backend="torch",
                                       modes=(TEXT_TO_IMAGE,), cache_threshold=1e9, cache_max_skips=2), steps=10)
    assert "adaptive step cache (threshold 1e+09, at most 2 cached in a row): 4 of 10 calls whole" in report.table()
    data = json.loads(report.to_json())
    assert (data["cache_threshold"], data["cache_max_skips"], data["cache_whole_calls"]) == (1e9, 2, 4)


def test_engines_draw_the_torch_paths_adaptive_image(tmp_path):
    """The full and shallow engines through the stand-in TensorRT, fp32, decide as the torch path does."""
    fields = dict(model="tiny", scheduler="DDIM", modes=(TEXT_TO_IMAGE,), cache_threshold=0.15, cache_branch=2)
    with stand_in_pipeline(tmp_path, **fields) as pipeline:
        result = pipeline("a red circle", seed=7, denoising_steps=8)
        engines, stages = result.pixels, set(pipeline.stages)
    torch_image, _, report = render(PipelineSpec(backend="torch", precision="fp32", **fields))
    assert UNET_SHALLOW in stages and result.report.cache_whole_calls == report.cache_whole_calls
    assert 1 < report.cache_whole_calls < report.unet_calls
    assert np.abs(engines.astype(int) - torch_image.astype(int)).max() <= 1


@pytest.mark.parametrize("fields, message", [
    (dict(model="tiny", cache_threshold=0.1, controlnets=(("tiny-controlnet", 1.0),)),
     "controlnets run without cache_threshold (the adaptive step cache) for now: use cache_interval"),
    (dict(model="tiny", cache_threshold=0.1, cache_interval=2), "cache_threshold and cache_interval are two"),
    (dict(model="tiny", cache_threshold=-0.5), "cache_threshold must be a finite number at least 0, got -0.5"),
    (dict(model="tiny-sd3", cache_forecast=True), "cache_forecast extrapolates what the adaptive step cache keeps: "
                                                  "give cache_threshold above 0"),
    (dict(model="tiny", cache_threshold=0.1, cache_forecast=True),
     "cache_forecast: model 'tiny' is of the SD 1.x/2.x family, which does not support the step cache's forecast"),
])
def test_what_the_adaptive_cache_does_not_take_is_one_line(fields, message):
    with pytest.raises(UsageError) as raised:
        load_pipeline(PipelineSpec(backend="torch", **fields), CPU, progress=QUIET)
    assert message in raised.value.render()


def test_a_sensitivity_row_renders_with_the_adaptive_cache_and_the_reference_without():
    from bench.sensitivity import exact_spec, parse_rows, row_spec

    rows = parse_rows("threshold:0.20:1,threshold:0.3")
    assert rows[1:] == ["threshold:0.2:1", "threshold:0.3:0"]
    exact = exact_spec(PipelineSpec(model="tiny", cache_threshold=0.5))
    assert exact.cache_threshold == 0.0
    spec, fault = row_spec(exact, rows[1])
    assert (spec.cache_threshold, spec.cache_branch, spec.precision, fault) == (0.2, 1, "fp16", None)
    assert not spec.cache_forecast
    (forecast,) = parse_rows("forecast:0.10")[1:]
    spec, _ = row_spec(exact_spec(PipelineSpec(model="tiny-sd3", cache_threshold=0.5, cache_forecast=True)), forecast)
    assert forecast == "forecast:0.1" and (spec.cache_threshold, spec.cache_forecast) == (0.1, True)
    for bad in ("forecast:0", "forecast:0.1:0", "forecast:x"):
        with pytest.raises(UsageError, match="an adaptive cache row is forecast:T"):
            parse_rows(bad)
