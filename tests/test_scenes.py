"""The `scenes` built-in: the shipped files are the recorded ones and what the package loads, a changed one is refused,
the training script makes the shipped architecture and tokenizer and its stages run at a few steps, and the shipped
model draws on the CPU what the fp32 reference drew on an H200 (results/quality-scenes-h200), read the same way."""

import json

import torch

from models import scenes
from models.source import resolve_model
from tests.conftest import ROOT
from tests.shipped import check_a_changed_weight_file_is_refused, check_recorded_files

REFERENCE = ROOT / "results" / "quality-scenes-h200" / "quality-scenes-reference-torch-fp32.json"


def test_the_package_loads_the_recorded_files():
    source = resolve_model("scenes")
    assert source.path == scenes.MODEL_DIR and source.default_guidance_scale == scenes.GUIDANCE_SCALE
    check_recorded_files(scenes)


def test_a_changed_weight_file_is_refused(tmp_path, monkeypatch):
    check_a_changed_weight_file_is_refused(scenes, "scenes", "unet/diffusion_pytorch_model.safetensors", tmp_path,
                                           monkeypatch)


def test_the_training_script_makes_the_shipped_architecture_and_tokenizer():
    from transformers import CLIPTokenizer

    from models.scenes import train

    for name, config in (("unet", train.UNET_CONFIG), ("vae", train.VAE_CONFIG), ("text_encoder", train.TEXT_CONFIG)):
        shipped = json.loads((scenes.MODEL_DIR / name / "config.json").read_text())
        assert {k: shipped[k] for k in config} == config, name
    shipped = CLIPTokenizer.from_pretrained(scenes.MODEL_DIR / "tokenizer")
    assert shipped.get_vocab() == train.tokenizer().get_vocab()


def test_every_training_stage_runs_and_saves_a_folder_the_toolkit_loads(tmp_path):
    """The training script's stages at a few steps on the CPU (what a GPU run does at full size)."""
    from models.scenes import train

    cpu = torch.device("cpu")
    vae, record = train.shapes_train.train_vae(cpu, 1, 2, 0, scale_samples=4, config=train.VAE_CONFIG,
                                               data=train.Scenes(cpu, 0))
    assert record["steps"] == 1 and vae.config.scaling_factor > 0
    tok, text, unet, record = train.shapes_train.train_text_unet(vae, cpu, 2, 2, 1, float("inf"), 0, 4, world=train)
    assert record["steps"] == 2
    train.shapes_train.pipeline(vae, text, tok, unet).to(torch.float16).save_pretrained(tmp_path / "scenes")
    source = resolve_model(str(tmp_path / "scenes"))
    assert source.config("vae")["block_out_channels"] == train.VAE_CONFIG["block_out_channels"]
    assert source.native_image_size == 256


def test_the_shipped_model_draws_on_the_cpu_what_the_reference_drew(tmp_path, capsys, monkeypatch):
    """The first cases at fp32 on the CPU, against the H200's fp32 reference of the same cases: the same seeds draw
    the same scenes (their noise is drawn on the CPU), so the detector reads them the same way; a broken model, a
    broken detector or a changed case set fails here."""
    from bench.quality import main

    reference = json.loads(REFERENCE.read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "scenes", "--precision", "fp32", "--backend", "torch", "--cases", "8",
                 "--json", "cpu.json"]) == 0
    ours = json.loads((tmp_path / "cpu.json").read_text())
    theirs = {case["id"]: case for case in reference["cases"]}
    same = [case["reading"] == theirs[case["id"]]["reading"] for case in ours["cases"]]
    assert sum(same) >= 4, [(case["reading"], theirs[case["id"]]["reading"]) for case in ours["cases"]]
    accuracy = ours["summary"]["text-to-image"]["accuracy"]
    assert accuracy["place"] >= 0.4 and accuracy["background"] >= 0.5, accuracy
