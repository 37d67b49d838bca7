"""The family registry (models.families): each model's family chosen from its own config, its guidance kind carried
through request, pipeline, stages and step cache (a UNet that embeds the guidance scale, as LCM's do, draws diffusers'
image), and what a family lacks refused naming it."""

import json
import shutil

import numpy as np
import pytest
import torch

from core.errors import UsageError
from demo.backends.registry import REFERENCE
from demo.backends.torch.settings import FALLBACK
from demo.pipelines import StageTimer, make_pipeline, to_uint8
from demo.request import Request
from models.families import CLASSIFIER_FREE, EMBEDDED, NO_GUIDANCE, SD, SDXL
from models.source import resolve_model
from models.stages import stage_models, text_to_image_stages
from models.step_cache import StepCache
from models.unet import TIMESTEP_COND, UNetModel
from tests.parity import check_parity, diffusers_images, reference_unet, torch_stages

CPU = torch.device("cpu")
QUIET = lambda *_: None  # noqa: E731
GUIDANCE_WIDTH = 16


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """`tiny` with a UNet that embeds the guidance scale (time_cond_proj_dim, as LCM's UNets), random weights."""
    from diffusers import UNet2DConditionModel

    tiny = resolve_model("tiny")
    folder = tmp_path_factory.mktemp("embedded") / "model"
    shutil.copytree(tiny.path, folder)
    shutil.rmtree(folder / "unet")
    torch.manual_seed(7)
    config = {key: value for key, value in tiny.denoiser_config.items() if not key.startswith("_")}
    UNet2DConditionModel(**{**config, "time_cond_proj_dim": GUIDANCE_WIDTH}).save_pretrained(folder / "unet")
    return resolve_model(str(folder))


def test_each_model_s_family_comes_from_its_own_config(tmp_path):
    assert resolve_model("tiny").family is SD and resolve_model("tiny-inpaint").family is SD
    assert resolve_model("tiny-xl").family is SDXL
    refiner = resolve_model("tiny-xl-refiner")
    assert refiner.family is SDXL and "text_encoder" not in refiner.components
    assert SDXL.can_refine(refiner.components) and not SD.can_refine(resolve_model("tiny").components)
    # without model_index.json, the UNet's config decides: an SDXL UNet's added conditions
    for model, family in (("tiny", SD), ("tiny-xl", SDXL)):
        folder = tmp_path / model
        shutil.copytree(resolve_model(model).path, folder)
        (folder / "model_index.json").unlink()
        assert resolve_model(str(folder)).family is family
        assert set(resolve_model(str(folder)).components) >= {"text_encoder", "unet", "vae"}


def test_a_pipeline_no_family_runs_is_refused_in_one_line_naming_it(tmp_path):
    folder = tmp_path / "pixart"
    shutil.copytree(resolve_model("tiny").path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "PixArtAlphaPipeline"}))
    with pytest.raises(UsageError) as raised:
        resolve_model(str(folder))
    assert "names PixArtAlphaPipeline, which no family here runs (families: SD 1.x/2.x, SDXL, SD3, Flux.1)" in \
        str(raised.value)


def test_guidance_kinds_follow_the_model_and_the_scale(embedded):
    tiny = resolve_model("tiny")
    assert tiny.guidance == CLASSIFIER_FREE and embedded.guidance == EMBEDDED
    assert Request("x", guidance_scale=5.0).resolved(tiny).guided
    assert Request("x", guidance_scale=1.0).resolved(tiny).guidance == NO_GUIDANCE
    request = Request("x", guidance_scale=5.0, negative_prompt="blurry").resolved(embedded)
    assert request.guidance == EMBEDDED and not request.guided  # one half: the batch is not doubled
    assert any("the model embeds" in note for note in request.unused())  # no unconditional half to read it
    model = UNetModel(embedded)
    assert TIMESTEP_COND in model.input_names and TIMESTEP_COND not in UNetModel(tiny).input_names
    assert model.input_shapes(3, 64, 64)[TIMESTEP_COND] == (3, GUIDANCE_WIDTH)


def test_an_embedded_guidance_unet_draws_diffusers_image(embedded):
    """diffusers' StableDiffusionPipeline passes such a UNet the scale's embedding (timestep_cond) and skips the
    unconditional half; so do we, and the scale changes the picture."""
    stages = torch_stages(embedded)
    request = Request("a red circle", denoising_steps=4, seed=3, guidance_scale=6.0).resolved(embedded)
    ours = check_parity(embedded, stages, "DDIM", request)
    weaker = Request("a red circle", denoising_steps=4, seed=3, guidance_scale=2.0).resolved(embedded)
    other = to_uint8(make_pipeline(embedded, stages, "DDIM", CPU, torch.float32)(weaker, StageTimer(CPU)))
    assert np.abs(ours.astype(int) - other.astype(int)).max() > 2


def test_the_step_cache_keeps_the_guidance_embedding(embedded):
    """A cached run of an embedded-guidance UNet equals diffusers' pipeline on a reference-cached UNet: both passes
    read the scale's embedding."""
    request = Request("a red circle", denoising_steps=6, seed=5, guidance_scale=6.0).resolved(embedded)
    models = stage_models(embedded, text_to_image_stages(embedded), cache_branch=1)
    stages = REFERENCE.create_stages(models, lambda _: FALLBACK, CPU, torch.float32, QUIET, QUIET)
    ours = to_uint8(make_pipeline(embedded, stages, "DDIM", CPU, torch.float32, cache=StepCache(2))(request,
                                                                                                StageTimer(CPU)))
    theirs = diffusers_images(embedded, "DDIM", request, unet=reference_unet(embedded, 2, 1))
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2 and ours.std() > 5


def test_a_loaded_pipeline_runs_an_embedded_guidance_model_from_a_spec(embedded):
    from demo import PipelineSpec, load_pipeline

    spec = PipelineSpec(model=str(embedded.path), backend="torch", plugins="none")
    with load_pipeline(spec, CPU, progress=QUIET) as pipe:
        result = pipe("a red circle", seed=3, denoising_steps=4, guidance_scale=6.0, scheduler="DDIM")
        unet = pipe.stages["unet"]
    assert np.asarray(result.images[0]).std() > 5
    assert unet.model.guidance_width == GUIDANCE_WIDTH


def test_a_feature_the_family_lacks_is_refused_naming_the_family(monkeypatch):
    from dataclasses import replace

    from demo import PipelineSpec
    from demo.runtime.loader import plan_pipeline
    from models import families

    without = replace(SD, features=SD.features - {families.STEP_CACHE})
    monkeypatch.setattr("models.source.family_of", lambda *_: without)
    with pytest.raises(UsageError) as raised:
        plan_pipeline(PipelineSpec(model="tiny", backend="torch", cache_interval=2), CPU, progress=QUIET)
    assert "model 'tiny' is of the SD 1.x/2.x family, which does not support the step cache" in raised.value.render()


def test_an_embedded_guidance_unet_exports_the_embedding_as_an_engine_input(embedded, tmp_path):
    """The ONNX engines are built from takes `timestep_cond` (batch-dynamic) and computes what the torch stage does."""
    import onnxruntime

    model = UNetModel(embedded)
    path = tmp_path / "onnx" / "unet.onnx"
    path.parent.mkdir()
    model.export_onnx(path, "cpu", torch.float32)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert TIMESTEP_COND in [item.name for item in session.get_inputs()]
    inputs = model.sample_inputs(3, 64, 64, generator=torch.Generator().manual_seed(2))  # not the export's batch
    with torch.no_grad():
        expected = model.load_module().eval()(*(inputs[name] for name in model.input_names))
    (got,) = session.run(None, {name: value.numpy() for name, value in inputs.items()})
    assert np.abs(got - expected.numpy()).max() < 1e-4
    inputs[TIMESTEP_COND] = inputs[TIMESTEP_COND] * 3  # the embedding reaches the output
    (other,) = session.run(None, {name: value.numpy() for name, value in inputs.items()})
    assert np.abs(other - got).max() > 1e-3
