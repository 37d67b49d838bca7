"""The `scenes-sd3` built-in (SD3's family trained on the scenes world): the shipped files are the recorded ones and
what the package loads, a changed one is refused; the training script makes the shipped architecture, conditions the
transformer as diffusers' StableDiffusion3Pipeline does, and runs at a few steps; the shipped model draws diffusers'
image, and on the CPU what the fp32 reference drew on an H200, read the same way; sd-quality judges it by the scenes
yardstick at its own guidance."""

import json

import pytest
import torch
from safetensors.torch import load_file

from bench.quality import SCENES, yardstick_of
from demo.request import Request
from models import scenes, scenes_sd3
from models.families import SD3
from models.source import resolve_model
from models.stages import text_to_image_stages
from tests.conftest import ROOT
from tests.parity import check_parity, torch_stages
from tests.shipped import check_a_changed_weight_file_is_refused, check_recorded_files

NO_T5 = {"text_encoder_3": None, "tokenizer_3": None}  # what diffusers must be told of a folder naming them null
REFERENCE = ROOT / "results" / "quality-scenes-sd3-h200" / "quality-scenes-sd3-reference-torch-fp32.json"


@pytest.fixture(scope="module")
def source():
    return resolve_model("scenes-sd3")


def test_the_package_loads_the_recorded_files(source):
    assert source.path == scenes_sd3.MODEL_DIR and source.family is SD3
    assert source.default_guidance_scale == source.recommended.guidance_scale == scenes_sd3.GUIDANCE_SCALE
    assert yardstick_of("scenes-sd3") is SCENES and yardstick_of(str(scenes_sd3.MODEL_DIR)) is SCENES
    check_recorded_files(scenes_sd3)


def test_a_changed_weight_file_is_refused(tmp_path, monkeypatch):
    check_a_changed_weight_file_is_refused(scenes_sd3, "scenes-sd3", "transformer/diffusion_pytorch_model.safetensors",
                                           tmp_path, monkeypatch)


def test_the_training_script_makes_the_shipped_architecture(source):
    """SD3.5's transformer at the training's width, no T5, scenes' tokenizer and VAE (its weights unchanged)."""
    from transformers import CLIPTokenizer

    from models.scenes_sd3 import train

    shipped = source.config("transformer")
    assert {k: shipped[k] for k in train.TRANSFORMER_CONFIG} == train.TRANSFORMER_CONFIG
    assert text_to_image_stages(source) == ("clip", "clip2", "transformer", "vae")  # no T5
    assert source.native_image_size == 256 and source.latent_channels == 4
    assert source.config("vae")["shift_factor"] == 0.0
    ours, theirs = (load_file(folder / "vae" / "diffusion_pytorch_model.safetensors")
                    for folder in (scenes_sd3.MODEL_DIR, scenes.MODEL_DIR))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    vocabulary = CLIPTokenizer.from_pretrained(scenes.MODEL_DIR / "tokenizer").get_vocab()
    for tokenizer in ("tokenizer", "tokenizer_2"):
        assert CLIPTokenizer.from_pretrained(scenes_sd3.MODEL_DIR / tokenizer).get_vocab() == vocabulary
    scheduler = json.loads((scenes_sd3.MODEL_DIR / "scheduler" / "scheduler_config.json").read_text())
    assert {k: scheduler[k] for k in train.SCHEDULER} == train.SCHEDULER


def test_training_conditions_the_transformer_as_diffusers_pipeline_does(source):
    """What the transformer learns from (Prompts) is what StableDiffusion3Pipeline hands it at inference, for a
    prompt and the empty one (guidance's unconditional half): a mismatch would train one model and run another."""
    from diffusers import StableDiffusion3Pipeline

    from models.scenes_sd3.train import Prompts

    pipe = StableDiffusion3Pipeline.from_pretrained(source.path, **NO_T5, torch_dtype=torch.float32)
    prompts = Prompts(pipe.text_encoder, pipe.text_encoder_2)
    texts = ["a small red circle on the left on a blue background", ""]
    ids = pipe.tokenizer(texts, padding="max_length", max_length=pipe.tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        states, pooled = prompts(ids)
        expected, _, expected_pooled, _ = pipe.encode_prompt(texts, texts, texts, do_classifier_free_guidance=False)
    assert states.shape == expected.shape and torch.equal(states, expected)
    assert torch.equal(pooled, expected_pooled)


def test_training_runs_and_saves_a_folder_the_toolkit_loads(tmp_path):
    """The training script end to end at a few steps on the CPU (what a GPU run does at full size)."""
    from models.scenes_sd3.train import main

    assert main(["--output", str(tmp_path), "--steps", "2", "--batch", "2", "--scenes", "4", "--read-back", "0"]) == 0
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["transformer"]["steps"] == 2 and len(record["transformer"]["losses"]) == 1
    trained = resolve_model(str(tmp_path / "scenes-sd3"))
    assert trained.family is SD3 and trained.native_image_size == 256


def test_the_shipped_model_draws_diffusers_image(source):
    made = Request("two large green squares on the right on a white background", "", denoising_steps=4, seed=3,
                   guidance_scale=scenes_sd3.GUIDANCE_SCALE, height=256, width=256).resolved(source)
    check_parity(source, torch_stages(source), made.scheduler, made, **NO_T5, torch_dtype=torch.float32)


@pytest.mark.skipif(not REFERENCE.exists(), reason=f"no GPU reference report ({REFERENCE.name}) in results/")
def test_the_shipped_model_draws_on_the_cpu_what_the_reference_drew(tmp_path, monkeypatch):
    """The first cases at fp32 on the CPU against the H200's fp32 reference of the same cases: the same seeds draw the
    same scenes (their noise is drawn on the CPU), so the detector reads them the same way."""
    from bench.quality import main

    reference = json.loads(REFERENCE.read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "scenes-sd3", "--precision", "fp32", "--backend", "torch", "--cases", "8",
                 "--json", "cpu.json"]) == 0
    ours = json.loads((tmp_path / "cpu.json").read_text())
    assert ours["settings"]["guidance_scale"] == scenes_sd3.GUIDANCE_SCALE
    theirs = {case["id"]: case for case in reference["cases"]}
    same = [case["reading"] == theirs[case["id"]]["reading"] for case in ours["cases"]]
    assert sum(same) >= 4, [(case["reading"], theirs[case["id"]]["reading"]) for case in ours["cases"]]


def test_sd_quality_refuses_the_fixed_cache_for_it_in_one_line(tmp_path, capsys):
    from bench.quality import main

    assert main(["--model", "scenes-sd3", "--sensitivity", "fp16,cache:2", "--output-dir", str(tmp_path)]) == 2
    assert "model 'scenes-sd3' is of the SD3 family, which does not support the step cache" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
