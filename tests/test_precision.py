"""What a pipeline runs in: `auto` is the backend's choice for the model's family (the torch backend: bf16 on a GPU
with bf16 kernels for SD3 and Flux, whose published weights and diffusers' guides are bf16; fp16 for the UNet families
and on older GPUs; fp32 on a CPU), a precision the family does not run in is refused in one line, and a bf16 pipeline
runs and reports bf16."""

import numpy as np
import pytest
import torch

from demo import PipelineSpec, load_pipeline
from demo.backends.registry import backend_named
from demo.cli.generate import main as demo_diffusion
from models.families import FLUX, SD, SD3, SDXL

CUDA = torch.device("cuda")


@pytest.mark.parametrize("capability, expected", [((9, 0), {SD: torch.float16, SDXL: torch.float16,
                                                            SD3: torch.bfloat16, FLUX: torch.bfloat16}),
                                                  ((7, 5), {SD: torch.float16, SDXL: torch.float16,
                                                            SD3: torch.float16, FLUX: torch.float16})])
def test_the_torch_backend_runs_sd3_and_flux_in_bf16_where_the_gpu_has_it(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    torch_backend = backend_named("torch")
    assert {family: torch_backend.default_dtype(CUDA, family) for family in expected} == expected
    assert {torch_backend.default_dtype(torch.device("cpu"), family) for family in expected} == {torch.float32}
    assert backend_named("tensorrt").default_dtype(CUDA, FLUX) == torch.float16  # TensorRT 8.6 has no bf16


def test_a_precision_the_family_lacks_is_one_line_exit_2(capsys, tiny):
    capsys.readouterr()  # the built-in made by the fixture
    assert demo_diffusion(["a cat", "--model", "tiny", "--precision", "bf16", "--denoising-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("demo-diffusion: error: model 'tiny' is of the SD 1.x/2.x family, which runs in fp16, fp32, fp8, "
                   "not bf16")


def test_a_flux_pipeline_runs_and_reports_bf16():
    request = {"seed": 3, "denoising_steps": 2, "height": 128, "width": 128, "output_type": "np"}
    with load_pipeline(PipelineSpec(model="tiny-flux", precision="bf16"), device="cpu") as pipe:
        assert {p.dtype for p in pipe.stages["flux_transformer"].module.parameters()} == {torch.bfloat16}
        result = pipe("a red circle", **request)
    assert result.report.precision == "bf16"
    with load_pipeline(PipelineSpec(model="tiny-flux"), device="cpu") as pipe:
        reference = pipe("a red circle", **request)
    assert reference.report.precision == "fp32"
    difference = np.abs(result.images - reference.images)
    assert 0 < difference.max() < 0.25 and difference.mean() < 0.02  # bf16's rounding, nothing else
