"""The `shapes-lcm` distillation (models/shapes/train_lcm.py): LCM's maths against their formulas and against the
schedulers they stand for (LCMScheduler samples with them, DDIMScheduler's step is the solver's), the loss's teacher
guided at the model's scale and its DDIM step one skip back, and runs of a few steps on the CPU: the same seed the
same LoRA, a file the toolkit reads and fuses into the UNet as the trained adapters are."""

import copy
import json
import math
import random

import pytest
import torch
from safetensors.torch import save_file

from models.lora import LoraFusion, read_lora
from models.shapes import GUIDANCE_SCALE, train_lcm
from models.shapes.train import attach_lora, lora_layers, lora_weights

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe():
    return train_lcm.teacher_pipeline(CPU)


@pytest.fixture(scope="module")
def maths(pipe):
    return train_lcm.Consistency(train_lcm.lcm_scheduler(pipe), CPU)


def unet_inputs(batch: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, 16, 16, generator=generator), torch.tensor([999, 519, 19][:batch]),
            torch.randn(batch, 77, 128, generator=generator))


def test_the_starts_are_the_timesteps_lcm_scheduler_samples_and_one_step_goes_a_skip_back(pipe, maths):
    assert maths.starts.tolist() == list(range(19, 1000, 20)) and maths.skip == 20  # 50 DDIM timesteps of 1000
    sampler = train_lcm.lcm_scheduler(pipe)
    for steps in (1, 2, train_lcm.STUDENT_STEPS, 8):
        sampler.set_timesteps(steps)
        assert set(sampler.timesteps.tolist()) <= set(maths.starts.tolist())


def test_the_consistency_function_has_lcm_boundary_condition(maths):
    """f(x, t) = c_skip x + c_out x0, c_skip = 0.25 / ((10 t)^2 + 0.25), c_out = 10 t / ((10 t)^2 + 0.25)^0.5
    (LCMScheduler's sigma_data 0.5 and timestep_scaling 10): f(x, 0) = x."""
    x, _, _ = unet_inputs(3)
    t = torch.tensor([0, 19, 999])
    noise = torch.randn_like(x)
    a = maths.alphas[t].view(-1, 1, 1, 1)
    scaled = 10.0 * t.view(-1, 1, 1, 1)
    c_skip, c_out = 0.25 / (scaled ** 2 + 0.25), scaled / (scaled ** 2 + 0.25).sqrt()
    x0 = (x - (1 - a).sqrt() * noise) / a.sqrt()
    torch.testing.assert_close(maths.consistency(noise, t, x), c_skip * x + c_out * x0)
    torch.testing.assert_close(maths.consistency(noise, t, x)[0], x[0])


def test_a_ddim_step_back_is_ddim_schedulers(pipe, maths):
    """The solver's step from a start timestep to a skip before it (the first: to timestep 0) is DDIMScheduler's at
    eta 0 with the LCM's 50 steps, and noised() is the forward process x = sqrt(a) x0 + sqrt(1 - a) noise."""
    from diffusers import DDIMScheduler

    ddim = DDIMScheduler.from_config(pipe.scheduler.config)
    ddim.set_timesteps(len(maths.starts))
    x, _, _ = unet_inputs(1)
    noise = torch.randn_like(x)
    for start in (999, 259, 19):
        t = torch.tensor([start])
        end = (t - maths.skip).clamp(min=0)
        step = maths.noised(maths.original(noise, t, x), noise, end)
        torch.testing.assert_close(step, ddim.step(noise, start, x, eta=0.0).prev_sample)
    a = maths.alphas[999]
    torch.testing.assert_close(maths.noised(x, noise, torch.tensor([999])), a.sqrt() * x + (1 - a).sqrt() * noise)


def fake_unet(weight: float):
    """A noise prediction that depends on the latents, the timestep and the text, as a UNet's does."""
    return lambda x, t, text: weight * x + text.mean(dim=(1, 2)).view(-1, 1, 1, 1) + t.view(-1, 1, 1, 1) / 1000


def test_the_loss_pulls_the_student_to_itself_one_guided_ddim_step_back(maths):
    """The loss, written out: the teacher guided at the model's GUIDANCE_SCALE (not 1: the student draws at 1), its
    DDIM step 20 timesteps back, the student's consistency function there as the target."""
    assert GUIDANCE_SCALE > 1
    latents, _, text = unet_inputs(3, seed=1)
    noise, empty = torch.randn_like(latents), torch.randn(1, 77, 128)
    index = torch.tensor([0, 12, 49])
    student, teacher = fake_unet(0.3), fake_unet(-0.2)
    loss = train_lcm.consistency_loss(student, teacher, maths, latents, noise, index, text, empty)

    start = 20 * (index + 1) - 1
    end = (start - 20).clamp(min=0)
    a_start, a_end = maths.alphas[start].view(-1, 1, 1, 1), maths.alphas[end].view(-1, 1, 1, 1)
    noisy = a_start.sqrt() * latents + (1 - a_start).sqrt() * noise
    unconditional = teacher(noisy, start, empty.expand_as(text))
    guided = unconditional + GUIDANCE_SCALE * (teacher(noisy, start, text) - unconditional)
    earlier = a_end.sqrt() * (noisy - (1 - a_start).sqrt() * guided) / a_start.sqrt() + (1 - a_end).sqrt() * guided
    difference = (maths.consistency(student(noisy, start, text), start, noisy)
                  - maths.consistency(student(earlier, end, text), end, earlier))
    torch.testing.assert_close(loss, ((difference ** 2 + train_lcm.HUBER_C ** 2).sqrt() - train_lcm.HUBER_C).mean())


def test_the_lora_file_fuses_into_the_unet_as_the_adapters_run(pipe, tmp_path):
    """The adapters on every LCM layer (3x3, strided and 1x1 convolutions, linear layers), written as the outline
    LoRA is: read by the toolkit's reader and fused, the UNet computes what it computes with the adapters in place."""
    student = copy.deepcopy(pipe.unet)
    torch.manual_seed(0)
    adapters = attach_lora(student, train_lcm.LORA_RANK, CPU, train_lcm.LCM_LAYERS)
    assert {type(a.base) for a in adapters.values()} == {torch.nn.Linear, torch.nn.Conv2d}
    assert any(a.base.stride == (2, 2) for a in adapters.values() if isinstance(a.base, torch.nn.Conv2d))
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.up.weight.normal_(0, 0.02)
    save_file(lora_weights(adapters), tmp_path / "lcm.safetensors")
    lora = read_lora(tmp_path / "lcm.safetensors")
    assert {layer.name for layer in lora.layers} == set(lora_layers(pipe.unet, train_lcm.LCM_LAYERS))
    fused = copy.deepcopy(pipe.unet)
    LoraFusion({"unet": fused}).set([(lora, 1.0)])
    with torch.no_grad():
        base, with_adapters, with_file = (unet(*unet_inputs(3)).sample for unet in (pipe.unet, student, fused))
    moved = (with_adapters - base).abs().max()
    assert moved > 0.05
    assert (with_file - with_adapters).abs().max() < 0.01 * moved  # fp16 rounding of the file's weights only


def test_the_same_seed_distils_the_same_lora(pipe):
    first, second = (lora_weights(train_lcm.distill(pipe, CPU, steps=2, batch=2, seed=3, scenes=4, lr=1e-3,
                                                     deadline=math.inf)[0]) for _ in range(2))
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)
    assert any(weight.abs().max() > 0 for key, weight in first.items() if "lora_B" in key)  # it trained


def test_a_few_steps_on_the_cpu_write_the_lora_and_its_record(pipe, tmp_path):
    output = tmp_path / "lcm.safetensors"
    assert train_lcm.main(["--output", str(output), "--steps", "3", "--batch", "2", "--scenes", "8",
                           "--read-back", "0", "--device", "cpu"]) == 0
    record = json.loads((tmp_path / "lcm-training.json").read_text())
    assert record["device"] == "cpu" and record["args"]["seed"] == "0" and record["lcm"]["steps"] == 3
    assert record["lcm"]["losses"] and all(math.isfinite(loss) for loss in record["lcm"]["losses"])
    assert output.stat().st_size < 1_000_000
    fused = copy.deepcopy(pipe.unet)
    LoraFusion({"unet": fused}).set([(read_lora(output), 1.0)])
    with torch.no_grad():
        assert not torch.equal(fused(*unet_inputs(2)).sample, pipe.unet(*unet_inputs(2)).sample)


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--minutes", "0"], "--minutes and --lr must be above 0"),
    (["--output", "lcm.pt"], "must name a .safetensors file"),
])
def test_bad_flags_are_one_line_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_lcm.main(["--output", "lcm.safetensors", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_shipped_lcm_lora_draws_in_four_steps():
    """`shapes-lcm` as a user runs it (LCMScheduler, 4 steps, no guidance): the detector reads the first cases right,
    and the images are not the model's without it (the file is the trained LoRA, fused), if only a little: shapes' flat
    scenes read as well without it at these settings (models/shapes/lcm-training.json's read-backs: 99.5% against
    100%), so this yardstick cannot show what the LoRA adds, only that it keeps the drawings right."""
    import numpy as np

    from demo import PipelineSpec, load_pipeline
    from models.shapes.detector import read_image
    from models.shapes.scenes import ATTRIBUTES, random_scene

    scenes = [random_scene(random.Random(1234)) for _ in range(6)]
    images = {}
    for loras in ((), (("shapes-lcm", 1.0),)):
        spec = PipelineSpec(model="shapes", backend="torch", plugins="none", loras=loras)
        with load_pipeline(spec, "cpu", progress=lambda *_: None) as pipe:
            images[bool(loras)] = np.stack([
                (pipe(scene.prompt, seed=index, scheduler="LCM", denoising_steps=4, guidance_scale=1.0,
                      output_type="np").images[0] * 255).round().astype(np.uint8)
                for index, scene in enumerate(scenes)])
    readings = [read_image(image) for image in images[True]]
    right = sum(all(getattr(reading, name) == getattr(scene, name) for name in ATTRIBUTES)
                for reading, scene in zip(readings, scenes))
    assert right >= 5, [reading.as_dict() for reading in readings]
    assert np.abs(images[True].astype(int) - images[False].astype(int)).max() > 2  # small: lcm-training.json
