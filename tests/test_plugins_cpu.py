"""Plugin checks that need no GPU: the CMake build, the C ABI's argument validation, the Python ops'
validation and fake implementations, and the library-unavailable path."""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugins import torch_ops as ops
from tests.conftest import ROOT

ARCHITECTURES = ("75", "80", "86", "89", "90")


@pytest.fixture(scope="session")
def built_library(tmp_path_factory):
    if not (shutil.which("cmake") and shutil.which("nvcc")):
        pytest.skip("cmake or nvcc not installed: cannot build the plugin library")
    build = tmp_path_factory.mktemp("plugin-build")
    for cmd in (["cmake", "-S", str(ROOT), "-B", str(build)], ["cmake", "--build", str(build), "-j", "2"]):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return build


def cuobjdump() -> str | None:
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (requirements-test.txt), else from the toolkit."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    wheel = [Path(p) / "cu13" / "bin" / "cuobjdump" for p in (spec.submodule_search_locations or [])] if spec else []
    return next((str(p) for p in wheel if p.is_file()), None) or shutil.which("cuobjdump")


def test_library_has_code_for_every_architecture(built_library):
    """The library itself carries machine code for every GPU generation (read back with cuobjdump)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    listing = subprocess.run([tool, "--list-elf", str(built_library / "libsdplugins.so")], capture_output=True,
                             text=True, check=True).stdout
    found = {line.rsplit(".", 2)[-2] for line in listing.splitlines() if ".sm_" in line}
    assert found == {f"sm_{arch}" for arch in ARCHITECTURES}, listing


@pytest.fixture(scope="session")
def abi(built_library):
    lib = ctypes.CDLL(str(built_library / "libsdplugins.so"))
    for name, (args, result) in ops._SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    return lib


FAKE = ctypes.c_void_p(16)  # never dereferenced: validation rejects the call first


@pytest.mark.parametrize("call, message", [
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 1, 8, 1, 12, 1.0, None), "head_dim must be a multiple of 8 in [8, 256], got 12"),
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 1, 8, 1, 264, 1.0, None), "got 264"),
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 0, 8, 1, 64, 1.0, None), "must be >= 1"),
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 1, 8, 1, 64, -1.0, None), "scale must be > 0"),
    (lambda lib: lib.sdp_fmhca(FAKE, FAKE, FAKE, 1, 8, 0, 1, 64, 1.0, None), "must be >= 1"),
    (lambda lib: lib.sdp_group_norm(FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 1, 30, 4, 4, 1e-5, 0, 1, None),
     "groups (4) must divide channels (30)"),
    (lambda lib: lib.sdp_group_norm(FAKE, FAKE, FAKE, FAKE, FAKE, 0, 1, 32, 4, 4, 1e-5, 0, 1, None), "workspace too small"),
    (lambda lib: lib.sdp_group_norm(FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 1, 32, 4, 4, 1e-5, 7, 1, None), "layout"),
    (lambda lib: lib.sdp_layer_norm(FAKE, FAKE, FAKE, FAKE, 4, 0, 1e-5, None), "rows and n must be >= 1"),
    (lambda lib: lib.sdp_split_gelu(None, None, FAKE, 4, 8, None), "x and y must be non-null"),
    (lambda lib: lib.sdp_seq2spatial(FAKE, None, FAKE, FAKE, 1, 4, 4, 0, None), "pointers must be non-null"),
    (lambda lib: lib.sdp_seq2spatial(FAKE, FAKE, FAKE, FAKE, 1, 4, 4, 2, None),
     "residual_layout must be NCHW (0) or NHWC (1), got 2"),
])
def test_abi_rejects_bad_arguments_with_a_message(abi, call, message):
    assert call(abi) == 1  # SDP_INVALID_ARGUMENT, before any CUDA call
    assert message in abi.sdp_last_error().decode()


def test_group_norm_workspace_size(abi):
    assert abi.sdp_group_norm_workspace_size(2, 320, 4096, 32, 0) > 0
    assert abi.sdp_group_norm_workspace_size(2, 30, 4096, 4, 0) == 0  # invalid: groups do not divide


def test_unavailable_library_is_reported_not_crashed(tmp_path):
    code = ("import plugins, torch; from plugins import torch_ops as ops; print(plugins.status());\n"
            "try:\n    ops.fmha(torch.zeros(1, 2, 1, 3, 8, dtype=torch.half), 1.0)\n"
            "except RuntimeError as e:\n    print('raised', e)")
    env = dict(os.environ, SDPLUGINS_LIBRARY=str(tmp_path / "missing.so"), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "plugin library not built" in result.stdout
    assert "raised sdplugins unavailable: plugin library not built" in result.stdout


def test_python_side_validation(monkeypatch):
    monkeypatch.setattr(ops, "_STATUS", "available")  # validation runs before any library call
    with pytest.raises(ValueError, match="must be float16"):
        ops.fmha_into(torch.zeros(1, 2, 1, 3, 8), torch.zeros(1, 2, 1, 8), 1.0)
    with pytest.raises(ValueError, match="CUDA device"):
        ops.layer_norm_into(*(torch.zeros(4, dtype=torch.half) for _ in range(4)), 1e-5)


def test_fake_implementations_give_output_shapes():
    meta = lambda *s: torch.empty(*s, dtype=torch.half, device="meta")  # noqa: E731
    assert torch.ops.sdplugins.fmha(meta(2, 77, 8, 3, 40), 0.1).shape == (2, 77, 8, 40)
    assert torch.ops.sdplugins.fmhca(meta(2, 64, 8, 40), meta(2, 77, 8, 2, 40), 0.1).shape == (2, 64, 8, 40)
    assert torch.ops.sdplugins.group_norm(meta(2, 32, 4, 4), meta(32), meta(32), 8, 1e-5, True, False).shape == (2, 32, 4, 4)
    assert torch.ops.sdplugins.layer_norm(meta(3, 5, 40), meta(40), meta(40), 1e-5).shape == (3, 5, 40)
    assert torch.ops.sdplugins.split_gelu(meta(2, 9, 20), None).shape == (2, 9, 10)
    assert torch.ops.sdplugins.seq2spatial(meta(2, 12, 7), meta(7), meta(2, 7, 3, 4)).shape == (2, 7, 3, 4)
    assert torch.ops.sdplugins.seq2spatial(meta(2, 12, 7), meta(7), meta(2, 12, 7), ops.LAYOUT_NHWC, 3).shape == (2, 7, 3, 4)
