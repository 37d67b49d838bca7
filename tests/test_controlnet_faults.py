"""Damaged ControlNets and built-in caches (issue 55): a ControlNet folder given that is damaged is one line, exit 2,
before anything loads; a damaged built-in ControlNet is generated again, as a damaged built-in model is; a full disk
while generating either is one line, exit 1, leaving nothing; and a ControlNet whose residuals are averaged over the
image (global_pool_conditions) draws diffusers' picture."""

import json
import shutil
import struct

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from core.errors import RunFailure, UsageError
from demo.request import TEXT_TO_IMAGE
from models.controlnet import (
    EMBEDDING,
    ControlNetImageModel,
    ControlNetStageModel,
    ShallowControlNetStageModel,
    resolve_controlnet,
)
from models.source import resolve_model
from tests.test_controlnet import ours, picture, request_for, theirs

WEIGHTS = "diffusion_pytorch_model.safetensors"
NAME = "tiny-controlnet"


def set_json(path, **changes):
    """`path`'s JSON object with `changes` (a None value removes the key)."""
    config = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({key: value for key, value in config.items() if value is not None}))


def resave(path, change):
    """The safetensors file `path` saved again, whole, with `change(tensors)` applied."""
    tensors = safetensors.torch.load_file(path)
    change(tensors)
    safetensors.torch.save_file(tensors, path)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_byte_inside_a_tensor(path):
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length + (len(data) - 8 - length) // 2] ^= 0xFF  # in the tensors' data, past the header
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def builtin_controlnet(tiny):
    """The built-in tiny-controlnet's folder (generated into the session's cache)."""
    return resolve_controlnet(NAME).path


@pytest.fixture(scope="module")
def pooled(builtin_controlnet, tmp_path_factory):
    """A copy of tiny-controlnet whose config says global_pool_conditions."""
    folder = tmp_path_factory.mktemp("pooled") / "controlnet"
    shutil.copytree(builtin_controlnet, folder)
    set_json(folder / "config.json", global_pool_conditions=True)
    return folder


# ---- global_pool_conditions: diffusers' picture ------------------------------------------------------------------

def test_a_controlnet_of_global_conditions_draws_diffusers_picture(pooled):
    """Its residuals averaged over the image, and guess mode on although the request leaves it off (diffusers'
    `guess_mode or global_pool_conditions`): the picture of diffusers' StableDiffusionControlNetPipeline."""
    request = request_for(TEXT_TO_IMAGE, (picture(11),))
    controlnets = [(str(pooled), 0.9)]
    assert np.abs(ours("tiny", controlnets, request).astype(int) -
                  theirs("tiny", controlnets, request).astype(int)).max() <= 2


def test_its_stages_average_each_residual_keeping_its_shape(tiny, pooled):
    """The stage (what the torch backend runs and what is exported to ONNX) gives diffusers' ControlNetModel's
    averaged residuals, scaled, broadcast to the shapes the stage declares (the UNet's residual inputs); its shallow
    pass under the step cache gives the first of them."""
    import diffusers

    net = resolve_controlnet(str(pooled))
    stage = ControlNetStageModel(tiny, net, 0)
    module = stage.load_module().eval()
    inputs = stage.sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(3))
    image = ControlNetImageModel(tiny, net, 0).sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        inputs[EMBEDDING] = ControlNetImageModel(tiny, net, 0).load_module()(image["controlnet_cond"])
        mine = module(*(inputs[name] for name in stage.input_names))
        down, mid = diffusers.ControlNetModel.from_pretrained(pooled)(
            inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], image["controlnet_cond"],
            return_dict=False)
    shapes = stage.output_shapes(2, 64, 64)
    for residual, reference, scale, name in zip(mine, (*down, mid), inputs["conditioning_scale"], stage.output_names,
                                                strict=True):
        assert residual.shape == shapes[name] and reference.shape[2:] == (1, 1)
        assert torch.allclose(residual, (reference * scale).expand_as(residual), rtol=1e-5, atol=1e-6), name
    for branch in (0, 2):
        shallow = ShallowControlNetStageModel(tiny, net, 0, branch)
        with torch.no_grad():
            first = shallow.wrap(module.controlnet)(*(inputs[name] for name in shallow.input_names))
        assert all(torch.equal(a, b) for a, b in zip(first, mine[:branch + 1], strict=True)), branch


def test_its_onnx_export_averages_the_residuals_too(tiny, pooled, tmp_path):
    import onnxruntime as ort

    stage = ControlNetStageModel(tiny, resolve_controlnet(str(pooled)), 0)
    stage.export_onnx(tmp_path / "controlnet.onnx", "cpu", torch.float32)
    inputs = stage.sample_inputs(3, 48, 80, generator=torch.Generator().manual_seed(7))  # not the export's sizes
    with torch.no_grad():
        references = stage.load_module()(*(inputs[name] for name in stage.input_names))
    session = ort.InferenceSession(str(tmp_path / "controlnet.onnx"), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {name: value.numpy() for name, value in inputs.items()})
    shapes = stage.output_shapes(3, 48, 80)
    for name, reference, output in zip(stage.output_names, references, outputs, strict=True):
        assert output.shape == shapes[name]
        assert np.abs(output - reference.numpy()).max() <= 1e-4 * np.abs(reference.numpy()).max(), name
        assert np.ptp(output, axis=(2, 3)).max() <= 1e-5 * np.abs(output).max(), name  # one value per channel


# ---- a damaged ControlNet folder: one line, exit 2, nothing loaded ----------------------------------------------

DAMAGED = {
    "config a JSON list": (lambda d: (d / "config.json").write_text("[1]"),
                           "{d}/config.json holds a list, not a JSON object"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{bad"), "{d}/config.json is not valid JSON"),
    "config of a UNet": (lambda d: set_json(d / "config.json", _class_name="UNet2DConditionModel"),
                         "{d}/config.json names a UNet2DConditionModel, not a ControlNetModel"),
    "config without its text width": (
        lambda d: set_json(d / "config.json", cross_attention_dim=None),  # diffusers' default: 1280
        f"{WEIGHTS} does not fit {{d}}/config.json: tensor down_blocks.1.attentions.0.transformer_blocks.0.attn2."
        "to_k.weight is [64, 32] in the file, [64, 1280] in the config"),
    "config that diffusers cannot build from": (
        lambda d: set_json(d / "config.json", down_block_types=["NoSuchBlock2D", "CrossAttnDownBlock2D"]),
        "{d}/config.json does not build a ControlNetModel: "),
    "weights missing": (lambda d: (d / WEIGHTS).unlink(), "no weights (.safetensors or .bin) in {d}"),
    "weights truncated": (lambda d: truncate(d / WEIGHTS), f"{{d}}/{WEIGHTS} is damaged: "),
    "weights of zero bytes": (lambda d: (d / WEIGHTS).write_bytes(b""),
                              f"{{d}}/{WEIGHTS} is damaged: 0 bytes, too short for a safetensors header"),
    "a tensor missing": (lambda d: resave(d / WEIGHTS, lambda t: t.pop("controlnet_mid_block.bias")),
                         f"{WEIGHTS} does not fit {{d}}/config.json: the file has no tensor for "
                         "controlnet_mid_block.bias"),
    "a tensor of another shape": (
        lambda d: resave(d / WEIGHTS, lambda t: t.update({"controlnet_mid_block.bias": torch.zeros(32, 2)})),
        f"{WEIGHTS} does not fit {{d}}/config.json: tensor controlnet_mid_block.bias is [32, 2] in the file, [64] "
        "in the config"),
    "a tensor the config has not": (
        lambda d: resave(d / WEIGHTS, lambda t: t.update({"controlnet_down_blocks.9.bias": torch.zeros(3)})),
        "the file has tensor controlnet_down_blocks.9.bias, which the config has not"),
    "only a bogus .bin": (lambda d: ((d / WEIGHTS).unlink(), (d / "diffusion_pytorch_model.bin").write_bytes(b"x")),
                          "{d}/diffusion_pytorch_model.bin is damaged: not a PyTorch zip archive"),
}


@pytest.fixture
def copy(builtin_controlnet, tmp_path):
    """A copy of tiny-controlnet as a folder of one's own (no manifest)."""
    folder = tmp_path / "controlnet"
    shutil.copytree(builtin_controlnet, folder, ignore=shutil.ignore_patterns("manifest.json"))
    return folder


@pytest.fixture(scope="module")
def control_image(tmp_path_factory):
    path = tmp_path_factory.mktemp("control") / "control.png"
    picture(3).save(path)
    return path


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_controlnet_folder_is_one_line_before_loading(damage, copy, control_image, tmp_path, capsys,
                                                                no_loading):
    from demo.cli.generate import main

    make, message = DAMAGED[damage]
    make(copy)
    out = tmp_path / "out"
    assert main(["a red circle", "--model", "tiny", "--controlnet", str(copy), "--control-image", str(control_image),
                 "--output-dir", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"demo-diffusion: error: --controlnet {copy}: "), lines
    assert message.format(d=copy) in lines[0]
    assert not out.exists()


def test_the_python_api_refuses_a_damaged_controlnet_with_the_same_line(copy, no_loading):
    import demo

    resave(copy / WEIGHTS, lambda tensors: tensors.pop("controlnet_mid_block.bias"))
    with pytest.raises(UsageError) as raised:
        demo.load_pipeline(demo.PipelineSpec(model="tiny", backend="torch", controlnets=((str(copy), 1.0),)))
    assert raised.value.render() == (f"controlnets {copy}: {WEIGHTS} does not fit {copy}/config.json: the file has no "
                                     "tensor for controlnet_mid_block.bias")


def test_the_undamaged_copy_and_a_pytorch_copy_pass(copy):
    """A copy passes; so does one saved as a PyTorch file (its tensors read as shapes alone, no code run), and one
    whose tensors lack one is refused as the safetensors one is."""
    assert resolve_controlnet(str(copy)).config["block_out_channels"] == [32, 64]
    tensors = safetensors.torch.load_file(copy / WEIGHTS)
    (copy / WEIGHTS).unlink()
    torch.save(tensors, copy / "diffusion_pytorch_model.bin")
    resolve_controlnet(str(copy))
    torch.save({k: v for k, v in tensors.items() if k != "controlnet_mid_block.bias"},
               copy / "diffusion_pytorch_model.bin")
    with pytest.raises(UsageError, match="the file has no tensor for controlnet_mid_block.bias"):
        resolve_controlnet(str(copy))


# ---- a damaged built-in ControlNet: generated again ----------------------------------------------------------------

@pytest.fixture(scope="module")
def private_cache(tiny, builtin_controlnet, tmp_path_factory):
    """A model cache of this module's own, holding copies of the session's tiny and tiny-controlnet (whole: their
    manifests hold), so that damaging them disturbs no other test."""
    cache = tmp_path_factory.mktemp("private-cache")
    for folder in (tiny.path, builtin_controlnet):
        shutil.copytree(folder, cache / "builtin" / folder.name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEMO_DIFFUSION_CACHE", str(cache))
        yield cache


BUILTIN_DAMAGE = {
    "weights truncated": (lambda d: truncate(d / WEIGHTS), f"{WEIGHTS} changed"),
    "weights deleted": (lambda d: (d / WEIGHTS).unlink(), f"{WEIGHTS} is missing"),
    "config deleted": (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    "config changed": (lambda d: set_json(d / "config.json", block_out_channels=[32, 32]), "config.json changed"),
    "a byte flipped inside a tensor": (lambda d: flip_a_byte_inside_a_tensor(d / WEIGHTS),
                                       f"{WEIGHTS} changed (its content is not the one recorded)"),
}


@pytest.mark.parametrize("damage", BUILTIN_DAMAGE)
def test_a_damaged_builtin_controlnet_is_generated_again(damage, private_cache, capsys):
    folder = resolve_controlnet(NAME).path
    whole = {path.name: path.read_bytes() for path in folder.iterdir()}
    capsys.readouterr()
    make, reason = BUILTIN_DAMAGE[damage]
    make(folder)

    assert resolve_controlnet(NAME).path == folder
    err = capsys.readouterr().err
    assert f"[model] built-in ControlNet '{NAME}' in {folder} is damaged ({reason}" in err
    assert "generating it again" in err
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == whole  # generated deterministically
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name] == []
    resolve_controlnet(NAME)
    assert capsys.readouterr().err == ""  # whole: used as it is, silently


# ---- a full disk while generating a built-in: one line, exit 1, nothing left ---------------------------------------

@pytest.fixture
def full_disk(monkeypatch):
    """safetensors' writer failing as it does on a full disk: part of the file written, then its own error."""
    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as part:
            part.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def left_in(builtin):
    """What a failed generation may not leave in the built-ins' cache: a folder, or anything being written (its lock
    stays, as every generation's does)."""
    return sorted(p.name for p in builtin.iterdir() if p.is_dir() or ".tmp-" in p.name)


def test_a_full_disk_while_generating_a_builtin_controlnet_is_one_line_leaving_nothing(private_cache, control_image,
                                                                                       full_disk, tmp_path, capsys):
    from demo.cli.generate import main

    builtin = private_cache / "builtin"
    shutil.rmtree(resolve_controlnet(NAME).path)
    before = left_in(builtin)
    assert main(["a red circle", "--model", "tiny", "--controlnet", NAME, "--control-image", str(control_image),
                 "--output-dir", str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"demo-diffusion: error: cannot write {builtin}/{NAME}-c2: Error while serializing: I/O "
                         "error: No space left on device (os error 28)")
    assert left_in(builtin) == before


def test_a_full_disk_while_generating_a_builtin_model_is_a_run_failure_leaving_nothing(full_disk, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(RunFailure) as raised:
        resolve_model("tiny", cache)
    assert str(raised.value) == (f"cannot write {cache}/builtin/tiny-v2: Error while serializing: I/O error: No space "
                                 "left on device (os error 28)")
    assert left_in(cache / "builtin") == []

