"""Built-in models: exact SD 1.5 architecture sizes, deterministic weights and tokenizer."""

import pytest
import torch

from models.builtin import BUILTIN_MODELS, build_builtin_model, generate_bpe_vocabulary


def _parameters(module):
    return sum(p.numel() for p in module.parameters())


def test_sd15_arch_parameter_counts():
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    spec = BUILTIN_MODELS["sd1.5-arch"]
    with torch.device("meta"):  # sizes only; no memory, no time
        unet = UNet2DConditionModel(**spec["unet"])
        vae = AutoencoderKL(**spec["vae"])
        clip = CLIPTextModel(CLIPTextConfig(**spec["text_encoder"]))
    assert _parameters(unet) == 859_520_964
    assert _parameters(vae) == 83_653_863
    assert _parameters(clip) == 123_060_480


def test_sdxl_arch_parameter_counts():
    """SDXL 1.0 base: UNet 2.6B, CLIP ViT-L, OpenCLIP bigG with its projection, the VAE."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    spec = BUILTIN_MODELS["sdxl-arch"]
    with torch.device("meta"):
        unet = UNet2DConditionModel(**spec["unet"])
        vae = AutoencoderKL(**spec["vae"])
        clip = CLIPTextModel(CLIPTextConfig(**spec["text_encoder"]))
        clip2 = CLIPTextModelWithProjection(CLIPTextConfig(**spec["text_encoder_2"]))
    assert _parameters(unet) == 2_567_463_684
    assert _parameters(vae) == 83_653_863
    assert _parameters(clip) == 123_060_480
    assert _parameters(clip2) == 694_659_840
    assert spec["dtype"] == "float16" and spec["scheduler"]["_class_name"] == "EulerDiscreteScheduler"


def test_tokenizer_is_deterministic_and_tokenizes_words():
    vocab_a, merges_a = generate_bpe_vocabulary(1000)
    vocab_b, merges_b = generate_bpe_vocabulary(1000)
    assert vocab_a == vocab_b and merges_a == merges_b
    assert 512 < len(vocab_a) <= 1000  # byte alphabet (twice) plus merges, within the bound
    assert "photo</w>" in vocab_a  # a corpus word became one token


def test_tiny_weights_are_deterministic(tmp_path, tiny):
    from safetensors.torch import load_file

    build_builtin_model("tiny", tmp_path / "again")
    for part in ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        first, second = load_file(tiny.path / part), load_file(tmp_path / "again" / part)
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)


def test_tiny_architecture_comes_from_configs(tiny):
    assert tiny.vae_scale_factor == 2
    assert tiny.native_image_size == 64
    assert tiny.text_width == 32 and tiny.text_length == 77
    assert tiny.latent_channels == 4 and tiny.prediction_type == "epsilon"


@pytest.mark.parametrize("name", ["tiny"])
def test_builtin_resolves_by_name(name):
    from models.source import resolve_model

    source = resolve_model(name)
    assert (source.path / "model_index.json").is_file()
    assert resolve_model(name).fingerprint == source.fingerprint


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    from core.errors import UsageError
    from models.source import resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="cannot fetch model 'no-such-org/no-such-model' from the hub"):
        resolve_model("no-such-org/no-such-model")


def test_a_hub_failure_names_its_root_cause(monkeypatch):
    """The hub client's error ends "check out the root cause in the stacktrace above", a traceback no user sees:
    the line names the root cause instead."""
    import diffusers

    from core.errors import UsageError
    from models.source import resolve_model

    def download(hub_id):
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError:
            raise OSError(f"Cannot load model {hub_id}: not cached. Please check out the root cause in the "
                          "stacktrace above.")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "download", download)
    with pytest.raises(UsageError) as raised:
        resolve_model("some-org/some-model")
    assert str(raised.value) == ("cannot fetch model 'some-org/some-model' from the hub: [Errno -2] Name or service "
                                 "not known (ConnectionError)")
