"""Damaged model folders and caches (issue 18, items 1-2): each is one line naming the component and file (exit 2)
before anything heavy loads, and a damaged built-in model is regenerated with a message."""

import json
import shutil

import pytest


@pytest.fixture
def folder(tiny, tmp_path):
    """A copy of the tiny model as a plain diffusers-format directory."""
    copy = tmp_path / "model"
    shutil.copytree(tiny.path, copy)
    (copy / "manifest.json").unlink()
    return copy


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def set_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


DAMAGE = {
    "unet config not JSON": (lambda m: (m / "unet" / "config.json").write_text("{bad"),
                             "component 'unet': {m}/unet/config.json is not valid JSON"),
    "unet config a list": (lambda m: (m / "unet" / "config.json").write_text("[1]"),
                           "component 'unet': {m}/unet/config.json holds a list, not a JSON object"),
    "unknown unet class": (lambda m: set_json(m / "unet" / "config.json", _class_name="UNet9000"),
                           "component 'unet': {m}/unet/config.json names class 'UNet9000'"),
    "unknown text encoder": (lambda m: set_json(m / "text_encoder" / "config.json", architectures=["NoSuchModel"]),
                             "component 'text_encoder': {m}/text_encoder/config.json names class 'NoSuchModel'"),
    "half a weights file": (lambda m: truncate(m / "vae" / "diffusion_pytorch_model.safetensors"),
                            "component 'vae': {m}/vae/diffusion_pytorch_model.safetensors is damaged: "),
    "weights gone": (lambda m: (m / "unet" / "diffusion_pytorch_model.safetensors").unlink(),
                     "component 'unet': no weights (.safetensors or .bin) in {m}/unet"),
    "unknown prediction type": (lambda m: set_json(m / "scheduler" / "scheduler_config.json", prediction_type="flow"),
                                "component 'scheduler': {m}/scheduler/scheduler_config.json has prediction_type "
                                "'flow'"),
    "scheduler config diffusers cannot build": (
        lambda m: set_json(m / "scheduler" / "scheduler_config.json", beta_schedule="zigzag"),
        "component 'scheduler': {m}/scheduler/scheduler_config.json does not build a PNDMScheduler"),
    "missing tokenizer": (lambda m: shutil.rmtree(m / "tokenizer"), "model '{m}' is missing component 'tokenizer'"),
    "tokenizer without its vocabulary": (
        lambda m: (m / "tokenizer" / "tokenizer.json").unlink(),
        "component 'tokenizer': no vocabulary in {m}/tokenizer (tokenizer.json or vocab.json and merges.txt)"),
    "tokenizer vocabulary truncated": (lambda m: truncate(m / "tokenizer" / "tokenizer.json"),
                                       "component 'tokenizer': {m}/tokenizer/tokenizer.json is not valid JSON"),
    "vae scaling factor a string": (lambda m: set_json(m / "vae" / "config.json", scaling_factor="0.18215"),
                                    "component 'vae': {m}/vae/config.json has scaling_factor '0.18215'; it must be a "
                                    "number above 0"),
    "unet attending to text of another width": (
        lambda m: set_json(m / "unet" / "config.json", cross_attention_dim=48),
        "component 'unet': {m}/unet/config.json attends to text 48 wide (cross_attention_dim), but its text encoders' "
        "states are 32 (text_encoder) wide (hidden_size)"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_model_folder_is_one_line_before_loading(damage, folder, tmp_path, capsys, no_loading):
    from demo.cli.generate import main

    make, message = DAMAGE[damage]
    make(folder)
    out = tmp_path / "out"
    assert main(["a prompt", "--model", str(folder), "--output-dir", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo-diffusion: error: "), lines
    assert message.format(m=folder) in lines[0]
    assert not out.exists()


def test_the_undamaged_copy_passes(folder):
    from models.validate import validate_model_folder

    validate_model_folder(folder, "copy")


def test_a_copy_of_shapes_without_its_vocabulary_is_one_line(tmp_path, capsys, no_loading):
    """transformers loads a tokenizer folder without tokenizer.json as a vocabulary of its two special tokens, which
    would draw every prompt alike."""
    from demo.cli.generate import main
    from models import shapes

    copy = tmp_path / "shapes"
    shutil.copytree(shapes.MODEL_DIR, copy)
    (copy / "tokenizer" / "tokenizer.json").unlink()
    assert main(["a red circle", "--model", str(copy), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"demo-diffusion: error: component 'tokenizer': no vocabulary in {copy}/tokenizer (tokenizer.json or "
        "vocab.json and merges.txt)"]


def test_an_sdxl_unet_attends_to_both_text_encoders_states(tmp_path):
    """SDXL's UNet attends to its two text encoders' states side by side (32 + 32 wide in tiny-xl), a refiner's to
    its one."""
    from core.errors import UsageError
    from models.source import resolve_model
    from models.validate import validate_model_folder

    for name in ("tiny-xl", "tiny-xl-refiner"):
        copy = tmp_path / name
        shutil.copytree(resolve_model(name).path, copy)
        validate_model_folder(copy, name)
    set_json(copy / "text_encoder_2" / "config.json", hidden_size=48)
    with pytest.raises(UsageError, match=r"attends to text 32 wide \(cross_attention_dim\), but its text encoders' "
                                        r"states are 48 \(text_encoder_2\) wide"):
        validate_model_folder(copy, "tiny-xl-refiner")


def test_damaged_builtin_model_is_regenerated_with_a_message(tmp_path, capsys):
    from models.source import resolve_model

    cache = tmp_path / "cache"
    first = resolve_model("tiny", cache)
    assert "generating built-in model 'tiny'" in capsys.readouterr().err
    weights = first.path / "unet" / "diffusion_pytorch_model.safetensors"
    whole = weights.read_bytes()
    truncate(weights)
    (first.path / "tokenizer" / "tokenizer_config.json").unlink()

    again = resolve_model("tiny", cache)
    err = capsys.readouterr().err
    assert f"built-in model 'tiny' in {first.path} is damaged" in err and "generating it again" in err
    assert again.path == first.path and weights.read_bytes() == whole  # generated deterministically
    assert (first.path / "tokenizer" / "tokenizer_config.json").is_file()
    assert sorted(p.name for p in first.path.parent.iterdir() if p.name.startswith(".tiny") and "tmp" in p.name) == []

    resolve_model("tiny", cache)
    assert capsys.readouterr().err == ""  # whole: used as it is, silently


def test_unusable_cache_root_is_one_line(tmp_path, capsys, monkeypatch):
    from demo.cli.generate import main

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("DEMO_DIFFUSION_CACHE", str(blocker))
    assert main(["a prompt", "--output-dir", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"demo-diffusion: error: the model cache '{blocker}/builtin' cannot be used: '{blocker}' is not "
                     "a directory (set DEMO_DIFFUSION_CACHE to another folder)"]
