"""precision fp8 (models.fp8; the torch backend's FP8 UNet, demo.backends.torch.fp8).

On the CPU (torch._scaled_mm runs there): the FP8 Linear against a float32 reference on fresh random inputs, within
the bound e4m3's rounding gives, and exactly the product of its dequantized operands, per tensor and per row; the
scales from a known amax; saturation past the calibrated range (static) and none from each input's (dynamic); row
scales keeping an outlier token's coarsening to its own row, and requantized per channel in place; a
torch.compile(fullgraph=True) trace; tiny's UNet quantized against its float32 output, with the layers it keeps
counted from the module types; LoRA weights requantized after fusion; the refusals, before anything loads. On a
GPU (marked gpu, compute capability 8.9 and up): the CUDA _scaled_mm path against float32 in each way of scaling,
eager and in a CUDA graph whose output is poisoned before each replay, and tiny's whole pipeline in fp8 (static and
row scales) against fp16."""

import re

import pytest
import torch
from torch import nn

from bench.contenders import resolve_here, select_contenders
from core.errors import UsageError
from demo.backends.base import Workload
from demo.backends.registry import select_backend
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.fp8 import check_fp8_device, fp8_settings
from demo.backends.torch.options import TorchOptions, TorchSettings
from demo.backends.torch.planted import PlantedSettings
from demo.backends.torch.stage import FusedLoras, TorchStage
from demo.runtime.loader import plan_pipeline
from demo.runtime.report import run_precision
from demo.runtime.spec import PipelineSpec
from models import STAGE_MODELS, UNET
from models.fp8 import CONVOLUTIONS, E4M3, E4M3_MAX, Fp8Linear, e4m3_scale, to_e4m3
from models.quantize import MIN_ROWS, ActivationRecorder

CPU = torch.device("cpu")
ROUNDING = 2.0 ** -4  # e4m3's relative rounding error in its normal range (3 mantissa bits, to nearest)
SUBNORMAL_HALF_STEP = 2.0 ** -10  # its absolute one below it, in units of the scale (subnormal spacing 2^-9)


def fp8_error_bound(x: torch.Tensor, weight: torch.Tensor, x_scale: float, w_scale: float) -> torch.Tensor:
    """Per output element, the most |FP8 x @ W^T - x @ W^T| can be: each operand within
    e = ROUNDING * |v| + scale * SUBNORMAL_HALF_STEP of itself, so the product within |x| e_w + e_x |w| + e_x e_w,
    plus float32 accumulation."""
    x, weight = x.double().abs(), weight.double().abs()
    e_x, e_w = ROUNDING * x + x_scale * SUBNORMAL_HALF_STEP, ROUNDING * weight + w_scale * SUBNORMAL_HALF_STEP
    return x @ e_w.T + e_x @ weight.T + e_x @ e_w.T + 1e-5 * (x @ weight.T) + 1e-6


def random_linear(inputs: int, outputs: int, seed: int) -> tuple[nn.Linear, torch.Tensor]:
    """A Linear and an input with a different range per channel and a few outliers (never zeros)."""
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(inputs, outputs)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(outputs, inputs, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(outputs, generator=generator))
    x = torch.randn(3, 20, inputs, generator=generator) * torch.linspace(0.2, 3, inputs)
    x[0, 0, :4] *= 10  # outliers
    return linear, x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fp8_linear_is_within_e4m3s_bound_of_float32(seed):
    linear, x = random_linear(64, 48, seed)
    reference = linear(x).detach().double()
    amax = float(x.abs().max())
    Fp8Linear.convert(linear, amax)
    out = linear(x).detach().double()
    assert torch.isfinite(out).all()
    bound = fp8_error_bound(x.reshape(-1, 64), linear.weight.detach(), amax / E4M3_MAX,
                            float(linear.weight_scale)).reshape(reference.shape)
    error = (out - reference).abs()
    assert (error <= bound).all(), float((error - bound).max())
    assert 1e-4 < float(error.norm() / reference.norm()) < 0.05  # quantized, and close

    # Exactly the product of its dequantized operands: the scales applied once each, the bias added once.
    x_dq = to_e4m3(x.reshape(-1, 64), linear.input_scale).double() * float(linear.input_scale)
    w_dq = linear.weight_e4m3.double() * float(linear.weight_scale)
    exact = (x_dq @ w_dq.T + linear.bias.detach().double()).reshape(reference.shape)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


def test_the_scales_come_from_the_calibrated_amax():
    linear, x = random_linear(32, 16, seed=3)
    with ActivationRecorder(nn.Sequential(linear)) as recorder:
        linear(x)
    amax = recorder.calibration().layers["0"].amax
    assert amax == pytest.approx(float(x.abs().max()))
    Fp8Linear.convert(linear, amax)
    assert float(linear.input_scale) == pytest.approx(amax / E4M3_MAX, rel=1e-6)
    assert float(linear.weight_scale) == pytest.approx(float(linear.weight.abs().max()) / E4M3_MAX, rel=1e-6)
    assert linear.weight_e4m3.dtype == E4M3 and float(linear.weight_e4m3.float().abs().max()) == E4M3_MAX
    assert float(to_e4m3(x, linear.input_scale).float().abs().max()) == E4M3_MAX  # amax maps to e4m3's largest
    assert set(linear.state_dict()) == {"weight", "bias"}  # the FP8 copy and scales are not saved
    assert float(e4m3_scale(0.0)) > 0  # an all-zero layer divides by no zero


def test_inputs_beyond_the_calibrated_range_saturate():
    linear, x = random_linear(32, 16, seed=4)
    Fp8Linear.convert(linear, float(x.abs().max()) / 3)  # a calibration that saw a third of this range
    quantized = to_e4m3(x, linear.input_scale).float()
    assert torch.isfinite(quantized).all() and float(quantized.abs().max()) == E4M3_MAX
    assert torch.isfinite(linear(x)).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_row_scales_are_within_the_bound_and_exactly_the_per_row_product(seed):
    linear, x = random_linear(64, 48, seed)
    reference = linear(x).detach().double()
    rows = x.reshape(-1, 64)
    Fp8Linear.convert(linear, float(x.abs().max()) / 3, "row")  # a static amax that would saturate: unused here
    out = linear(x).detach().double()
    row_scales = rows.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    weight_scales = linear.weight.detach().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    assert linear.weight_scale.shape == (1, 48)
    torch.testing.assert_close(linear.weight_scale, weight_scales.T, rtol=1e-6, atol=0)
    bound = fp8_error_bound(rows, linear.weight.detach(), row_scales, weight_scales).reshape(reference.shape)
    error = (out - reference).abs()
    assert (error <= bound).all(), float((error - bound).max())
    # every row's largest |value| maps to e4m3's largest, and the output is the product of the dequantized rows
    x_q, w_q = to_e4m3(rows, row_scales), linear.weight_e4m3
    assert (x_q.float().abs().amax(dim=1) == E4M3_MAX).all() and (w_q.float().abs().amax(dim=1) == E4M3_MAX).all()
    exact = x_q.double() * row_scales.double() @ (w_q.double() * weight_scales.double()).T
    torch.testing.assert_close(out, (exact + linear.bias.detach().double()).reshape(reference.shape), rtol=1e-5,
                               atol=1e-5)
    buffers = linear.weight_e4m3.data_ptr(), linear.weight_scale.data_ptr()
    with torch.no_grad():
        linear.weight[3] *= 4  # one output channel grows (a fused LoRA): its scale alone follows
    before = linear.weight_scale.clone()
    linear.requantize()
    assert (linear.weight_e4m3.data_ptr(), linear.weight_scale.data_ptr()) == buffers  # in place, for CUDA graphs
    assert float(linear.weight_scale[0, 3]) == pytest.approx(4 * float(before[0, 3]), rel=1e-6)
    assert torch.equal(linear.weight_scale[0, :3], before[0, :3])


def test_an_outlier_token_changes_its_own_row_alone_with_row_scales():
    linear, x = random_linear(64, 48, seed=6)
    calm = x.clone()
    x[0, 0] *= 10000  # one token's outliers, within fp16's range
    for scales in ("dynamic", "row"):
        layer = Fp8Linear.convert(random_linear(64, 48, seed=6)[0], float(x.abs().max()), scales)
        with torch.no_grad():
            others, others_calm = layer(x)[0, 1:], layer(calm)[0, 1:]
        # row: every other token's output is what it is without the outlier; per tensor, they all coarsen
        assert torch.equal(others, others_calm) == (scales == "row"), scales


def test_dynamic_scales_follow_each_input_where_static_ones_saturate():
    linear, x = random_linear(32, 16, seed=4)
    reference = linear(x).detach().double()
    out = {}
    for scales in ("static", "dynamic"):
        layer = Fp8Linear.convert(random_linear(32, 16, seed=4)[0], float(x.abs().max()) / 3, scales)
        out[scales] = layer(x).detach().double()
    bound = fp8_error_bound(x.reshape(-1, 32), linear.weight.detach(), float(x.abs().max()) / E4M3_MAX,
                            float(linear.weight.detach().abs().max()) / E4M3_MAX).reshape(reference.shape)
    assert ((out["dynamic"] - reference).abs() <= bound).all()  # its scale is this input's: nothing saturated
    assert not ((out["static"] - reference).abs() <= bound).all()  # the calibrated third of the range clips


def test_unknown_scales_are_refused_by_the_options_and_fp8_scales_need_fp8():
    with pytest.raises(UsageError, match=r"fp8_scales.? must be auto or one of static, dynamic, row, got 'block'"):
        PipelineSpec(precision="fp8", torch=TorchOptions(fp8_scales="block")).check()
    with pytest.raises(UsageError, match=r"fp8_scales.? row scales precision fp8's operands; this spec's precision "
                                         r"is fp16"):
        PipelineSpec(precision="fp16", torch=TorchOptions(fp8_scales="row")).check()
    PipelineSpec(precision="fp8", torch=TorchOptions(fp8_scales="row")).check()
    with pytest.raises(ValueError, match="scales must be one of"):
        Fp8Linear.convert(nn.Linear(32, 16), 1.0, "block")


def test_the_fp8_linear_traces_whole_under_torch_compile():
    linear, x = random_linear(32, 16, seed=5)
    Fp8Linear.convert(linear, float(x.abs().max()))
    model = nn.Sequential(nn.LayerNorm(32), linear, nn.GELU())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # a graph break fails fullgraph
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


@pytest.fixture(scope="module")
def unet_stages(tiny):
    """tiny's UNet on the CPU in float32, plain and with its GEMMs in FP8 (calibrated on its own sample inputs)."""
    model = STAGE_MODELS[UNET](tiny)
    plain = TorchStage(model, CPU, torch.float32)
    with torch.inference_mode(), ActivationRecorder(plain.model.component_module(plain.module)) as recorder:
        for seed in range(3):
            plain(model.sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(seed)))
    quantized = TorchStage(model, CPU, torch.float32, TorchSettings(fp8=object()), fp8=recorder.calibration())
    return model, plain, quantized, recorder.calibration()


@pytest.mark.parametrize("scales", ["static", "dynamic", "row"])
def test_tiny_unet_in_fp8_is_close_to_float32(unet_stages, scales):
    model, plain, quantized, calibration = unet_stages
    if scales != "static":
        quantized = TorchStage(model, CPU, torch.float32, TorchSettings(fp8=object(), fp8_scales=scales),
                               fp8=calibration)
    component = quantized.model.component_module(quantized.module)
    assert {m.scales for m in component.modules() if isinstance(m, Fp8Linear)} == {scales}
    feed = model.sample_inputs(2, 64, 64, generator=torch.Generator().manual_seed(11))  # fresh inputs
    reference, out = plain(feed)["latent"], quantized(feed)["latent"]
    assert torch.isfinite(out).all()
    error = float((out - reference).norm() / reference.norm())
    assert 1e-4 < error < 0.03, error  # static measured 0.008-0.009 on three seeds (2026-12-03)


def test_the_layers_fp8_keeps_are_those_that_cannot_pay(unet_stages):
    _, plain, quantized, _ = unet_stages
    component = plain.model.component_module(plain.module)
    linears = {name: m for name, m in component.named_modules() if isinstance(m, nn.Linear)}
    cross_kv = {f"{name}.{p}" for name, m in component.named_modules() if getattr(m, "is_cross_attention", False)
                for p in ("to_k", "to_v")}
    one_row = {name for name in linears if "time_emb" in name}  # the time embedding, each resnet's time projection
    convolutions = [name for name, m in component.named_modules() if isinstance(m, nn.Conv2d)]
    report = quantized.fp8
    assert cross_kv and one_row and convolutions
    assert set(report.skipped["cross-attention K/V (read the text encoder's outputs)"]) == cross_kv
    assert set(report.skipped[f"fewer than {MIN_ROWS} rows per image (a vector product)"]) == one_row
    assert report.skipped[CONVOLUTIONS] == convolutions
    assert set(report.quantized) == set(linears) - cross_kv - one_row
    fp8 = quantized.model.component_module(quantized.module)
    assert {name for name, m in fp8.named_modules() if isinstance(m, Fp8Linear)} == set(report.quantized)
    line = report.line("unet")
    assert line.startswith(f"[fp8] unet: {len(report.quantized)} Linear in FP8 e4m3 (static scales), kept in fp16: ")
    assert f"{len(cross_kv)} cross-attention K/V" in line


def test_fused_lora_weights_are_requantized(unet_stages, monkeypatch):
    model, _, quantized, _ = unet_stages
    component = quantized.model.component_module(quantized.module)
    layer = component.get_submodule(quantized.fp8.quantized[0])
    before, original = layer.weight_e4m3.clone(), layer.weight.detach().clone()

    class AddsADelta:  # what LoraFusion does to a weight, in place
        def set(self, files):
            with torch.no_grad():
                layer.weight.copy_(original + (0.5 * original.abs().max() if files else 0))

    applier = FusedLoras([quantized])
    monkeypatch.setattr(applier, "fusion", AddsADelta())
    buffer = layer.weight_e4m3.data_ptr()
    applier.set(["a LoRA"])
    assert not torch.equal(layer.weight_e4m3, before) and layer.weight_e4m3.data_ptr() == buffer  # in place
    torch.testing.assert_close(layer.weight_e4m3.float() * layer.weight_scale, layer.weight.detach(), rtol=0.07,
                               atol=float(layer.weight_scale))
    applier.set([])
    assert torch.equal(layer.weight_e4m3, before)


# ---- refusals ------------------------------------------------------------------------------------------------------

def test_fp8_on_the_cpu_is_refused_before_loading(no_loading):
    with pytest.raises(UsageError, match=r"fp8 runs the UNet's GEMMs on FP8 tensor cores: it needs a GPU of compute "
                                         r"capability 8\.9 or newer \(Ada, Hopper\), and this run is on the CPU"):
        plan_pipeline(PipelineSpec(model="tiny", precision="fp8", backend="torch"), device="cpu")


def test_fp8_on_a_gpu_below_8_9_names_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10")
    with pytest.raises(UsageError, match=r"this GPU \(NVIDIA A10, compute capability 8\.6\) has no FP8 tensor cores"):
        check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda"))  # Hopper: nothing to say


@pytest.mark.parametrize("model, family", [("tiny-sd3", "SD3"), ("tiny-flux", "Flux.1")])
def test_fp8_for_a_family_without_it_names_the_family(model, family, no_loading):
    with pytest.raises(UsageError, match=rf"model '{model}' is of the {re.escape(family)} family, which runs in bf16, "
                                         r"fp16, fp32, not fp8"):
        plan_pipeline(PipelineSpec(model=model, precision="fp8", backend="torch"), device="cpu", runs=False)


def test_fp8_on_engines_is_refused_naming_tensorrt_and_passed_over_under_auto():
    with pytest.raises(UsageError, match=r"backend.? tensorrt: .*precision.? fp8: tensorrt[ 0-9.]* engines have no "
                                         r"FP8 here \(the ONNX export writes no FP8 Q/DQ"):
        select_backend("tensorrt", cc=(9, 0), fp8=True)
    backend, reason = select_backend("auto", cc=(9, 0), fp8=True)
    assert backend.name == "torch" and "tensorrt: " in reason and "engines have no FP8" in reason


def test_fp8_with_int8_is_refused():
    with pytest.raises(UsageError, match="precision.? fp8 and .*int8.? are two quantizations of the UNet"):
        PipelineSpec(precision="fp8", engine=EngineOptions(int8=True)).check()


def test_fp8_settings_refuse_what_bypasses_its_layers_and_leave_default_plugins_out(tiny):
    workload = Workload(1, 64, 64, True)
    with pytest.raises(UsageError, match="does not combine with the planted fault int8-naive"):
        fp8_settings(PlantedSettings(planted_faults=("int8-naive",)), "", "none", tiny, workload, None, "static")
    with pytest.raises(UsageError, match=r"does not combine with plugins fMHA .*use .*plugins.? none"):
        fp8_settings(TorchSettings(plugins=("fMHA",)), "", "fMHA", tiny, workload, None, "static")
    settings, source = fp8_settings(TorchSettings(plugins=("fMHA",), channels_last=True), "defaults", "auto", tiny,
                                    workload, None, "row")
    assert settings.plugins == () and settings.channels_last and source == "defaults; its plugins left out (fp8)"
    # the calibration INT8 engines take by default, not recorded yet (nothing renders until the UNet loads)
    assert settings.fp8.key["height"] == 64 and settings.fp8.key["prompts"] == 8 and settings.fp8.key["steps"] == 30
    assert settings.as_dict()["fp8"] is True and settings.as_dict()["fp8_scales"] == "row"
    assert "FP8 UNet (row scales)" in settings.describe()
    assert not {"fp8", "fp8_scales"} & set(TorchSettings().as_dict())  # the tuned defaults' rows stay as they were


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CLI runs on the GPU there")
def test_the_cli_refuses_fp8_on_the_cpu_in_one_line(tmp_path, capsys):
    from demo.cli.generate import main

    status = main(["a prompt", "--output-dir", str(tmp_path / "out"), "--precision", "fp8", "--backend", "torch"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "--precision fp8 runs the UNet's GEMMs on FP8 tensor cores" in lines[0]


def test_reports_and_benchmark_contenders_name_fp8():
    assert run_precision("fp8", torch.float16) == "fp8" and run_precision("auto", torch.float16) == "fp16"
    chosen = {c.label: c for c in select_contenders("ours-no-plugins@fp8,ours-defaults@fp8")}
    assert chosen["ours-no-plugins@fp8"].spec_fields()["precision"] == "fp8"
    resolved = resolve_here(chosen["ours-defaults@fp8"], CPU)
    assert resolved.settings is not None and resolved.precision == "fp8" and resolved.label == "ours-defaults@fp8"
    for label in ("tensorrt@fp8", "diffusers-pipeline@fp8", "ours-no-plugins@fp8@fp8"):
        with pytest.raises(UsageError, match=re.escape(label)):
            select_contenders(label)


# ---- on a GPU ------------------------------------------------------------------------------------------------------

def fp8_gpu() -> torch.device:
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (compute capability 8.9 and up)")
    return device


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["static", "dynamic", "row"])
def test_scaled_mm_on_the_gpu_is_within_the_bound_eager_and_graphed(scales):
    device = fp8_gpu()
    linear, x = random_linear(256, 128, seed=7)
    reference = linear(x).detach().double()
    amax = float(x.abs().max())
    layer = Fp8Linear.convert(linear.to(device, torch.float16), amax, scales)
    x16 = x.to(device, torch.float16)
    rows = x16.float().cpu().reshape(-1, 256)
    weight = layer.weight.detach().float().cpu()
    if scales == "row":
        x_scale, w_scale = rows.abs().amax(dim=1, keepdim=True) / E4M3_MAX, layer.weight_scale.cpu().T
    else:
        x_scale, w_scale = float(rows.abs().max()) / E4M3_MAX, float(layer.weight_scale)
    bound = fp8_error_bound(rows, weight, x_scale, w_scale).reshape(reference.shape)
    bound += 2.0 ** -10 * reference.abs() + 1e-3  # the fp16 output's rounding, and the fp16 input's
    with torch.inference_mode():
        eager = layer(x16)
        static_in = x16.clone()
        layer(static_in)  # warm-up before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_in)
        static_out.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
    for out in (eager, static_out):
        error = (out.double().cpu() - reference).abs()
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        assert (error <= bound).all(), float((error - bound).max())
    torch.testing.assert_close(static_out, eager, rtol=0, atol=0)


@pytest.mark.gpu
def test_inductor_compiles_the_fp8_linear_on_the_gpu():
    device = fp8_gpu()
    linear, x = random_linear(256, 128, seed=8)
    layer = Fp8Linear.convert(linear.to(device, torch.float16), float(x.abs().max()))
    x16 = x.to(device, torch.float16)
    with torch.inference_mode():
        eager, compiled = layer(x16), torch.compile(layer, fullgraph=True)(x16)  # inductor: the GPU's real path
    # the same GEMM; the quantize fused by inductor may round its division differently by one e4m3 step
    torch.testing.assert_close(compiled, eager, rtol=0.07, atol=float(eager.abs().max()) * 0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["static", "row"])
def test_tiny_pipeline_in_fp8_draws_the_fp16_image(tmp_path, monkeypatch, scales):
    from demo.pipelines import image_psnr, to_uint8
    from demo.runtime.loader import load_pipeline

    device = fp8_gpu()
    monkeypatch.chdir(tmp_path)  # the calibration's cache (onnx/unet.calibration.json) goes here
    images = {}
    for precision in ("fp16", "fp8"):
        spec = PipelineSpec(model="tiny", precision=precision, backend="torch", plugins="none", use_cuda_graph=True,
                            torch=TorchOptions(channels_last=True, compile="none",
                                               fp8_scales=scales if precision == "fp8" else "auto"))
        with load_pipeline(spec, device) as pipeline:
            result = pipeline("a red car on a hill", output_type="np", denoising_steps=10, seed=3)
            images[precision] = to_uint8(result.images).astype(int)
            assert result.report.precision == precision
            if precision == "fp8":
                assert pipeline.stages[UNET].fp8.quantized and pipeline.stages[UNET].fp8.scales == scales
    assert (tmp_path / "onnx" / "unet.calibration.json").is_file()
    difference = int(abs(images["fp8"] - images["fp16"]).max())
    assert image_psnr(images["fp8"], images["fp16"]) >= 35 and difference <= 16, difference


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path's refusal; the GPU runs the contender")
def test_an_fp8_contender_reaches_the_loader_in_fp8(tmp_path):
    from tests.test_benchmark import WORKLOAD, run

    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "ours-defaults@fp8")
    assert status == 0 and "rows" not in data and data["failed"] == []
    [skipped] = data["skipped"]  # planned (and refused) before anything loads
    assert skipped["label"] == "ours-defaults@fp8" and skipped["workload"] == WORKLOAD
    assert "fp8 runs the UNet's GEMMs on FP8 tensor cores" in skipped["reason"]


def test_sd_quality_judges_fp8_as_a_sensitivity_row_against_fp16():
    from bench.sensitivity import exact_spec, parse_rows, row_spec

    rows = parse_rows("fp8,fp8:row")
    assert rows == ["fp16", "fp8", "fp8:row"]  # judged against the fp16 row, the exact path of its precision
    spec, fault = row_spec(exact_spec(PipelineSpec(model="scenes")), "fp8")
    assert (spec.precision, spec.backend, spec.plugins, fault) == ("fp8", "torch", "none", None)
    assert spec.torch.fp8_scaling == "static"
    spec, _ = row_spec(exact_spec(PipelineSpec(model="scenes")), "fp8:row")
    assert (spec.precision, spec.torch.fp8_scales, spec.torch.compile) == ("fp8", "row", "none")
    spec.check()
    with pytest.raises(UsageError, match="an FP8 row is fp8 or fp8:S, S one of static, dynamic, row, got 'fp8:int'"):
        parse_rows("fp8:int")


def test_sd_serve_takes_the_precision():
    from demo.cli.flags import parse_flags
    from demo.cli.serve import build_parser
    from demo.cli.to_spec import spec_from_flags

    assert spec_from_flags(parse_flags(build_parser(), ["--model", "tiny", "--precision", "fp8"])).precision == "fp8"
    spec = spec_from_flags(parse_flags(build_parser(), ["--model", "tiny", "--precision", "fp8", "--fp8-scales",
                                                        "dynamic"]))
    assert spec.torch.fp8_scales == "dynamic"
