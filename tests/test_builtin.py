"""Built-in models: exact SD 1.5, SDXL and SD3.5 Medium architecture sizes, deterministic weights and tokenizer."""

import pytest
import torch

from models.builtin import (
    BUILTIN_MODELS,
    build_builtin_model,
    build_flux_model,
    generate_bpe_vocabulary,
    unigram_t5_tokenizer,
)


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


def test_sd35_medium_arch_is_the_published_architecture():
    """SD3.5 Medium: the counts stabilityai/stable-diffusion-3.5-medium's files hold (transformer 2.47B with its
    positional-embedding table, T5-XXL's encoder 4.76B, CLIP ViT-L 124M, OpenCLIP bigG 695M, the VAE 84M), within 1%;
    on the meta device, from the configs alone."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    spec = BUILTIN_MODELS["sd3.5-medium-arch"]
    with torch.device("meta"):
        transformer = SD3Transformer2DModel.from_config(spec["transformer"])
        t5 = T5EncoderModel(T5Config(**spec["text_encoder_3"]))
        clips = [CLIPTextModelWithProjection(CLIPTextConfig(**spec[name]))
                 for name in ("text_encoder", "text_encoder_2")]
        vae = AutoencoderKL.from_config(spec["vae"])
    stored = _parameters(transformer) + sum(buffer.numel() for buffer in transformer.buffers())
    published = {"transformer": 2.47e9, "t5": 4.76e9, "clip": 123.7e6, "clip2": 694.7e6, "vae": 83.8e6}
    counted = {"transformer": stored, "t5": _parameters(t5), "clip": _parameters(clips[0]),
               "clip2": _parameters(clips[1]), "vae": _parameters(vae)}
    assert counted == pytest.approx(published, rel=0.01)
    config = transformer.config
    assert len(transformer.transformer_blocks) == 24 and config.num_attention_heads * config.attention_head_dim == 1536
    assert sum(block.attn2 is not None for block in transformer.transformer_blocks) == 13  # MMDiT-X's dual attention
    assert transformer.transformer_blocks[0].attn.norm_q is not None  # RMS-normed queries and keys
    assert transformer.pos_embed.pos_embed.shape == (1, 384 * 384, 1536)
    assert (t5.config.d_model, t5.config.d_ff, t5.config.num_heads, t5.config.is_gated_act) == (4096, 10240, 64, True)
    assert config.joint_attention_dim == t5.config.d_model
    assert config.pooled_projection_dim == sum(clip.config.projection_dim for clip in clips)
    assert [clip.config.hidden_act for clip in clips] == ["quick_gelu", "gelu"]
    assert vae.config.latent_channels == 16 and (vae.config.scaling_factor, vae.config.shift_factor) == (1.5305, 0.0609)
    assert spec["scheduler"] == {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                                 "shift": 3.0}
    # the offline tokenizers' ids fit the published vocabularies the embeddings keep
    assert len(unigram_t5_tokenizer()) <= t5.config.vocab_size == 32128
    assert spec["vocab_size"] <= clips[0].config.vocab_size == clips[1].config.vocab_size == 49408


@pytest.mark.parametrize("name", ["flux-dev-arch", "flux-schnell-arch"])
def test_flux_arch_is_the_published_architecture(name):
    """FLUX.1 [dev] and [schnell]: the counts black-forest-labs' files hold (transformer 11.9B, [schnell]'s without the
    guidance embedding; T5-XXL's encoder 4.76B; CLIP ViT-L 123M; the VAE 84M), on the meta device from the configs."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    spec = BUILTIN_MODELS[name]
    with torch.device("meta"):
        transformer = FluxTransformer2DModel.from_config(spec["transformer"])
        t5 = T5EncoderModel(T5Config(**spec["text_encoder_2"]))
        clip = CLIPTextModel(CLIPTextConfig(**spec["text_encoder"]))
        vae = AutoencoderKL.from_config(spec["vae"])
    dev = name == "flux-dev-arch"
    assert _parameters(transformer) == (11_901_408_320 if dev else 11_891_178_560)
    assert (_parameters(t5), _parameters(clip), _parameters(vae)) == (4_762_310_656, 123_060_480, 83_819_683)
    assert (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)) == (19, 38)
    assert transformer.config.guidance_embeds is dev and spec["dtype"] == "bfloat16"
    assert (vae.config.latent_channels, vae.config.scaling_factor, vae.config.shift_factor) == (16, 0.3611, 0.1159)
    assert spec["scheduler"]["use_dynamic_shifting"] is dev and spec["scheduler"]["shift"] == (3.0 if dev else 1.0)
    assert len(unigram_t5_tokenizer()) <= t5.config.vocab_size == 32128


def test_a_bf16_flux_builtin_is_saved_in_bf16(tmp_path):
    """flux-*-arch's path at tiny-flux's widths: drawn in fp16, every part saved in bf16."""
    from safetensors import safe_open

    build_flux_model({**BUILTIN_MODELS["tiny-flux"], "dtype": "bfloat16"}, tmp_path)
    files = sorted(tmp_path.glob("*/*.safetensors"))
    assert {path.parent.name for path in files} == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    for path in files:
        with safe_open(path, "pt") as weights:
            assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}, path


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
