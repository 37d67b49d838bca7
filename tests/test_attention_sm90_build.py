"""CPU self-check of the Hopper attention kernels' index logic (tests/attention_sm90_selfcheck.cpp against
plugins/src/attention_sm90_layout.cuh): wgmma descriptors against TMA placement for every instantiation,
fragment maps, the epilogue's quad transpose, tensor-map geometry, and the mbarrier pipeline simulated under
random interleavings. The sm_90a build itself is checked in tests/test_plugins_cpu.py (cuobjdump, ptxas)."""

import shutil
import subprocess

import pytest

from tests.conftest import ROOT


def test_attention_sm90_selfcheck(tmp_path):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++) installed")
    binary = tmp_path / "attention_sm90_selfcheck"
    build = subprocess.run([compiler, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror",
                            f"-I{ROOT / 'plugins' / 'src'}", str(ROOT / "tests" / "attention_sm90_selfcheck.cpp"),
                            "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "all checks passed" in run.stdout
