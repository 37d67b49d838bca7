"""Single-file checkpoints (models.single_file) on the CPU: tiny SD 1.x, SD 2.x (v-prediction), SDXL base and refiner
files in the original layout, written from diffusers folders by tests.single_files' own mapping, convert back to
folders of the same tensors (bit for bit, the file's dtype kept) that our pipeline renders as diffusers' own
from_single_file does; lone VAE and ControlNet files; the cache (a second call converts nothing, a damaged folder is
converted again); each refusal as one line with nothing left in the cache; CLIP's real tokenizer in the built-in
architecture folders, whose configs a tiny file is checked against and refused by."""

import errno
import json
import os
import pickle
import shutil

import diffusers
import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import CLIPTokenizer

from core.errors import RunFailure, UsageError
from demo import PipelineSpec, load_pipeline
from models.cache import default_cache_dir
from models.single_file import (
    Layout,
    architecture_dir,
    convert_controlnet_file,
    convert_model_file,
    convert_vae_file,
    detect_layout,
    is_single_file,
)
from models.source import resolve_model
from tests.single_files import (
    folder_tensors,
    write_controlnet_file,
    write_controlnet_folder,
    write_model_file,
    write_sd2_folder,
    write_vae_file,
    write_wide_xl_folder,
)

# A case: the folder a file is written from (a built-in's name, or one this module derives) and the file's layout.
CASES = {"sd1": ("tiny", "sd1"), "sd2": ("sd2", "sd2"), "sdxl": ("tiny-xl", "sdxl-base"),
         "sdxl-wide": ("tiny-xl-wide", "sdxl-base"), "refiner": ("tiny-xl-refiner", "sdxl-refiner")}
WEIGHTED = ("unet", "vae", "text_encoder", "text_encoder_2")
PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("single-file")


@pytest.fixture(scope="module")
def folder(work):
    """A case's diffusers folder, made on first use."""
    made = {}

    def get(name: str):
        if name not in made:
            if name == "sd2":
                made[name] = write_sd2_folder(resolve_model("tiny").path, work / "sd2")
            elif name == "tiny-xl-wide":
                made[name] = write_wide_xl_folder(resolve_model("tiny-xl").path, work / "tiny-xl-wide")
            else:
                made[name] = resolve_model(name).path
        return made[name]

    return get


@pytest.fixture(scope="module")
def single_file(work, folder):
    """A case's file in the original layout (written once)."""
    def get(case: str):
        name, variant = CASES[case]
        path = work / "files" / f"{case}.safetensors"
        return path if path.exists() else write_model_file(folder(name), variant, path)

    return get


@pytest.fixture(scope="module")
def converted(work, folder, single_file):
    """A case's file converted with its folder as model_config (once, into the module's cache)."""
    made = {}

    def get(case: str):
        if case not in made:
            made[case] = convert_model_file(single_file(case), model_config=folder(CASES[case][0]),
                                            cache_dir=work / "cache", say=lambda _: None)
        return made[case]

    return get


def assert_same_tensors(expected, actual, dtype=None):
    """Every tensor of the folder `expected` in `actual` (no other), equal bit for bit and of the same dtype (or
    `dtype`'s, the expected cast to it)."""
    want, got = folder_tensors(expected), folder_tensors(actual)
    assert want and sorted(want) == sorted(got)
    for name, tensor in want.items():
        tensor = tensor.to(dtype) if dtype is not None else tensor
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def left_in(cache) -> list[str]:
    """What a refused conversion may not leave in its cache: a converted folder, or anything being written."""
    if not cache.exists():
        return []
    return sorted(p.name for p in cache.iterdir() if (p.is_dir() and p.name != "configs") or ".tmp-" in p.name)


def refusal(error, call) -> str:
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def save(tensors: dict, path):
    save_file(tensors, path)
    return path


def header_keys(path) -> list[str]:
    with safe_open(path, framework="pt") as file:
        return list(file.keys())


# ---- layouts ------------------------------------------------------------------------------------------------------

def test_the_layout_is_told_by_the_tensor_names_alone(single_file, work):
    expected = {"sd1": Layout("sd", "sd1"), "sd2": Layout("sd", "sd2"), "sdxl": Layout("sdxl", "sdxl-base"),
                "refiner": Layout("sdxl", "sdxl-refiner")}
    for case, layout in expected.items():
        assert detect_layout(header_keys(single_file(case))) == layout
    assert is_single_file(single_file("sd1")) and not is_single_file(work) and not is_single_file(work / "none.ckpt")
    vae_only = [k for k in header_keys(single_file("sd1")) if k.startswith("first_stage_model.")]
    no_text = [k for k in header_keys(single_file("sd1")) if not k.startswith("cond_stage_model.")]
    for keys in (vae_only, no_text, []):
        message = refusal(UsageError, lambda: detect_layout(keys, "odd.safetensors"))
        assert message.startswith("odd.safetensors: not a Stable Diffusion checkpoint")
        assert "model.diffusion_model." in message and "conditioner.embedders.1.model." in message


# ---- conversion -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_a_converted_file_holds_its_folders_tensors(case, folder, converted):
    """tiny-xl's two text encoders are equally wide: the layout, not the widths, says which is which."""
    original, out = folder(CASES[case][0]), converted(case)
    source = resolve_model(str(out))  # a whole diffusers folder, checked as any --model folder is
    components = [c for c in WEIGHTED if (original / c).is_dir()]
    assert [c for c in WEIGHTED if c in source.components] == components
    for component in components:
        assert_same_tensors(original / component, out / component)
    assert source.family.name == ("sdxl" if CASES[case][1].startswith("sdxl") else "sd")
    assert source.prediction_type == ("v_prediction" if case == "sd2" else "epsilon")
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == json.loads((original / "model_index.json").read_text())["_class_name"]


def test_an_fp16_file_stays_fp16_and_the_prediction_type_can_be_given(work, folder):
    tiny = folder("tiny")
    half = write_model_file(tiny, "sd1", work / "files" / "sd1-fp16.safetensors", dtype=torch.float16)
    out = convert_model_file(half, model_config=tiny, cache_dir=work / "cache", say=lambda _: None)
    for component in ("unet", "vae", "text_encoder"):
        assert_same_tensors(tiny / component, out / component, dtype=torch.float16)
    v = convert_model_file(half, model_config=tiny, prediction_type="v_prediction", cache_dir=work / "cache",
                           say=lambda _: None)
    assert v != out and resolve_model(str(v)).prediction_type == "v_prediction"
    assert resolve_model(str(out)).prediction_type == "epsilon"


@pytest.mark.parametrize("case", ["sd1", "sd2", "sdxl-wide"])
def test_the_converted_model_renders_as_diffusers_from_single_file(case, folder, single_file, converted):
    """Same seed, same image as diffusers' StableDiffusionPipeline / StableDiffusionXLPipeline.from_single_file on the
    same file and configs. tiny-xl-wide, as diffusers tells SDXL's encoders apart by width; its single-file text
    encoder (the same weights in other memory) rounds its projection a hair differently from the one
    from_pretrained loads, 1/255 at most in a pixel or two: SDXL is compared within that."""
    original = folder(CASES[case][0])
    size = dict(height=40, width=32)
    with load_pipeline(PipelineSpec(model=str(converted(case)), backend="torch", plugins="none"),
                       device="cpu") as pipe:
        ours = np.asarray(pipe(PROMPT, seed=3, denoising_steps=2, guidance_scale=7.5, **size).images[0])
    reference = diffusers.StableDiffusionXLPipeline if "xl" in case else diffusers.StableDiffusionPipeline
    theirs = reference.from_single_file(str(single_file(case)), config=str(original), local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    image = theirs(PROMPT, num_inference_steps=2, guidance_scale=7.5, generator=torch.Generator("cpu").manual_seed(3),
                   output_type="np", **size).images[0]
    theirs = (image * 255).round().astype(np.uint8)
    assert ours.shape == theirs.shape == (40, 32, 3) and ours.std() > 5
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= (1 if "xl" in case else 0)


# ---- the cache ----------------------------------------------------------------------------------------------------

def mtimes(directory) -> dict:
    return {p: p.stat().st_mtime_ns for p in sorted(directory.rglob("*"))}


def test_a_second_call_converts_nothing_and_a_damaged_folder_is_converted_again(tmp_path, folder, single_file):
    tiny, said = folder("tiny"), []
    file = tmp_path / "model.safetensors"
    shutil.copy(single_file("sd1"), file)
    convert = lambda path=file: convert_model_file(path, model_config=tiny, cache_dir=tmp_path / "cache",  # noqa: E731
                                                   say=said.append)
    out = convert()
    assert len(said) == 1 and said[0].startswith(f"[model] converting {file} (once)")
    before, digests = mtimes(out), tmp_path / "cache" / "digests.json"
    index_time = digests.stat().st_mtime_ns
    assert convert() == out and len(said) == 1 and mtimes(out) == before
    assert digests.stat().st_mtime_ns == index_time  # the digest came from the index: the file was not hashed
    copy = tmp_path / "copy.safetensors"
    shutil.copy(file, copy)
    assert convert(copy) == out and len(said) == 1  # keyed by content, not name

    # While the file's size and time hold, its recorded digest is believed (and keys another folder); a new time
    # has it hashed again, which finds the converted folder.
    recorded = json.loads(digests.read_text())
    recorded[str(file.resolve())]["sha256"] = "0" * 64
    digests.write_text(json.dumps(recorded))
    assert convert() != out and len(said) == 2
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))
    assert convert() == out and len(said) == 2

    weights = out / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert convert() == out and "damaged" in said[-1] and len(said) == 3
    assert_same_tensors(tiny / "unet", out / "unet")
    shutil.rmtree(out / "vae")
    assert convert() == out and "vae/config.json is missing" in said[-1]
    assert_same_tensors(tiny / "vae", out / "vae")


# ---- refusals -----------------------------------------------------------------------------------------------------

class _Explodes:
    def __reduce__(self):  # loading this pickle calls a function that fails: the test would see it
        return (pytest.fail, ("the pickle was loaded",))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".pth", ".bin"])
def test_a_pickle_is_refused_unopened(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(pickle.dumps(_Explodes()))
    assert is_single_file(path)
    message = refusal(UsageError, lambda: convert_model_file(path, cache_dir=tmp_path / "cache"))
    assert "pickles run code when loaded" in message and "convert it to .safetensors" in message
    assert not (tmp_path / "cache").exists()


def test_broken_and_foreign_files_are_refused_in_one_line_leaving_nothing(tmp_path, folder, single_file):
    tiny, cache = folder("tiny"), tmp_path / "cache"

    def refused(path, **options) -> str:
        message = refusal(UsageError, lambda: convert_model_file(path, cache_dir=cache, **options))
        assert left_in(cache) == []
        return message

    assert refused(tmp_path / "missing.safetensors").endswith("missing.safetensors: no such file")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(single_file("sd1").read_bytes()[:-1000])
    assert "damaged or truncated" in refused(truncated, model_config=tiny)
    vae = write_vae_file(tiny / "vae", tmp_path / "vae.safetensors")
    assert "not a Stable Diffusion checkpoint in the original layout" in refused(vae, model_config=tiny)
    assert "prediction type 'sample'" in refused(single_file("sd1"), model_config=tiny, prediction_type="sample")
    assert "describes an SDXL model" in refused(single_file("sd1"), model_config=folder("tiny-xl"))
    assert not cache.exists()  # each refused before the cache was touched

    tensors = load_file(single_file("sd1"))
    wrong = dict(tensors)
    wrong["model.diffusion_model.out.2.weight"] = torch.zeros(4, 32, 1, 1)
    message = refused(save(wrong, tmp_path / "wrong.safetensors"), model_config=tiny)
    assert "component 'unet' does not fit the configs in" in message
    assert "tensor conv_out.weight is [4, 32, 1, 1] in the file, [4, 32, 3, 3] in the config" in message
    assert "(pass model_config, a diffusers folder whose configs describe the file)" in message
    missing = {k: v for k, v in tensors.items() if k != "first_stage_model.decoder.conv_out.bias"}
    message = refused(save(missing, tmp_path / "missing.safetensors"), model_config=tiny)
    assert "component 'vae' does not fit the configs in" in message
    assert "the file has no tensor for decoder.conv_out.bias" in message
    extra = {**tensors, **{k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items()
                           if k.startswith("cond_stage_model.transformer.text_model.encoder.layers.2.")}}
    message = refused(save(extra, tmp_path / "extra.safetensors"), model_config=tiny)
    assert "component 'text_encoder' does not fit" in message
    assert "the file has tensor encoder.layers.3." in message


def test_a_full_disk_is_a_run_failure_leaving_nothing(tmp_path, folder, single_file, monkeypatch):
    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as half:
            half.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    cache = tmp_path / "cache"
    message = refusal(RunFailure, lambda: convert_model_file(single_file("sd1"), model_config=folder("tiny"),
                                                             cache_dir=cache, say=lambda _: None))
    assert "No space left on device" in message
    assert left_in(cache) == []


# ---- the built-in architectures -----------------------------------------------------------------------------------

def test_the_built_in_architectures_have_clips_real_tokenizer(tmp_path):
    """49408 tokens as OpenAI's CLIP builds them; SD 1.x pads with its end of text, OpenCLIP's tokenizers with "!"
    (id 0)."""
    pads = {("sd1", "tokenizer"): 49407, ("sd2-v", "tokenizer"): 0, ("sd2-base", "tokenizer"): 0,
            ("sdxl-base", "tokenizer"): 49407, ("sdxl-base", "tokenizer_2"): 0, ("sdxl-refiner", "tokenizer_2"): 0}
    for (name, component), pad in pads.items():
        folder = architecture_dir(name, tmp_path) / component
        assert (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
        tokenizer = CLIPTokenizer.from_pretrained(folder)
        assert len(tokenizer) == 49408 and tokenizer.pad_token_id == pad
        ids = tokenizer(PROMPT, padding="max_length", max_length=10).input_ids
        assert ids == [49406, 320, 1125, 539, 320, 2368, 49407] + [pad] * 3
        assert tokenizer.model_max_length == 77


@pytest.mark.parametrize("case, architecture, prediction_type", [
    ("sd1", "sd1", None), ("sd2", "sd2-v", None), ("sd2", "sd2-base", "epsilon"), ("sdxl", "sdxl-base", None),
    ("refiner", "sdxl-refiner", None)], ids=["sd1", "sd2-v", "sd2-base", "sdxl-base", "sdxl-refiner"])
def test_without_configs_a_file_is_checked_against_its_built_in_architecture(case, architecture, prediction_type,
                                                                            tmp_path, single_file):
    """The tiny files do not fit the real architectures: the first tensor that differs is named, from the full-size
    configs (a UNet of 320 channels; the refiner's 384), checked on the meta device without building the model."""
    cache = tmp_path / "cache"
    message = refusal(UsageError, lambda: convert_model_file(single_file(case), prediction_type=prediction_type,
                                                             cache_dir=cache))
    width = 384 if case == "refiner" else 320
    assert f"component 'unet' does not fit the built-in {architecture} architecture" in message
    assert f"tensor conv_in.weight is [32, 4, 3, 3] in the file, [{width}, 4, 3, 3] in the config" in message
    assert left_in(cache) == []
    unet = json.loads((architecture_dir(architecture, cache) / "unet" / "config.json").read_text())
    assert unet["block_out_channels"][0] == width


def test_sd2_is_read_as_v_prediction_and_the_cache_is_the_models_cache(single_file):
    """SD 2.x without a prediction type: v-prediction at 768x768 (SD 2.1's), its configs in default_cache_dir()."""
    assert "the built-in sd2-v architecture" in refusal(UsageError, lambda: convert_model_file(single_file("sd2")))
    configs = next((default_cache_dir() / "single-file" / "configs").glob("sd2-v-*"))
    scheduler = json.loads((configs / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["prediction_type"] == "v_prediction" and scheduler["_class_name"] == "DDIMScheduler"
    unet = json.loads((configs / "unet" / "config.json").read_text())
    assert unet["sample_size"] == 96 and unet["cross_attention_dim"] == 1024 and unet["use_linear_projection"]


# ---- lone VAE and ControlNet files --------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "first_stage_model."])
def test_a_vae_file_converts_to_its_folder(prefix, tmp_path, folder):
    vae = folder("tiny-xl") / "vae"
    file = write_vae_file(vae, tmp_path / "vae.safetensors", prefix)
    config = {**json.loads((vae / "config.json").read_text()), "scaling_factor": 0.13025}
    out = convert_vae_file(file, config, cache_dir=tmp_path / "cache", say=lambda _: None)
    assert_same_tensors(vae, out)
    assert json.loads((out / "config.json").read_text())["scaling_factor"] == 0.13025
    other = save({"encoder.conv.weight": torch.zeros(1)}, tmp_path / "other.safetensors")
    assert "not a VAE" in refusal(UsageError, lambda: convert_vae_file(other, config, cache_dir=tmp_path / "cache"))


@pytest.mark.parametrize("base", ["tiny", "tiny-xl"])
def test_a_controlnet_file_converts_to_its_folder(base, tmp_path, folder):
    """Its config from the base UNet's and the file's shapes (SDXL's added embeddings included)."""
    model = folder(base)
    controlnet = write_controlnet_folder(model, tmp_path / "controlnet", seed=1)
    file = write_controlnet_file(controlnet, tmp_path / "controlnet.safetensors")
    assert sorted({k.split(".")[1] for k in header_keys(file)}) == sorted(
        {"time_embed", "input_blocks", "middle_block", "zero_convs", "middle_block_out", "input_hint_block"}
        | ({"label_emb"} if base == "tiny-xl" else set()))
    unet = json.loads((model / "unet" / "config.json").read_text())
    out = convert_controlnet_file(file, unet, cache_dir=tmp_path / "cache", say=lambda _: None)
    assert_same_tensors(controlnet, out)
    config = json.loads((out / "config.json").read_text())
    assert config["conditioning_embedding_out_channels"] == [16, 32, 96, 256]
    assert "not a ControlNet" in refusal(UsageError, lambda: convert_controlnet_file(
        write_vae_file(model / "vae", tmp_path / "vae.safetensors"), unet, cache_dir=tmp_path / "cache"))
