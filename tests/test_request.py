"""The request model's guidance scale: left out, it is the model's own (3 for the shipped `shapes`, which
over-saturates its colours at 7.5; 7.5 for every other model), filled in when the request is resolved, by the CLI,
the Python API, sd-serve and the INT8 calibration alike; given, it is kept. Before resolution a request without one
is checked, batched and noted as the model's own."""

import math
from pathlib import Path

import pytest

from core.errors import UsageError
from demo.request import Request, batch_key, is_guided
from models import shapes
from models.source import DEFAULT_GUIDANCE_SCALE, ModelSource, resolve_model


@pytest.fixture(scope="module")
def shapes_model() -> ModelSource:
    return resolve_model("shapes")


def test_the_defaults_are_the_documented_numbers():
    """The two facts, each defined once: 7.5 for models at large, the shapes model's own 3 (results/quality-shapes)."""
    assert DEFAULT_GUIDANCE_SCALE == 7.5
    assert shapes.GUIDANCE_SCALE == 3.0
    assert Request("a").guidance_scale is None  # the model's own, until resolved


def test_a_request_without_guidance_resolves_to_the_models_own(tiny, shapes_model):
    assert tiny.default_guidance_scale == 7.5
    assert Request("a").resolved(tiny).guidance_scale == 7.5
    assert shapes_model.path == shapes.MODEL_DIR
    assert shapes_model.default_guidance_scale == 3.0
    assert Request("a").resolved(shapes_model).guidance_scale == 3.0


def test_the_shipped_folder_is_known_by_its_path_not_its_name(tiny):
    """The shipped folder named by a path that is not spelled as the package's (relative, through '..') is still
    shapes; a folder merely named 'shapes' is not."""
    roundabout = shapes.MODEL_DIR.parent / ".." / "shapes" / "model"
    assert ModelSource("some/path", Path(roundabout)).default_guidance_scale == 3.0
    assert ModelSource("shapes", tiny.path).default_guidance_scale == 7.5


@pytest.mark.parametrize("given", [7.5, 1.0, 0.0, 12.0])
def test_a_given_guidance_scale_is_kept(shapes_model, tiny, given):
    for source in (shapes_model, tiny):
        assert Request("a", guidance_scale=given).resolved(source).guidance_scale == given


def test_an_unresolved_request_is_checked_and_noted_as_the_models_own():
    """check_inputs (before any model) checks a scale only where one is given; a negative prompt with the model's own
    scale is used (every model's own scale guides), one at a given 1 is noted as unused."""
    Request("a").check_inputs()
    for bad in (float("nan"), math.inf, -1.0):
        with pytest.raises(UsageError, match="guidance_scale must be a finite number, 0 or more"):
            Request("a", guidance_scale=bad).check_inputs()
    assert is_guided(None) and Request("a").guided
    assert is_guided(DEFAULT_GUIDANCE_SCALE) and is_guided(shapes.GUIDANCE_SCALE)  # what is_guided(None) claims
    assert Request("a", negative_prompt="blurry").unused() == []
    assert len(Request("a", negative_prompt="blurry", guidance_scale=1.0).unused()) == 1


def test_batch_keys_compare_resolved_scales(tiny, shapes_model):
    """sd-serve batches resolved requests: one left to the model shares a call with one giving the model's own scale,
    not with one giving another."""
    def key(source, **fields):
        return batch_key(Request("a", height=64, width=64, scheduler="DDIM", seed=0, **fields).resolved(source))

    assert key(tiny) == key(tiny, guidance_scale=7.5)
    assert key(shapes_model) == key(shapes_model, guidance_scale=3.0)
    assert key(shapes_model) != key(shapes_model, guidance_scale=7.5)


def test_the_flag_defaults_to_the_models_own_and_a_given_one_is_kept(tmp_path):
    """demo-diffusion's --guidance-scale: unset it is None and its help names both defaults; the plan a command makes
    (before anything loads) resolves it to 4 on shapes, and keeps an explicit 7.5 there."""
    from demo.cli.flags import parse_flags
    from demo.cli.generate import build_parser
    from demo.cli.to_spec import request_from_flags, spec_from_flags
    from demo.runtime.loader import plan_pipeline, quiet

    parser = build_parser()
    helped = " ".join(parser.format_help().split())
    assert "(default: what a LoRA or the model recommends, else the model's own: 3 for shapes, 7.5 otherwise)" in helped
    prompt = "a small green triangle on the right on a yellow background"
    for extra, expected in (([], 3.0), (["--guidance-scale", "7.5"], 7.5)):
        flags = parse_flags(parser, [prompt, "--model", "shapes", "--backend", "torch", "--output-dir",
                                     str(tmp_path), *extra])
        request = request_from_flags(flags)
        assert request.guidance_scale == (None if not extra else 7.5)
        plan = plan_pipeline(spec_from_flags(flags, batch_size=request.batch_size), "cpu", request=request, log=quiet,
                             progress=quiet)
        assert plan.request.guidance_scale == expected


def test_the_client_and_load_test_leave_it_to_the_server():
    """sd-serve's client and load test send no guidance_scale unless given, so the server's model decides."""
    from bench.loadtest import LoadFlags
    from demo.cli.client import ClientRequestFlags
    from demo.serve.client import request_inputs

    class Triton:  # tritonclient's InferInput, as far as request_inputs uses it
        class InferInput:
            def __init__(self, name, shape, dtype):
                self.name = name

            def set_data_from_numpy(self, array):
                self.array = array

    assert ClientRequestFlags("a").guidance_scale is None and LoadFlags().guidance_scale is None
    sent = {item.name: item.array for item in request_inputs(Triton, {"prompt": "a", "guidance_scale": None},
                                                             "text-to-image")}
    assert set(sent) == {"prompt"}
    sent = {item.name: item.array for item in request_inputs(Triton, {"prompt": "a", "guidance_scale": 7.5},
                                                             "text-to-image")}
    assert sent["guidance_scale"].tolist() == [[7.5]]


def test_int8_calibrates_at_the_models_own_scale(tiny, shapes_model, tmp_path):
    """The INT8 calibration renders at the scale a request that gives none gets: its cache key says which."""
    from demo.backends.base import Workload
    from demo.backends.tensorrt.options import EngineOptions
    from demo.backends.tensorrt.settings import int8_settings

    options = EngineOptions(int8=True, onnx_dir=str(tmp_path))
    for source, expected in ((tiny, 7.5), (shapes_model, 3.0)):
        int8 = int8_settings(options, source, Workload(1, 64, 64), record_activations=None)
        assert int8.key["guidance_scale"] == expected
