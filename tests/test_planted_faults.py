"""The test-only planted faults of the torch backend (demo/backends/torch/planted.py), on the CPU with `tiny`: off,
the pipeline draws what it drew; each one on (DEMO_DIFFUSION_PLANTED_FAULT) changes the image and says so in the
report; int8-naive is a quantization, not garbage; attention-no-max is softmax where the scores are small and
overflows where they are large; vae-scale feeds the decoder the latents x 1.05; a bad name is a clear error; and no
flag turns them on."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.errors import UsageError
from demo import PipelineSpec, load_pipeline
from demo.backends.torch.planted import (
    ATTENTION_NO_MAX,
    FAULTS,
    INT8_NAIVE,
    PLANTED_FAULT_ENV,
    VAE_LATENT_SCALE,
    VAE_SCALE,
    FakeInt8Conv2d,
    FakeInt8Linear,
    NoMaxAttnProcessor,
    PlantedSettings,
    attention_without_max,
    fake_int8,
    planted_faults,
)
from demo.backends.torch.settings import FALLBACK
from demo.backends.torch.stage import TorchStage
from demo.runtime.loader import quiet
from models import UNET, VAE, UNetModel, VAEDecoderModel

CPU = torch.device("cpu")
PROMPT, STEPS = "a red circle", 3


def load():
    return load_pipeline(PipelineSpec(model="tiny", backend="torch", plugins="none"), CPU, log=quiet, progress=quiet)


def draw(pipe):
    result = pipe(PROMPT, seed=0, denoising_steps=STEPS, output_type="np")
    return result.images, result.report


@pytest.fixture(scope="module")
def baseline():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PLANTED_FAULT_ENV, raising=False)
        with load() as pipe:
            return draw(pipe)


def test_without_the_variable_the_image_is_the_baseline(baseline, monkeypatch):
    monkeypatch.delenv(PLANTED_FAULT_ENV, raising=False)
    with load() as pipe:
        images, report = draw(pipe)
    assert np.array_equal(images, baseline[0])
    assert not any("planted" in option for option in report.options) and "planted" not in report.table()
    assert "planted" not in report.options_reason


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_changes_the_image_and_the_report_says_so(baseline, monkeypatch, fault):
    monkeypatch.setenv(PLANTED_FAULT_ENV, fault)
    with load() as pipe:
        images, report = draw(pipe)
        settings = pipe.stages[FAULTS[fault]].settings
    assert images.shape == baseline[0].shape and not np.array_equal(images, baseline[0])
    assert f"planted fault: {fault}" in report.options
    assert f"planted fault: {fault}" in report.table().splitlines()[-1]  # the "Backend: ..." line
    assert PLANTED_FAULT_ENV in report.options_reason and "test-only" in report.options_reason
    assert f'"planted fault: {fault}"' in report.to_json()
    assert isinstance(settings, PlantedSettings) and settings.planted_faults == (fault,)
    assert settings.as_dict()["planted_faults"] == [fault] and f"planted fault: {fault}" in settings.describe()


def test_faults_combine_in_a_comma_list(monkeypatch):
    monkeypatch.setenv(PLANTED_FAULT_ENV, f" {VAE_SCALE}, {INT8_NAIVE} ")
    assert planted_faults() == (INT8_NAIVE, VAE_SCALE)
    monkeypatch.setenv(PLANTED_FAULT_ENV, "")
    assert planted_faults() == ()


def test_an_unknown_fault_is_a_clear_error_before_anything_loads(monkeypatch, no_loading):
    monkeypatch.setenv(PLANTED_FAULT_ENV, f"{INT8_NAIVE},int4-naive")
    with pytest.raises(UsageError) as refused:
        load()
    message = refused.value.render()
    assert PLANTED_FAULT_ENV in message and "int4-naive" in message
    assert all(name in message for name in FAULTS), message


def test_plugins_asked_for_do_not_combine_with_a_fault(monkeypatch):
    from demo.backends.torch.planted import planted_settings

    monkeypatch.setenv(PLANTED_FAULT_ENV, INT8_NAIVE)
    with pytest.raises(UsageError, match="do not combine with plugins"):
        planted_settings(dataclasses.replace(FALLBACK, plugins=("fMHA",)), "asked", "fMHA")
    settings, source = planted_settings(dataclasses.replace(FALLBACK, plugins=("fMHA",)), "defaults", "auto")
    assert settings.plugins == () and "plugins left out" in source


def test_no_flag_and_no_spec_field_turns_a_fault_on():
    from demo.cli.generate import build_parser

    parser = build_parser()
    flags = [flag for action in parser._actions for flag in action.option_strings]
    assert flags and not [flag for flag in flags if "plant" in flag or "fault" in flag]
    assert not [name for name in PipelineSpec.__dataclass_fields__ if "plant" in name or "fault" in name]


# ---- int8-naive ----------------------------------------------------------------------------------------------------

def unet_stages(tiny, settings):
    return TorchStage(UNetModel(tiny), CPU, torch.float32, settings)


def test_int8_naive_quantizes_every_layer_and_stays_close(tiny):
    plain = unet_stages(tiny, FALLBACK)
    faulty = unet_stages(tiny, PlantedSettings(planted_faults=(INT8_NAIVE,)))
    layers = [m for m in plain.module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    quantized = [m for m in faulty.module.modules() if isinstance(m, (FakeInt8Linear, FakeInt8Conv2d))]
    assert len(quantized) == len(layers) > 20
    assert faulty.module.state_dict().keys() == plain.module.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(faulty.module.state_dict().values(),
                                                 plain.module.state_dict().values()))  # weights kept: qdq per call
    inputs = UNetModel(tiny).sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(0))
    expected, got = plain(inputs)["latent"], faulty(inputs)["latent"]
    relative = ((got - expected).norm() / expected.norm()).item()
    assert 1e-3 < relative < 0.3, relative


def test_fake_int8_is_symmetric_per_tensor_int8():
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    q = fake_int8(x)
    scale = x.abs().max() / 127
    levels = q / scale
    assert torch.allclose(levels, levels.round(), atol=1e-3) and levels.abs().max().round() == 127
    assert len(levels.round().unique()) > 100 and ((q - x).abs() <= scale / 2 + 1e-6).all()
    half = x.half()  # quantized in float32, returned in its own dtype
    assert fake_int8(half).dtype == torch.float16 and torch.equal(fake_int8(half), fake_int8(half.float()).half())
    assert torch.equal(fake_int8(torch.zeros(3)), torch.zeros(3))


# ---- attention-no-max ----------------------------------------------------------------------------------------------

def random_qkv(scale: float, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, 24, 16, generator=generator) * s for s in (scale, scale, 1.0))


def test_attention_without_max_is_softmax_where_scores_are_small():
    q, k, v = random_qkv(1.0)
    scale = 16 ** -0.5
    expected = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v
    got = attention_without_max(q, k, v, scale)
    assert got.dtype == v.dtype and torch.isfinite(got).all()
    assert torch.allclose(got, expected, atol=5e-3, rtol=1e-2), (got - expected).abs().max()
    assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v), atol=5e-3, rtol=1e-2)


def test_attention_without_max_overflows_where_scores_are_large():
    q, k, v = random_qkv(4.0)  # scores of tens: exp overflows float16 above ln(65504) = 11.09
    scale = 16 ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    assert scores.max() > 11.1
    reference = F.scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(reference).all()
    got = attention_without_max(q, k, v, scale)
    assert not torch.isfinite(got).all()
    overflowing_rows = (scores > 11.1).any(dim=-1)
    assert (~torch.isfinite(got)).any(dim=-1)[overflowing_rows].all()  # every row with a score above it


def test_attention_no_max_replaces_every_unet_attention(tiny):
    plain = unet_stages(tiny, FALLBACK)
    faulty = unet_stages(tiny, PlantedSettings(planted_faults=(ATTENTION_NO_MAX,)))
    processors = faulty.module.unet.attn_processors
    assert processors and all(isinstance(p, NoMaxAttnProcessor) for p in processors.values())
    assert any("attn1" in name for name in processors) and any("attn2" in name for name in processors)
    assert not any(isinstance(p, NoMaxAttnProcessor) for p in plain.module.unet.attn_processors.values())
    inputs = UNetModel(tiny).sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(0))
    expected, got = plain(inputs)["latent"], faulty(inputs)["latent"]
    assert not torch.equal(got, expected)  # fp16 scores: close, not equal, where the tiny UNet's scores are small
    assert torch.allclose(got, expected, atol=2e-2, rtol=1e-2), (got - expected).abs().max()


# ---- vae-scale -----------------------------------------------------------------------------------------------------

def decoder_input(stage) -> list[torch.Tensor]:
    """What the VAE's decoding receives (its first module after the stage's input) in each call of `stage`."""
    vae = stage.module.vae
    first = vae.post_quant_conv if vae.post_quant_conv is not None else vae.decoder
    seen = []
    first.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].clone()))
    return seen


def test_vae_scale_feeds_the_decoder_the_latents_times_1_05(tiny):
    plain = TorchStage(VAEDecoderModel(tiny), CPU, torch.float32, FALLBACK)
    faulty = TorchStage(VAEDecoderModel(tiny), CPU, torch.float32, PlantedSettings(planted_faults=(VAE_SCALE,)))
    latent = VAEDecoderModel(tiny).sample_inputs(1, 64, 64, generator=torch.Generator().manual_seed(3))["latent"]
    seen_plain, seen_faulty = decoder_input(plain), decoder_input(faulty)
    images_plain, images_faulty = plain.call(latent), faulty.call(latent)
    assert torch.equal(seen_plain[0], latent)
    assert torch.equal(seen_faulty[0], latent * VAE_LATENT_SCALE)
    assert not torch.equal(images_plain, images_faulty)


def test_vae_scale_in_the_pipeline_scales_what_the_decoder_gets(monkeypatch):
    seen = {}
    for fault in (None, VAE_SCALE):
        if fault is None:
            monkeypatch.delenv(PLANTED_FAULT_ENV, raising=False)
        else:
            monkeypatch.setenv(PLANTED_FAULT_ENV, fault)
        with load() as pipe:
            inputs = decoder_input(pipe.stages[VAE])
            unet_changed = any(isinstance(m, FakeInt8Linear) for m in pipe.stages[UNET].module.modules())
            draw(pipe)
        assert not unet_changed
        seen[fault] = inputs[-1]
    assert torch.allclose(seen[VAE_SCALE], seen[None] * VAE_LATENT_SCALE, rtol=1e-6, atol=0)
