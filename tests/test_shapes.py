"""The `shapes` built-in: the shipped files are the recorded ones and what the package loads, the training scripts
make this architecture and tokenizer and its ControlNet's, the detector reads the renderer and the ControlNet's
silhouettes. What the model and its ControlNet draw is read by sd-quality's own test (tests/test_quality.py)."""

import json
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.errors import RunFailure
from models import shapes
from models.controlnet import resolve_controlnet
from models.shapes.detector import read_image
from models.shapes.scenes import COLOURS, POSITIONS, SHAPES, SIZES, Scene, random_scene, render
from models.source import resolve_model

MAX_MODEL_BYTES, MAX_LORA_BYTES, MAX_CONTROLNET_BYTES = 25_000_000, 2_000_000, 10_000_000


def test_the_package_loads_the_recorded_files():
    source = resolve_model("shapes")
    assert source.path == shapes.MODEL_DIR
    recorded = shapes.shipped_files()
    on_disk = {p.relative_to(shapes.HERE).as_posix() for folder in (shapes.MODEL_DIR, shapes.CONTROLNET_DIR)
               for p in folder.rglob("*") if p.is_file()}
    loras = (shapes.OUTLINE_LORA, shapes.LCM_LORA)
    assert on_disk | {lora.name for lora in loras} == set(recorded)  # nothing shipped unrecorded, nothing missing
    assert shapes.damage() is None
    weights = [shapes.HERE / p for p in recorded if p.endswith(".safetensors") and p.startswith("model/")]
    assert sum(p.stat().st_size for p in weights) <= MAX_MODEL_BYTES
    assert all(lora.stat().st_size <= MAX_LORA_BYTES for lora in loras)
    controlnet = shapes.CONTROLNET_DIR / "diffusion_pytorch_model.safetensors"
    assert controlnet.stat().st_size <= MAX_CONTROLNET_BYTES
    assert resolve_controlnet("shapes-controlnet").path == shapes.CONTROLNET_DIR
    for path in [*weights, *loras, controlnet]:
        with safe_open(path, "pt") as weights_file:
            assert {weights_file.get_tensor(k).dtype for k in weights_file.keys()} == {torch.float16}


@pytest.mark.parametrize("damaged, load, message", [
    ("model/unet/diffusion_pytorch_model.safetensors", lambda: resolve_model("shapes"),
     "damaged .*unet/diffusion_pytorch_model.safetensors.*reinstall"),
    ("controlnet/diffusion_pytorch_model.safetensors", lambda: resolve_controlnet("shapes-controlnet"),
     "shapes-controlnet: .*damaged .*controlnet/diffusion_pytorch_model.safetensors.*reinstall"),
], ids=["model", "controlnet"])
def test_a_changed_weight_file_is_refused(tmp_path, monkeypatch, damaged, load, message):
    copy = tmp_path / "shapes"
    shutil.copytree(shapes.HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    weights = copy / damaged
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(shapes, "HERE", copy)
    with pytest.raises(RunFailure, match=message):
        load()


def test_a_silhouette_is_its_scene_white_on_black():
    """The control image shapes-controlnet is steered by: the detector reads it as the scene's shape, position and
    size, white on black."""
    from models.shapes.scenes import silhouette

    rng = random.Random(3)
    for scene in (random_scene(rng) for _ in range(30)):
        assert read_image(silhouette(scene)).as_dict() == {**scene.__dict__, "colour": "white", "background": "black"}


def test_the_controlnet_training_saves_a_controlnet_for_shapes(tmp_path):
    """The ControlNet's training at a few steps on the CPU: its folder loads as a ControlNet that fits the shipped
    model, in the shipped one's architecture; only the ControlNet changed (the model's files are still the recorded
    ones, checked by damage())."""
    from models.shapes import train_controlnet

    assert train_controlnet.main(["--output", str(tmp_path), "--steps", "2", "--scenes", "8", "--batch", "2",
                                  "--read-back", "0"]) == 0
    made = resolve_controlnet(str(tmp_path / "controlnet"))
    made.check_for(resolve_model("shapes"))
    assert json.loads((tmp_path / "controlnet-training.json").read_text())["controlnet"]["steps"] == 2
    shipped = json.loads((shapes.CONTROLNET_DIR / "config.json").read_text())
    assert {k: v for k, v in made.config.items() if not k.startswith("_")} == {
        k: v for k, v in shipped.items() if not k.startswith("_")}
    assert shapes.damage() is None


def test_the_training_script_makes_the_shipped_architecture_and_tokenizer():
    from models.shapes import train

    unet = json.loads((shapes.MODEL_DIR / "unet" / "config.json").read_text())
    vae = json.loads((shapes.MODEL_DIR / "vae" / "config.json").read_text())
    text = json.loads((shapes.MODEL_DIR / "text_encoder" / "config.json").read_text())
    assert {k: unet[k] for k in train.UNET_CONFIG} == train.UNET_CONFIG
    assert {k: vae[k] for k in train.VAE_CONFIG} == train.VAE_CONFIG
    assert {k: text[k] for k in train.TEXT_CONFIG} == train.TEXT_CONFIG
    from transformers import CLIPTokenizer

    shipped = CLIPTokenizer.from_pretrained(shapes.MODEL_DIR / "tokenizer")
    made = train.tokenizer()
    assert shipped.get_vocab() == made.get_vocab()
    # Every word a prompt uses is one token, so the text encoder saw each word whole.
    words = {*SHAPES, *COLOURS, *SIZES, "background", *(w for _, p in POSITIONS.values() for w in p.split())}
    assert all(len(made(w, add_special_tokens=False).input_ids) == 1 for w in words)


def test_the_detector_reads_rendered_scenes_and_prompts_name_every_attribute():
    rng = random.Random(7)
    scenes = [random_scene(rng).with_(style=rng.choice(("filled", "outline"))) for _ in range(120)]
    assert all(read_image(render(s, rng)).as_dict() == s.__dict__ for s in scenes)
    scene = Scene("triangle", "green", "yellow", "right", "small")
    assert scene.prompt == "a small green triangle on the right on a yellow background"


def test_every_training_stage_runs_and_saves_a_folder_the_toolkit_loads(tmp_path):
    """The training script's stages at a few steps on the CPU (what a GPU run does at full size): the saved folder
    loads as a model with the shipped architecture, and the LoRA's weights as a LoRA file for it."""
    from models.lora import read_lora
    from models.shapes import train

    cpu = torch.device("cpu")
    vae, _ = train.train_vae(cpu, steps=1, batch=2, seed=0, scale_samples=4)
    tok, text, unet, record = train.train_text_unet(vae, cpu, steps=2, batch=2, seed=1, deadline=float("inf"),
                                                    reserve_steps=0, dataset=4)
    assert record["steps"] == 2
    adapters, _ = train.train_lora(unet, text, vae, tok, cpu, steps=1, batch=2, seed=2, dataset=4)
    assert {type(a.base) for a in adapters.values()} == {torch.nn.Linear, torch.nn.Conv2d}
    assert all(unet.get_submodule(name) is adapter for name, adapter in adapters.items())  # in place while training
    train.remove_lora(unet, adapters)
    assert set(train.lora_layers(unet)) == set(adapters)  # the base layers back
    train.pipeline(vae, text, tok, unet).to(torch.float16).save_pretrained(tmp_path / "shapes")
    save_file(train.lora_weights(adapters), tmp_path / "outline.safetensors")
    source = resolve_model(str(tmp_path / "shapes"))
    assert source.config("unet")["block_out_channels"] == train.UNET_CONFIG["block_out_channels"]
    assert len(read_lora(tmp_path / "outline.safetensors").layers) == len(adapters)
