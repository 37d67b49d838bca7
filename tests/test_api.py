"""The Python API refuses what it cannot take before any work (a UsageError naming the field), takes diffusers' names
for a call's fields, and is safe to call from several threads; a closed pipeline says so."""

import contextlib
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import UsageError
from demo import PipelineSpec, Request, load_pipeline
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.options import TorchOptions
from demo.runtime.loader import plan_pipeline, quiet

CPU = torch.device("cpu")
STEPS = 3  # enough for two threads' calls to overlap


def load(**fields):
    return load_pipeline(PipelineSpec(model="tiny", backend="torch", plugins="none", **fields), CPU, log=quiet,
                         progress=quiet)


@pytest.fixture(scope="module")
def pipe():
    with load() as pipeline:
        yield pipeline


def control_image() -> Image.Image:
    pixels = np.zeros((64, 64, 3), np.uint8)
    pixels[16:48, 8:40] = 255
    return Image.fromarray(pixels)


@pytest.mark.parametrize("fields, name", [
    (dict(height="64"), "height"), (dict(batch_size="2"), "batch_size"), (dict(batch_size=True), "batch_size"),
    (dict(cache_interval=2.5), "cache_interval"), (dict(controlnets=(("tiny-controlnet", "0.5"),)), "controlnets"),
    (dict(loras=((3, 1.0),)), "loras"), (dict(verbose="yes"), "verbose"),
    (dict(modes="text-to-image"), "modes"), (dict(high_noise_frac="0.5"), "high_noise_frac"),
    (dict(engine=EngineOptions(optimization_level=3).__dict__), "engine"), (dict(model=3), "model"),
])
def test_a_spec_field_of_another_type_is_refused_naming_it(fields, name):
    with pytest.raises(UsageError) as refused:
        PipelineSpec(**fields)
    assert refused.value.render().startswith(f"{name} must be "), refused.value.render()


@pytest.mark.parametrize("options, fields, name", [
    (EngineOptions, dict(optimization_level=2.0), "optimization_level"), (EngineOptions, dict(int8=1), "int8"),
    (TorchOptions, dict(channels_last="no"), "channels_last"),
])
def test_backend_options_of_another_type_are_refused_naming_them(options, fields, name):
    with pytest.raises(UsageError, match=f"^{name} must be "):
        options(**fields)


@pytest.mark.parametrize("name", ["loras", "controlnets"])
def test_a_scale_that_is_no_finite_number_is_refused(name):
    with pytest.raises(UsageError, match=f"^{name} x: the scale must be a finite number, got nan"):
        PipelineSpec(**{name: (("x", float("nan")),)}).check()


def test_values_that_stand_for_the_type_are_taken_as_it(tmp_path):
    spec = PipelineSpec(model=Path("tiny"), height=np.int64(64), loras=["a.safetensors", (Path("b"), 0.5)],
                        modes=["text-to-image"], engine=EngineOptions(onnx_dir=tmp_path))
    assert (spec.model, spec.height, type(spec.height)) == ("tiny", 64, int)
    assert spec.loras == (("a.safetensors", 1.0), ("b", 0.5))  # a file alone at scale 1, as --lora FILE
    assert spec.modes == ("text-to-image",) and spec.engine.onnx_dir == str(tmp_path)
    hash(spec)  # still frozen and hashable: lists became tuples
    request = Request(["a", "b"], seed=np.uint32(7), guidance_scale=7, control_images=control_image())
    assert request.prompt == ("a", "b") and request.seed == 7 and request.guidance_scale == 7.0
    assert isinstance(request.control_images, tuple) and len(request.control_images) == 1


@pytest.mark.parametrize("fields, name", [
    (dict(seed="42"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
    (dict(denoising_steps=2.5), "denoising_steps"), (dict(guidance_scale="7"), "guidance_scale"),
    (dict(guidance_scale=float("inf")), "guidance_scale"), (dict(control_guidance_start="0.1"),
                                                             "control_guidance_start"),
    (dict(prompt=123), "prompt"), (dict(image=3), "image"), (dict(mask=[[0]]), "mask"),
    (dict(control_images=(Image.new("RGB", (0, 0)),)), "control_images"),
    (dict(image=np.zeros((8, 8, 2), np.uint8)), "image"), (dict(image=np.full((8, 8, 3), 2.0)), "image"),
    (dict(negative_prompt=("a", "b")), "negative_prompt"), (dict(strength="1"), "strength"),
    (dict(guess_mode=1), "guess_mode"),
])
def test_a_call_field_of_another_type_is_refused_naming_it(pipe, fields, name, monkeypatch):
    monkeypatch.setattr(type(pipe), "run", lambda *_, **__: pytest.fail("a request was run before it was checked"))
    fields = {"prompt": "a circle", **fields}
    with pytest.raises(UsageError) as refused:
        pipe(fields.pop("prompt"), **fields)
    assert refused.value.render().startswith(name), refused.value.render()


def test_an_image_may_be_a_path_or_a_numpy_array(pipe, tmp_path):
    image = control_image()
    image.save(tmp_path / "start.png")
    runs = [pipe("a circle", image=given, seed=1, denoising_steps=2).pixels
            for given in (image, tmp_path / "start.png", np.asarray(image), np.asarray(image) / 255.0)]
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)


def test_diffusers_names_draw_our_names_image(pipe):
    ours = pipe("a circle", denoising_steps=2, seed=3, batch_size=2)
    generator = torch.Generator().manual_seed(3)
    theirs = pipe("a circle", num_inference_steps=2, generator=generator, num_images_per_prompt=2, output_type="np")
    assert theirs.images.dtype == np.float32 and theirs.images.shape == (2, 64, 64, 3)
    np.testing.assert_array_equal(ours.pixels, (theirs.images * 255).round().astype(np.uint8))
    tensor = pipe("a circle", num_inference_steps=2, seed=3, output_type="pt").images
    array = pipe("a circle", num_inference_steps=2, seed=3, output_type="np").images
    assert tensor.shape == (1, 3, 64, 64)
    np.testing.assert_array_equal(tensor.permute(0, 2, 3, 1).numpy(), array)


def test_a_call_field_that_does_nothing_is_a_warning_at_the_callers_line(pipe):
    with pytest.warns(UserWarning, match="guess_mode unused without ControlNets") as caught:
        pipe("a circle", guess_mode=True, denoising_steps=1)
    assert caught[0].filename == __file__


@pytest.mark.parametrize("fields, message", [
    (dict(num_steps=2), "unknown field(s) num_steps; a call takes prompt, negative_prompt"),
    (dict(num_inference_steps=2, denoising_steps=3), "denoising_steps given twice (also as"),
    (dict(generator=3), "generator must be one torch.Generator"),
    (dict(output_type="latent"), "output_type must be one of pil, np, pt"),
    (dict(batch_size=10**6), "needs at least"),  # a call's batch against the memory there is
])
def test_a_call_it_cannot_take_is_one_usage_error(pipe, fields, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipe("a circle", **fields)


def test_run_without_requests_and_unknown_devices_are_usage_errors(pipe):
    with pytest.raises(UsageError, match="at least, got none"):
        pipe.run([])
    spec = PipelineSpec(model="tiny", backend="torch")
    with pytest.raises(UsageError, match="is no torch device"):
        plan_pipeline(spec, "bogus")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="this machine has 0 CUDA device"):
            plan_pipeline(spec, "cuda")


def test_a_cache_branch_the_unet_lacks_is_refused_with_the_cache_off():
    with pytest.raises(UsageError, match="cache_branch 99: this UNet's skip branches are 0 to"):
        plan_pipeline(PipelineSpec(model="tiny", backend="torch", cache_branch=99), CPU)


def test_controlnet_fields_without_controlnets_are_noted():
    notes = Request("x", guess_mode=True, control_guidance_end=0.5).unused()
    assert [note.replace("\x1f", "") for note in notes] == [
        "control_guidance_end, guess_mode unused without ControlNets"]
    assert Request("x", guess_mode=True, control_images=(control_image(),)).unused() == []


def race(pipeline, calls: list[dict]) -> list[np.ndarray]:
    """Each call's pixels, the calls made at once from their own threads."""
    start, results = threading.Barrier(len(calls)), [None] * len(calls)

    def call(index):
        start.wait()
        try:
            results[index] = pipeline("a circle", **calls[index]).pixels
        except Exception as exc:  # noqa: BLE001 - shown by the test, not lost in its thread
            results[index] = exc

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


@pytest.mark.parametrize("fields, call", [
    ({}, {}), (dict(controlnets=(("tiny-controlnet", 1.0),)), dict(control_images=(control_image(),))),
    (dict(cache_interval=2), {}), (dict(cache_threshold=0.3), {}),
], ids=["plain", "controlnet", "step-cache", "adaptive-step-cache"])
def test_two_threads_on_one_pipeline_get_their_lone_images(pipe, fields, call):
    calls = [dict(call, seed=seed, denoising_steps=STEPS) for seed in (1, 2)]
    with load(**fields) if fields else contextlib.nullcontext(pipe) as pipeline:
        alone = [pipeline("a circle", **fields_).pixels for fields_ in calls]
        together = race(pipeline, calls)
    for lone, raced in zip(alone, together):
        np.testing.assert_array_equal(lone, raced)


def test_a_closed_pipeline_says_so_for_every_method():
    pipeline = load()
    request = pipeline.request("a circle", denoising_steps=1)
    pipeline.close()
    pipeline.close()  # idempotent
    calls = [lambda: pipeline("a circle"), lambda: pipeline.run([request]), lambda: pipeline.request("x"),
             lambda: pipeline.set_loras([]), lambda: pipeline.unet_calls(request), lambda: pipeline.stats(),
             lambda: pipeline.family("text-to-image"), lambda: pipeline.dropped_text("x"),
             lambda: pipeline.timed_runs(request, 0, 1), lambda: pipeline.__enter__()]
    for call in calls:
        with pytest.raises(UsageError, match="^this pipeline is closed"):
            call()
