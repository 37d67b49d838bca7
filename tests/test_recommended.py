"""A model's and a LoRA's recommended settings (models.recommended): a request that leaves its steps, guidance scale
or scheduler out gets what a LoRA says (its metadata, or the step count in its file's name), then what the model says
(its pipeline class: LCM's 4 steps at 8.5; a shipped model's own scale), then the scheduler's step count (LCM, TCD:
4) and the toolkit's defaults; what a request gives is kept; a bad recommendation is one line."""

import shutil

import pytest
from safetensors.torch import load_file, save_file

from core.errors import UsageError, render_fields
from demo.request import Request, recommendation_note
from demo.runtime.loader import load_pipeline, plan_pipeline, quiet
from demo.runtime.plan import lora_recommendations
from demo.runtime.spec import PipelineSpec
from models.lora import read_lora
from models.recommended import RECOMMENDED_METADATA, STEPS_IN_NAME, Recommended, metadata_of
from models.shapes import LCM_LORA, OUTLINE_LORA
from models.source import resolve_model
from tests.test_cli import run_demo

PROMPT = "a small green triangle on the right on a yellow background"
SETTINGS = ("denoising_steps", "guidance_scale", "scheduler")


def planned(request: Request, **spec) -> Request:
    plan = plan_pipeline(PipelineSpec(backend="torch", **spec), "cpu", request=request, log=quiet, progress=quiet)
    return plan.request


def settings(request: Request) -> tuple:
    return tuple(getattr(request, name) for name in SETTINGS)


def test_the_shipped_lcm_lora_runs_four_lcm_steps_without_guidance_unless_the_request_says():
    assert settings(planned(Request(PROMPT, seed=0), model="shapes")) == (50, 3.0, "PNDM")  # the model's own
    assert settings(planned(Request(PROMPT, seed=0), model="shapes", loras=("shapes-lcm",))) == (4, 1.0, "LCM")
    given = Request(PROMPT, seed=0, denoising_steps=6, guidance_scale=2.0, scheduler="Euler")
    assert settings(planned(given, model="shapes", loras=("shapes-lcm",))) == (6, 2.0, "Euler")
    # explicit timesteps set the count, not the recommendation
    timed = Request(PROMPT, seed=0, timesteps=(999, 499))
    assert planned(timed, model="shapes", loras=("shapes-lcm",)).denoising_steps == 2
    # the first LoRA that says wins; one that says nothing gives nothing
    both = planned(Request(PROMPT, seed=0), model="shapes", loras=("shapes-outline", "shapes-lcm"))
    assert settings(both) == (4, 1.0, "LCM")


def test_the_trainer_writes_what_the_lora_reads():
    """The shipped file's metadata is what train_lcm.RECOMMENDED writes (the file would not say it otherwise)."""
    from models.shapes.train_lcm import RECOMMENDED

    assert read_lora(LCM_LORA).recommended == Recommended(**{name: getattr(RECOMMENDED, name) for name in SETTINGS},
                                                          by=f"LoRA {LCM_LORA}")
    assert read_lora("shapes-lcm").recommended.by == "LoRA shapes-lcm"
    assert not read_lora(OUTLINE_LORA).recommended


@pytest.mark.parametrize("name, steps", [("Hyper-SD15-1step-lora", 1), ("Hyper-SDXL-8steps-CFG-lora", 8),
                                         ("sdxl_lightning_4step_lora", 4), ("Hyper-SDXL-12steps-lora", 12),
                                         ("lcm-lora-sdv1-5", None), ("style-v1.5", None), ("steps", None),
                                         ("lora-1500step-s", None), ("my-2steps_lora", 2)])
def test_a_step_count_in_a_file_name(name, steps):
    found = STEPS_IN_NAME.search(name)
    assert (int(found.group(1)) if found else None) == steps


def test_a_lora_named_for_its_steps_runs_them(tmp_path):
    """Hyper-SD's and SDXL-Lightning's files say their steps in their names, as a file or as a folder's diffusers
    file; the metadata says first."""
    named = tmp_path / "Hyper-SD15-2steps-lora.safetensors"
    shutil.copy(OUTLINE_LORA, named)
    assert planned(Request(PROMPT, seed=0), model="shapes", loras=(str(named),)).denoising_steps == 2
    folder = tmp_path / "shapes-8steps-lora"
    folder.mkdir()
    shutil.copy(OUTLINE_LORA, folder / "pytorch_lora_weights.safetensors")
    assert read_lora(folder).recommended.denoising_steps == 8
    said = tmp_path / "Hyper-SD15-2steps-said.safetensors"
    save_file(load_file(OUTLINE_LORA), said, metadata_of(Recommended(denoising_steps=3)))
    assert read_lora(said).recommended.denoising_steps == 3


def test_an_lcm_model_folder_and_the_few_step_schedulers_recommend_four_steps(tiny):
    lcm = resolve_model("tiny-lcm")
    assert settings(Request(PROMPT, seed=0).resolved(lcm)) == (4, 8.5, "LCM")  # diffusers' LCM pipelines' defaults
    assert Request(PROMPT, seed=0, scheduler="TCD").resolved(tiny).denoising_steps == 4
    assert Request(PROMPT, seed=0, scheduler="LCM").resolved(tiny).denoising_steps == 4
    assert settings(Request(PROMPT, seed=0).resolved(tiny)) == (50, 7.5, "PNDM")


@pytest.mark.parametrize("metadata, message", [
    ("{not json", "is not JSON"), ("[4]", "is not a JSON object"), ('{"steps": 4}', "names steps"),
    ('{"denoising_steps": 0}', "not a whole number of 1 or more"), ('{"denoising_steps": 2.5}', "not a whole"),
    ('{"guidance_scale": -1}', "not a finite number"), ('{"scheduler": 3}', "not a name")])
def test_bad_recommendations_are_one_line(tmp_path, metadata, message):
    path = tmp_path / "bad.safetensors"
    save_file(load_file(OUTLINE_LORA), path, {RECOMMENDED_METADATA: metadata})
    with pytest.raises(UsageError, match=message) as error:
        read_lora(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_a_recommended_scheduler_we_lack_names_the_lora(tmp_path):
    path = tmp_path / "odd.safetensors"
    save_file(load_file(OUTLINE_LORA), path, metadata_of(Recommended(scheduler="HeunDiscrete")))
    with pytest.raises(UsageError, match=f"LoRA {path} recommends scheduler 'HeunDiscrete'.*scheduler"):
        planned(Request(PROMPT, seed=0), model="shapes", loras=(str(path),))
    assert planned(Request(PROMPT, seed=0, scheduler="DDIM"), model="shapes", loras=(str(path),)).scheduler == "DDIM"


def test_the_note_names_what_was_taken_and_who_said_so():
    given = Request(PROMPT, seed=0, guidance_scale=2.0)
    lora = read_lora("shapes-lcm")
    source = resolve_model("shapes")
    resolved = given.resolved(source, recommended=(lora.recommended,))
    note = recommendation_note(given, resolved, (*lora_recommendations([(lora, 1.0)]), source.recommended))
    assert render_fields(note) == "denoising_steps 4, scheduler LCM: as LoRA shapes-lcm recommends"
    assert recommendation_note(resolved, resolved, (lora.recommended,)) is None


def test_the_command_line_notes_it(tmp_path):
    result = run_demo(PROMPT, "--model", "shapes", "--lora", "shapes-lcm", "--output-dir", tmp_path, "--seed", 0,
                      "--height", 64, "--width", 64)
    assert result.returncode == 0, result.stderr
    assert ("note: --denoising-steps 4, --guidance-scale 1.0, --scheduler LCM: as LoRA shapes-lcm recommends"
            in result.stderr)
    assert "UNet x 4" in result.stdout


def test_a_pipeline_follows_the_loras_it_has_now():
    """The Python API's pipeline resolves each call against the LoRAs set on it, not those it was loaded with."""
    with load_pipeline(PipelineSpec(model="shapes", backend="torch", height=64, width=64), "cpu") as pipeline:
        assert settings(pipeline.request(PROMPT)) == (50, 3.0, "PNDM")
        pipeline.set_loras([("shapes-lcm", 1.0)])
        assert settings(pipeline.request(PROMPT)) == (4, 1.0, "LCM")
        pipeline.set_loras([])
        assert settings(pipeline.request(PROMPT)) == (50, 3.0, "PNDM")
