"""Plugin checks that need no GPU: the CMake build, the C ABI's argument validation, the Python ops'
validation and fake implementations, and the library-unavailable path."""

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugins import torch_ops as ops
from plugins.contract import LIBRARY_ENV, LIBRARY_FILE, TORCH_OP_NAMESPACE
from tests import background
from tests.conftest import ROOT

ARCHITECTURES = ("75", "80", "86", "89", "90")
# The Hopper attention kernels (plugins/src/attention_sm90*.cu) are built for sm_90a alone.
SM90A_OBJECTS = ("attention_sm90", "attention_sm90_generic")
SM90A_KERNELS = 9  # instantiations: D = 40, 64, 80, 160 and padded 32, 96, 128, 192, 256


@pytest.fixture(scope="session")
def built_library():
    """The library built by cmake from this checkout (tests/plugin_build.py), beside the tests before this one."""
    if not (shutil.which("cmake") and shutil.which("nvcc")):
        pytest.skip("cmake or nvcc not installed: cannot build the plugin library")
    return background.result("built_library")


def cuobjdump() -> str | None:
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (requirements-test.txt), else from the toolkit."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    wheel = [Path(p) / "cu13" / "bin" / "cuobjdump" for p in (spec.submodule_search_locations or [])] if spec else []
    return next((str(p) for p in wheel if p.is_file()), None) or shutil.which("cuobjdump")


def test_library_has_code_for_every_architecture(built_library):
    """The library itself carries machine code for every GPU generation (read back with cuobjdump), plus
    the Hopper-only sm_90a attention kernels, which no other architecture's code includes."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    listing = subprocess.run([tool, "--list-elf", str(built_library / LIBRARY_FILE)], capture_output=True,
                             text=True, check=True).stdout
    found = {line.rsplit(".", 2)[-2] for line in listing.splitlines() if ".sm_" in line}
    assert found == {f"sm_{arch}" for arch in ARCHITECTURES} | {"sm_90a"}, listing
    sm90a = sorted(line.split()[-1] for line in listing.splitlines() if line.endswith(".sm_90a.cubin"))
    assert sm90a == sorted(f"{name}.sm_90a.cubin" for name in SM90A_OBJECTS), listing


TRANSFORMER_SOURCES = ("rms_norm", "ada_layer_norm", "gelu_tanh")  # plugins/src/*.cu of the SD3/Flux kernels


def test_transformer_kernels_have_code_for_every_architecture_and_do_not_spill(built_library):
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    listing = subprocess.run([tool, "--list-elf", str(built_library / LIBRARY_FILE)], capture_output=True,
                             text=True, check=True).stdout
    cubins = {line.split()[-1] for line in listing.splitlines()}
    assert {f"{name}.sm_{arch}.cubin" for name in TRANSFORMER_SOURCES for arch in ARCHITECTURES} <= cubins, listing
    log = (built_library / "build.log").read_text()
    spills = re.findall(r"spilled to local memory in function '(\S+)'", log)
    assert not [f for f in spills if any(f"_{name}_cu_" in f for name in TRANSFORMER_SOURCES)], spills


@pytest.fixture(scope="session")
def sm90a_sass(built_library, tmp_path_factory) -> dict[str, str]:
    """SASS of each sm_90a attention kernel, by function name (cuobjdump -sass needs nvdisasm:
    nvidia-cuda-nvdisasm in requirements-test.txt)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    disassembler = Path(tool).with_name("nvdisasm")
    if not disassembler.is_file() and shutil.which("nvdisasm") is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): cuobjdump -sass needs it")
    env = dict(os.environ, PATH=f"{disassembler.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    work = tmp_path_factory.mktemp("sm90a-sass")
    kernels = {}
    for name in SM90A_OBJECTS:
        cubin = f"{name}.sm_90a.cubin"
        subprocess.run([tool, "-xelf", cubin, str(built_library / LIBRARY_FILE)], cwd=work, check=True,
                       capture_output=True, env=env)
        sass = subprocess.run([tool, "-sass", str(work / cubin)], capture_output=True, text=True, check=True,
                              env=env).stdout
        for match in re.finditer(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S):
            kernels[match.group(1)] = match.group(2)
    return kernels


def _instructions(sass: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]


def test_sm90a_attention_kernels_use_tma_wgmma_and_mbarriers(sm90a_sass):
    """Every Hopper attention kernel loads through TMA (UTMALDG) into mbarrier-tracked stages (SYNCS),
    multiplies with wgmma (HGMMA: Q K^T from shared memory, P V with P from registers and V transposed),
    rebalances registers (USETMAXREG), and never touches local memory."""
    kernels = {name: body for name, body in sm90a_sass.items() if "attention_sm90_kernel" in name}
    assert len(kernels) == SM90A_KERNELS, sorted(sm90a_sass)
    for name, body in kernels.items():
        instructions = _instructions(body)
        text = "\n".join(instructions)
        assert "UTMALDG" in text, name
        assert "SYNCS.PHASECHK" in text and "SYNCS.ARRIVE" in text, name
        assert re.search(r"HGMMA\.64x\d+x16\.F32 \S+, gdesc", text), f"{name}: no Q K^T wgmma from shared memory"
        assert re.search(r"HGMMA\.64x\d+x16\.F32 \S+, R\d+, gdesc\[\w+\]\.tnspB", text), f"{name}: no P V wgmma"
        assert "USETMAXREG.DEALLOC" in text and "USETMAXREG.TRY_ALLOC" in text, name
        assert not [i for i in instructions if re.match(r"(@!?U?P\d+ )?(LDL|STL)\b", i)], f"{name}: local memory"


def test_sm90a_softmax_overlaps_the_pv_product(sm90a_sass):
    """In the main loop the softmax of tile j runs between the wait for S_j (wgmma wait_group 1) and the
    wait for P_{j-1} V_{j-1} (wait_group 0): ptxas must not have moved the second wait above it."""
    for name, body in sm90a_sass.items():
        if "attention_sm90_kernel" not in name:
            continue
        keys = int(re.search(r"ConfigILi\d+ELi\d+ELi(\d+)E", name).group(1))
        instructions = _instructions(body)
        first = next(i for i, op in enumerate(instructions) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in op)
        second = next(i for i in range(first, len(instructions)) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in instructions[i])
        exponentials = sum("MUFU.EX2" in op for op in instructions[first:second])
        assert exponentials >= keys // 2, f"{name}: {exponentials} exp2 between the waits, want {keys // 2}"


def test_sm90a_kernels_do_not_spill(built_library):
    """ptxas's report (-Xptxas -v) for the sm_90a kernels: no spills, no stack, no serialized wgmma."""
    log = (built_library / "build.log").read_text()
    reports = re.findall(
        r"Compiling entry function '(\S*attention_sm90_kernel\S*)' for 'sm_90a'\n(.*?Used \d+ registers)", log, re.S)
    assert len({name for name, _ in reports}) == SM90A_KERNELS, log[-3000:]
    for name, report in reports:
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, f"{name}: {report}"
    assert "wgmma.mma_async instructions are serialized" not in log


@pytest.fixture(scope="session")
def abi(built_library):
    lib = ctypes.CDLL(str(built_library / LIBRARY_FILE))
    for name, (args, result) in ops._SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    return lib


FAKE = ctypes.c_void_p(16)  # never dereferenced: validation rejects the call first


@pytest.mark.parametrize("call, message", [
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 1, 8, 1, 12, 1.0, None),
     "head_dim must be a multiple of 8 in [8, 256], got 12"),
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 1, 8, 1, 264, 1.0, None), "got 264"),
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 0, 8, 1, 64, 1.0, None), "must be >= 1"),
    (lambda lib: lib.sdp_fmha(FAKE, FAKE, 1, 8, 1, 64, -1.0, None), "scale must be > 0"),
    (lambda lib: lib.sdp_fmhca(FAKE, FAKE, FAKE, 1, 8, 0, 1, 64, 1.0, None), "must be >= 1"),
    (lambda lib: lib.sdp_group_norm(FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 1, 30, 4, 4, 1e-5, 0, 1, None),
     "groups (4) must divide channels (30)"),
    (lambda lib: lib.sdp_group_norm(FAKE, FAKE, FAKE, FAKE, FAKE, 0, 1, 32, 4, 4, 1e-5, 0, 1, None),
     "workspace too small"),
    (lambda lib: lib.sdp_group_norm(FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 1, 32, 4, 4, 1e-5, 7, 1, None), "layout"),
    (lambda lib: lib.sdp_layer_norm(FAKE, FAKE, FAKE, FAKE, 4, 0, 1e-5, None), "rows and n must be >= 1"),
    (lambda lib: lib.sdp_split_gelu(None, None, FAKE, 4, 8, None), "x and y must be non-null"),
    (lambda lib: lib.sdp_seq2spatial(FAKE, None, FAKE, FAKE, 1, 4, 4, 0, None), "pointers must be non-null"),
    (lambda lib: lib.sdp_seq2spatial(FAKE, FAKE, FAKE, FAKE, 1, 4, 4, 2, None),
     "residual_layout must be NCHW (0) or NHWC (1), got 2"),
    (lambda lib: lib.sdp_rms_norm(FAKE, FAKE, FAKE, 4, 0, 1e-6, None), "rows and n must be >= 1"),
    (lambda lib: lib.sdp_rms_norm(FAKE, None, FAKE, 4, 64, 1e-6, None), "pointers must be non-null"),
    (lambda lib: lib.sdp_rms_norm(FAKE, FAKE, FAKE, 4, 64, -1.0, None), "eps must be >= 0"),
    (lambda lib: lib.sdp_ada_layer_norm(FAKE, FAKE, FAKE, FAKE, 0, 8, 64, 1e-6, None),
     "batch, seq and channels must be >= 1"),
    (lambda lib: lib.sdp_ada_layer_norm(FAKE, FAKE, None, FAKE, 2, 8, 64, 1e-6, None), "pointers must be non-null"),
    (lambda lib: lib.sdp_ada_layer_norm(FAKE, FAKE, FAKE, FAKE, 2, 8, 64, -1.0, None), "eps must be >= 0"),
    (lambda lib: lib.sdp_gelu_tanh(FAKE, None, FAKE, 0, 8, None), "rows and n must be >= 1"),
    (lambda lib: lib.sdp_gelu_tanh(None, FAKE, FAKE, 4, 8, None), "x and y must be non-null"),
])
def test_abi_rejects_bad_arguments_with_a_message(abi, call, message):
    assert call(abi) == 1  # SDP_INVALID_ARGUMENT, before any CUDA call
    assert message in abi.sdp_last_error().decode()


@pytest.mark.parametrize("value, message", [
    ("fastest", "SDPLUGINS_ATTENTION must be auto, mma or wgmma, got 'fastest'"),
    ("wgmma", "needs a GPU of compute capability 9.0"),
])
def test_attention_path_variable_is_validated(abi, monkeypatch, value, message):
    """SDPLUGINS_ATTENTION (read at every call) rejects unknown values, and wgmma where it cannot run."""
    if value == "wgmma" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("wgmma runs on this GPU (tests/test_plugins_gpu.py covers it)")
    monkeypatch.setenv("SDPLUGINS_ATTENTION", value)
    assert abi.sdp_fmha(FAKE, FAKE, 1, 8, 1, 64, 1.0, None) == 1  # rejected before any CUDA launch
    assert message in abi.sdp_last_error().decode()


def test_group_norm_workspace_size(abi):
    assert abi.sdp_group_norm_workspace_size(2, 320, 4096, 32, 0) > 0
    assert abi.sdp_group_norm_workspace_size(2, 30, 4096, 4, 0) == 0  # invalid: groups do not divide


def test_unavailable_library_is_reported_not_crashed(tmp_path):
    code = ("import plugins, torch; from plugins import torch_ops as ops; print(plugins.status());\n"
            "try:\n    ops.fmha(torch.zeros(1, 2, 1, 3, 8, dtype=torch.half), 1.0)\n"
            "except RuntimeError as e:\n    print('raised', e)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{LIBRARY_ENV: str(tmp_path / "missing.so")})
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


@pytest.mark.parametrize("call, message", [
    (lambda h: ops.rms_norm_into(h(4, 64), h(32), h(4, 64), 1e-6), "rms_norm: weight must have 64 elements"),
    (lambda h: ops.rms_norm_into(h(4, 64), h(64), h(4, 32), 1e-6), "rms_norm: out must be shaped like x"),
    (lambda h: ops.rms_norm_into(h(4, 0), h(0), h(4, 0), 1e-6), "rms_norm: x must be [..., N] with N >= 1"),
    (lambda h: ops.ada_layer_norm_into(h(2, 8), h(2, 8), h(2, 8), h(2, 8), 1e-6), "x must be [B, S, C]"),
    (lambda h: ops.ada_layer_norm_into(h(2, 5, 8), h(1, 8), h(2, 8), h(2, 5, 8), 1e-6),
     "ada_layer_norm: scale must be [B, C] = [2, 8], got [1, 8]"),
    (lambda h: ops.ada_layer_norm_into(h(2, 5, 8), h(2, 8), h(2, 1, 8), h(2, 5, 8), 1e-6),
     "ada_layer_norm: shift must be [B, C] = [2, 8], got [2, 1, 8]"),
    (lambda h: ops.ada_layer_norm_into(h(2, 5, 8), h(2, 8), h(2, 8), h(2, 5, 4), 1e-6), "out must be shaped like x"),
    (lambda h: ops.gelu_tanh_into(h(3, 10), h(5), h(3, 10)), "gelu_tanh: bias must have 10 elements, got [5]"),
    (lambda h: ops.gelu_tanh_into(h(3, 10), None, h(3, 5)), "gelu_tanh: out must be shaped like x"),
])
def test_transformer_ops_validate_shapes(monkeypatch, call, message):
    """The shape checks past _check_half (its dtype, device and contiguity checks are the other ops')."""
    monkeypatch.setattr(ops, "_check_half", lambda *args: None)
    monkeypatch.setattr(ops, "_call", lambda *args: pytest.fail("validation let a bad call through"))
    with pytest.raises(ValueError, match=re.escape(message)):
        call(lambda *shape: torch.zeros(*shape, dtype=torch.half))


def test_transformer_ops_check_dtype_and_device(monkeypatch):
    monkeypatch.setattr(ops, "_STATUS", "available")
    with pytest.raises(ValueError, match="rms_norm: tensors must be float16"):
        ops.rms_norm_into(torch.zeros(2, 8), torch.zeros(8), torch.zeros(2, 8), 1e-6)
    with pytest.raises(ValueError, match="ada_layer_norm: tensors must be on a CUDA device"):
        ops.ada_layer_norm_into(*(torch.zeros(s, dtype=torch.half) for s in ((1, 2, 8), (1, 8), (1, 8), (1, 2, 8))),
                                1e-6)
    with pytest.raises(ValueError, match="gelu_tanh: tensors must be float16"):
        ops.gelu_tanh_into(torch.zeros(2, 8), None, torch.zeros(2, 8))


def test_fake_implementations_give_output_shapes():
    meta = lambda *s: torch.empty(*s, dtype=torch.half, device="meta")  # noqa: E731
    sdp = getattr(torch.ops, TORCH_OP_NAMESPACE)
    assert sdp.fmha(meta(2, 77, 8, 3, 40), 0.1).shape == (2, 77, 8, 40)
    assert sdp.fmhca(meta(2, 64, 8, 40), meta(2, 77, 8, 2, 40), 0.1).shape == (2, 64, 8, 40)
    assert sdp.group_norm(meta(2, 32, 4, 4), meta(32), meta(32), 8, 1e-5, True, False).shape == (2, 32, 4, 4)
    assert sdp.layer_norm(meta(3, 5, 40), meta(40), meta(40), 1e-5).shape == (3, 5, 40)
    assert sdp.split_gelu(meta(2, 9, 20), None).shape == (2, 9, 10)
    assert sdp.seq2spatial(meta(2, 12, 7), meta(7), meta(2, 7, 3, 4)).shape == (2, 7, 3, 4)
    assert sdp.seq2spatial(meta(2, 12, 7), meta(7), meta(2, 12, 7), ops.LAYOUT_NHWC, 3).shape == (2, 7, 3, 4)
    assert sdp.rms_norm(meta(2, 333, 24, 64), meta(64), 1e-6).shape == (2, 333, 24, 64)
    assert sdp.ada_layer_norm(meta(2, 333, 1536), meta(2, 1536), meta(2, 1536), 1e-6).shape == (2, 333, 1536)
    assert sdp.gelu_tanh(meta(2, 9, 60), meta(60)).shape == sdp.gelu_tanh(meta(2, 9, 60), None).shape == (2, 9, 60)


def test_transformer_references_are_torchs_ops_and_the_ops_cpu_kernels():
    """The float64 references of rms_norm, ada_layer_norm and gelu_tanh against PyTorch's own ops on random data,
    and the same through torch.ops.sdplugins inside plugin_references.cpu_kernels() (how CPU tests run modules
    that call the ops)."""
    import torch.nn.functional as F

    from tests import plugin_references as refs

    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 5, 3, 64, generator=g, dtype=torch.float64), torch.randn(64, generator=g).double()
    h = torch.randn(2, 7, 24, generator=g, dtype=torch.float64) * 3 + 1
    scale, shift, bias = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 24), (2, 24), (24,)))
    expected = {"rms_norm": F.rms_norm(x, (64,), weight, 1e-3),
                "ada_layer_norm": F.layer_norm(h, (24,), eps=1e-3) * (1 + scale[:, None]) + shift[:, None],
                "gelu_tanh": F.gelu(h + bias, approximate="tanh")}
    computed = {"rms_norm": refs.rms_norm(x.numpy(), weight.numpy(), 1e-3),
                "ada_layer_norm": refs.ada_layer_norm(h.numpy(), scale.numpy(), shift.numpy(), 1e-3),
                "gelu_tanh": refs.gelu_tanh(h.numpy(), bias.numpy())}
    for name, value in computed.items():
        torch.testing.assert_close(torch.from_numpy(value), expected[name], atol=1e-12, rtol=0, msg=name)
    sdp = getattr(torch.ops, TORCH_OP_NAMESPACE)
    with refs.cpu_kernels():
        through_ops = {"rms_norm": sdp.rms_norm(x.float(), weight.float(), 1e-3),
                       "ada_layer_norm": sdp.ada_layer_norm(h.float(), scale.float(), shift.float(), 1e-3),
                       "gelu_tanh": sdp.gelu_tanh(h.float(), bias.float())}
        assert sdp.gelu_tanh(h.float(), None).shape == h.shape
        assert dict(refs.calls) == {"rms_norm": 1, "ada_layer_norm": 1, "gelu_tanh": 2}
    for name, value in through_ops.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.double(), expected[name], atol=1e-5, rtol=1e-5, msg=name)
