"""demo_diffusion end to end on the tiny model, and every usage error it must catch."""

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
    assert (out / "tiny-seed0-1-0.png").read_bytes() == before
    assert pngs[0].read_bytes() == before
    assert not list(out.glob(".*"))  # no temporary files left behind


def _missing_unet(tmp_path, tiny):
    broken = tmp_path / "broken"
    shutil.copytree(tiny.path, broken)
    shutil.rmtree(broken / "unet")
    return broken


@pytest.mark.parametrize("args, message", [
    (["--height", "60"], "--height must be a multiple of 8"),
    (["--width", "1000"], "--width 1000 is outside model 'tiny' range 32..128"),
    (["--height", "16"], "--height 16 is outside model 'tiny' range"),
    (["--denoising-steps", "0"], "--denoising-steps must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--scheduler", "Heun"], "unknown scheduler 'Heun'"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--backend", "onnx"], "unknown backend 'onnx'"),
    (["--batch-size", "two"], "invalid int value"),
    ("MISSING_UNET", "missing component 'unet'"),
    ("UNWRITABLE", "output directory"),
])
def test_usage_errors(args, message, tmp_path, tiny, capsys):
    from demo.demo_diffusion import main

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
    assert len(lines) == 1 and lines[0].startswith("demo_diffusion: error: "), err
    assert message in lines[0]
    assert not out.exists() or not any(Path(out).iterdir())


def test_missing_prompt_is_a_usage_error(capsys):
    from demo.demo_diffusion import main

    assert main([]) == 2
    assert "prompt" in capsys.readouterr().err


def test_an_engine_missing_where_nothing_may_build_it_is_one_line_and_exit_1(capsys):
    """What a run with building off (the ablation's runs, benchmark --engines-from-ablation) meets when an
    engine is gone or was built with other settings: the cache's reason in one line, no traceback."""
    from core.artifacts import ArtifactError
    from demo.arguments import run_command

    def body():
        raise ArtifactError("/w/unet-none/engine/unet.engine: stale (optimization_level changed), and building is off here")

    assert run_command("ablation", body) == 1
    assert capsys.readouterr().err.splitlines() == [
        "ablation: error: /w/unet-none/engine/unet.engine: stale (optimization_level changed), and building is off here"]
