"""A command's first moments: --help and usage errors answer before torch is imported (it takes seconds), and a
signal during the imports ends the command with its one line, as it does later."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

# module, arguments, exit status: --help (0), or a usage error that needs no model (2)
FIRST_ANSWERS = [
    ("demo.cli.generate", ["--help"], 0),
    ("demo.cli.generate", ["a prompt", "--denoising-steps", "0"], 2),
    ("demo.cli.generate", ["a prompt", "--scheduler", "bogus"], 2),
    ("demo.cli.generate", ["a prompt", "--precision", "fp16", "--backend", "bogus"], 2),
    ("demo.cli.build_engines", ["--help"], 0),
    ("demo.cli.build_engines", ["--stages", "bogus"], 2),
    ("demo.cli.export_onnx", ["--stages", "bogus"], 2),
    ("demo.cli.compare_backends", ["--help"], 0),
    ("demo.cli.compare_backends", ["--backend", "torch"], 2),
    ("bench.benchmark", ["--help"], 0),
    ("bench.benchmark", ["--seed", "-1"], 2),
    ("bench.ablation", ["--help"], 0),
    ("bench.ablation", ["--build-gpus", "0"], 2),
    ("bench.gpu_report", ["--help"], 0),
    ("bench.quality", ["--help"], 0),
    ("bench.quality", ["--cases", "0"], 2),
    ("bench.quality", ["--reference", "no-such-report.json"], 2),
    ("demo.cli.serve", ["--help"], 0),
    ("demo.cli.serve", ["--http-port", "70000"], 2),
    ("demo.cli.serve", ["--scheduler", "bogus"], 2),
]

RUN_MAIN = textwrap.dedent("""
    import importlib, json, sys
    module = importlib.import_module(sys.argv[1])
    try:
        status = module.main(sys.argv[2:])
    except SystemExit as exc:  # argparse's --help
        status = exc.code
    print(json.dumps({"status": status, "torch": "torch" in sys.modules}))
""")


@pytest.mark.parametrize("module, argv, status", FIRST_ANSWERS, ids=[f"{m} {' '.join(a)}" for m, a, _ in FIRST_ANSWERS])
def test_help_and_usage_errors_answer_before_torch_is_imported(module, argv, status):
    result = subprocess.run([sys.executable, "-c", RUN_MAIN, module, *argv], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer == {"status": status, "torch": False}, result.stderr[-2000:]
    if status == 2:
        assert len(result.stderr.strip().splitlines()) == 1 and ": error: " in result.stderr, result.stderr


# Runs an entry point as its console script does, with an import hook that stops inside the command's imports
# (announcing it on stdout) until a signal comes: the moment a user's Ctrl-C meets on a busy machine.
PAUSED_IMPORT = textwrap.dedent("""
    import importlib.abc, sys, time
    class Pause(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "demo.cli.flags":
                print("importing", flush=True)
                time.sleep(60)
            return None
    sys.meta_path.insert(0, Pause())
    from demo.cli.entry import demo_diffusion
    sys.exit(demo_diffusion())
""")


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_the_imports_ends_with_one_line(signum, status, tmp_path):
    process = subprocess.Popen([sys.executable, "-c", PAUSED_IMPORT, "a prompt", "--output-dir", str(tmp_path / "out")],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "importing\n"
        process.send_signal(signum)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert (process.returncode, err) == (status, "demo-diffusion: interrupted\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", ["demo.cli.generate", "demo.cli.build_engines", "demo.cli.export_onnx",
                                    "demo.cli.compare_backends", "demo.cli.serve", "demo.cli.client",
                                    "demo.cli.refit_names", "bench.benchmark", "bench.ablation", "bench.gpu_report",
                                    "bench.profile_denoiser", "bench.kernels", "bench.loadtest", "bench.quality"])
def test_every_help_description_is_whole_sentences(module, capsys):
    """--help's description ends where its sentence does (compare-backends' once stopped mid-sentence)."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    help_text = capsys.readouterr().out
    description = help_text.split("\n\n")[1]  # after the usage lines
    assert description.rstrip().endswith("."), description
