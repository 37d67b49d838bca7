"""demo-diffusion end to end on the tiny model, and every usage error it must catch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import ROOT

DEMO = ROOT / "demo" / "demo_diffusion.py"


def run_demo(*args, cwd=None):
    return subprocess.run([sys.executable, str(DEMO), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=dict(os.environ), timeout=600)


def test_demo_writes_png_table_and_report(tmp_path):
    out = tmp_path / "out"
    result = run_demo("a photo of a cat", "--model", "tiny", "--output-dir", out, "--seed", 0,
                      "--denoising-steps", 4, "--batch-size", 2, "--height", 64, "--width", 48,
                      "--scheduler", "DDIM", "--num-warmup-runs", 1)
    assert result.returncode == 0, result.stderr
    for row in ("CLIP", "UNet x 4", "VAE-Dec", "Pipeline", "Throughput"):
        assert row in result.stdout
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["tiny-seed0-0.png", "tiny-seed0-1.png"]
    assert Image.open(pngs[0]).size == (48, 64)
    report = json.loads((out / "tiny-seed0.json").read_text())
    for field in ("device", "backend", "backend_reason", "versions", "model", "scheduler", "steps",
                  "latency_ms", "throughput_images_per_s", "latent_shape", "height", "width", "batch_size"):
        assert field in report
    assert report["backend"] == "torch" and report["scheduler"] == "DDIM" and report["steps"] == 4
    # What the image can be made again from.
    assert report["prompt"] == "a photo of a cat" and report["negative_prompt"] is None and report["seed"] == 0
    assert report["guidance_scale"] == 7.5  # no --guidance-scale: tiny's own, as every model's but shapes'
    assert report["latent_shape"] == [2, 4, 32, 24]  # tiny's VAE downsamples by 2
    assert set(report["latency_ms"]) >= {"clip", "unet", "vae", "pipeline"}
    assert report["latency_ms"]["pipeline"] >= report["latency_ms"]["unet"] > 0
    assert report["images"] == ["tiny-seed0-0.png", "tiny-seed0-1.png"]
    assert {"torch", "diffusers", "transformers"} <= set(report["versions"])
    # The same seed again: new files, the first run's images untouched.
    before = pngs[0].read_bytes()
    again = run_demo("a photo of a cat", "--output-dir", out, "--seed", 0, "--denoising-steps", 4,
                     "--batch-size", 2, "--height", 64, "--width", 48, "--scheduler", "DDIM", "--num-warmup-runs", 0)
    assert again.returncode == 0, again.stderr
    assert (out / "tiny-seed0-run2-0.png").read_bytes() == before
    assert json.loads((out / "tiny-seed0-run2.json").read_text())["images"] == ["tiny-seed0-run2-0.png",
                                                                                 "tiny-seed0-run2-1.png"]
    assert pngs[0].read_bytes() == before
    assert not list(out.glob(".*"))  # no temporary files left behind


def test_shapes_runs_at_its_own_guidance_scale_unless_told(tmp_path, capsys):
    """`--model shapes` without --guidance-scale runs at the model's own 3 (7.5 over-saturates its colours), and the
    report that makes the image again records it; a negative prompt at it is used (no note)."""
    from demo.cli.generate import main

    out = tmp_path / "out"
    assert main(["a small green triangle on the right on a yellow background", "--model", "shapes", "--output-dir",
                 str(out), "--seed", "0", "--denoising-steps", "1", "--height", "64", "--width", "64",
                 "--negative-prompt", "blurry", "--num-warmup-runs", "0", "--backend", "torch"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert json.loads((out / "shapes-seed0.json").read_text())["guidance_scale"] == 3.0


def _missing_unet(tmp_path, tiny):
    broken = tmp_path / "broken"
    shutil.copytree(tiny.path, broken)
    shutil.rmtree(broken / "unet")
    return broken


@pytest.mark.parametrize("args, message", [
    (["--height", "60"], "--height must be a multiple of 8"),
    (["--width", "1000"], "--width 1000 is outside model 'tiny' range 32..128"),
    (["--height", "16"], "--height 16 is outside model 'tiny' range"),
    (["--width", "0"], "--width 0 is outside model 'tiny' range"),  # given, not left to the model
    (["--denoising-steps", "0"], "--denoising-steps must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--scheduler", "Heun"], "--scheduler 'Heun' is unknown; choose one of DDIM, PNDM, Euler"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--backend", "onnx"], "unknown backend 'onnx'"),
    (["--batch-size", "two"], "invalid int value"),
    ("MISSING_UNET", "missing component 'unet'"),
    ("UNWRITABLE", "output directory"),
])
def test_usage_errors(args, message, tmp_path, tiny, capsys):
    from demo.cli.generate import main

    out = tmp_path / "out"
    if args == "MISSING_UNET":
        args = ["--model", str(_missing_unet(tmp_path, tiny))]
    elif args == "UNWRITABLE":
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        out = blocker / "sub"  # a directory cannot be made under a file, even by root
        args = []
    status = main(["a prompt", "--output-dir", str(out), "--denoising-steps", "2", *args])
    err = capsys.readouterr().err
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo-diffusion: error: "), err
    assert message in lines[0]
    assert not out.exists() or not any(Path(out).iterdir())


def test_missing_prompt_is_a_usage_error(capsys):
    from demo.cli.generate import main

    assert main([]) == 2
    assert "prompt" in capsys.readouterr().err


def test_an_engine_missing_where_nothing_may_build_it_is_one_line_and_exit_1(capsys):
    """What a run with building off (the ablation's runs, benchmark --engines-from-ablation) meets when an
    engine is gone or was built with other settings: the cache's reason in one line, no traceback."""
    from core.artifacts import ArtifactError
    from demo.cli.command import run_command

    def body():
        raise ArtifactError(REASON)

    REASON = "/w/unet-none/engine/unet.engine: stale (optimization_level changed), and building is off here"
    assert run_command("sd-ablation", body) == 1
    assert capsys.readouterr().err.splitlines() == [f"sd-ablation: error: {REASON}"]


def test_progress_and_a_prompt_the_tokenizer_cuts(tmp_path, capsys):
    """Warm-up runs say so; a prompt over the text encoder's token limit is warned about, naming what is dropped."""
    from demo.cli.generate import main

    words = " ".join(f"w{i}" for i in range(100))
    assert main([words, "--output-dir", str(tmp_path), "--denoising-steps", "2", "--num-warmup-runs", "2"]) == 0
    err = capsys.readouterr().err
    assert "warm-up run 1/2" in err and "warm-up run 2/2" in err
    warning = next(line for line in err.splitlines() if line.startswith("warning: the prompt is longer"))
    assert "77 tokens; dropped: '" in warning and "9 9" in warning  # the last word's tokens, decoded
    assert "w 1" not in warning.split("dropped")[1][:8]  # the first words were kept
    assert "negative prompt" not in err


@pytest.mark.parametrize("scheduler, ours", [("ddim", "DDIM"), ("eulerdiscretescheduler", "Euler")])
def test_what_a_run_does_not_use_is_noted_and_schedulers_take_any_case(scheduler, ours, tmp_path, capsys):
    """A refiner's split without a refiner, a negative prompt without guidance and another backend's flags are noted
    as unused; a scheduler is named in any case, by our name or diffusers' class name."""
    from demo.cli.generate import main

    assert main(["a prompt", "--output-dir", str(tmp_path), "--denoising-steps", "1", "--high-noise-frac", "0.5",
                 "--guidance-scale", "1", "--negative-prompt", "blurry", "--scheduler", scheduler,
                 "--build-static-batch", "--num-warmup-runs", "0", "--backend", "torch"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == ["note: --build-static-batch unused by the torch backend",
                     "note: --high-noise-frac unused without --refiner",
                     "note: --negative-prompt unused at --guidance-scale 1.0: there is no classifier-free guidance "
                     "at 1 or below",
                     "note: model 'tiny' has random weights, so its images look like noise (it runs every path in "
                     "seconds); --model shapes is the built-in trained to draw its prompt"]
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["scheduler"] == ours


def test_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    import torch

    from demo.cli.generate import main

    def too_big(*_, **__):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB\nmore detail")

    monkeypatch.setattr("demo.pipelines.Text2ImagePipeline.__call__", too_big)
    assert main(["a prompt", "--output-dir", str(tmp_path / "out"), "--denoising-steps", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "demo-diffusion: error: out of memory (CUDA out of memory. Tried to allocate 40.00 GiB); try a smaller "
        "--batch-size, --height or --width")
    assert not (tmp_path / "out").exists()


def test_a_batch_that_cannot_fit_is_refused_before_loading(tmp_path, capsys, monkeypatch, no_loading):
    """The memory floor (weights + the VAE's last activations) against what is free: one line with both, exit 2."""
    from demo.cli.generate import main

    assert main(["a prompt", "--output-dir", str(tmp_path), "--batch-size", "100000", "--height", "128",
                 "--width", "128"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("demo-diffusion: error: batch 100000 at 128x128 needs at least ") and "GiB is free" in line

    monkeypatch.setattr("demo.runtime.memory.free_bytes", lambda device: 2**20)  # 1 MiB: not even tiny's weights
    assert main(["a prompt", "--output-dir", str(tmp_path)]) == 2
    assert "0.0 GiB is free" in capsys.readouterr().err


def test_the_memory_floor_counts_weights_in_the_run_precision(tiny):
    import torch
    from safetensors.torch import load_file

    from demo.runtime.memory import activation_floor, weight_bytes

    parameters = sum(tensor.numel() for name in ("text_encoder", "unet", "vae")
                     for tensor in load_file(next((tiny.path / name).glob("*.safetensors"))).values())
    assert weight_bytes(tiny, torch.float32) == 4 * parameters
    assert weight_bytes(tiny, torch.float16) == 2 * parameters
    channels = tiny.config("vae")["block_out_channels"][0]
    assert activation_floor(tiny, 3, 64, 48, torch.float16) == 2 * 3 * channels * 64 * 48 * 2


def test_what_a_run_does_not_use_and_a_random_weight_model_are_noted(tmp_path, capsys):
    from demo.cli.generate import main

    assert main(["a cat", "--model", "tiny", "--output-dir", str(tmp_path), "--denoising-steps", "1",
                 "--num-warmup-runs", "0", "--guess-mode", "--control-guidance-end", "0.5"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == ["note: --control-guidance-end, --guess-mode unused without ControlNets",
                     "note: model 'tiny' has random weights, so its images look like noise (it runs every path in "
                     "seconds); --model shapes is the built-in trained to draw its prompt"]


def test_a_built_in_controlnet_with_a_scale_that_is_no_number_says_so(tmp_path, capsys):
    from PIL import Image

    from demo.cli.generate import main

    Image.new("RGB", (64, 64)).save(tmp_path / "x.png")
    assert main(["a cat", "--model", "tiny", "--output-dir", str(tmp_path), "--controlnet", "tiny-controlnet:abc",
                 "--control-image", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "demo-diffusion: error: --controlnet tiny-controlnet:abc: the scale after the last ':' must be a number, "
        "got 'abc'")
