"""The TensorRT plugin library without TensorRT's runtime or a GPU: CMake builds libsdplugins_trt.so against
TensorRT 8.6's and 11.1's headers (<repo>/../shared/tensorrt-include) without warnings, it exports TensorRT's
plugin-library entry points, and its plugins pass tests/trt_plugin_roundtrip.cpp (creators, fields,
serialization, output dimensions, formats, workspace, errors). Also the Python loader's logic."""

import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from core.errors import UsageError
from plugins import trt_plugins
from plugins.contract import (
    LIBRARY_FILE,
    LIBRARY_NAME,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TENSORRT_NAMESPACE,
    TRT_LIBRARY_ENV,
    TRT_LIBRARY_FILE,
    TRT_LIBRARY_NAME,
)
from tests.conftest import ROOT

HEADERS = ROOT.parent / "shared" / "tensorrt-include"
VERSIONS = ("8.6", "11.1")

needs_headers = pytest.mark.skipif(not HEADERS.is_dir(), reason=f"TensorRT headers not found at {HEADERS}")
needs_tools = pytest.mark.skipif(not all(shutil.which(t) for t in ("cmake", "nvcc", "g++", "nm")),
                                 reason="cmake, nvcc, g++ or nm not installed")


def run(cmd) -> str:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{cmd}:\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
    return result.stdout + result.stderr


@pytest.fixture(scope="session")
def trt_library(tmp_path_factory):
    """Builds libsdplugins_trt.so against one header set; returns it (beside its libsdplugins.so) and the CUDA
    headers CMake found. One build tree serves both header sets, so the kernels (sm_90 only, without the sm_90a
    attention kernels, to keep it short) compile once."""
    build = tmp_path_factory.mktemp("trt-plugin-build")
    built = {}

    def build_for(version: str) -> SimpleNamespace:
        if version not in built:
            headers = HEADERS / version
            configured = run(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_CUDA_ARCHITECTURES=90",
                              "-DSDPLUGINS_SM90A=OFF", f"-DTENSORRT_INCLUDE_DIR={headers}"])
            assert f"sdplugins_trt: building libsdplugins_trt.so against TensorRT headers in {headers}" in configured
            run(["cmake", "--build", build, "-j", "2", "--target", LIBRARY_NAME])
            compiled = run(["cmake", "--build", build, "-j", "2", "--target", TRT_LIBRARY_NAME])
            assert "warning" not in compiled.lower(), compiled  # deprecations silenced for both API generations
            kept = tmp_path_factory.mktemp(f"trt-{version}")
            for name in (TRT_LIBRARY_FILE, LIBRARY_FILE):
                shutil.copy2(build / name, kept / name)
            compiler = next((build / "CMakeFiles").glob("*/CMakeCUDACompiler.cmake")).read_text()
            cuda_include = re.search(r'CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES "([^";]+)', compiler).group(1)
            built[version] = SimpleNamespace(library=kept / TRT_LIBRARY_FILE, cuda_include=cuda_include)
        return built[version]

    return build_for


@needs_headers
@needs_tools
@pytest.mark.parametrize("version", VERSIONS)
def test_library_builds_and_exports_the_entry_points(trt_library, version):
    symbols = run(["nm", "-D", "--defined-only", trt_library(version).library])
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert {"getPluginCreators", "setLoggerFinder"} <= exported
    assert not any(name.startswith("_ZN7sdp_trt") for name in exported)  # the plugin classes stay hidden


@needs_headers
@needs_tools
def test_plugins_round_trip_through_their_creators(trt_library, tmp_path):
    built = trt_library("8.6")
    program = tmp_path / "trt_plugin_roundtrip"
    run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-isystem", HEADERS / "8.6", "-isystem", built.cuda_include,
         ROOT / "tests" / "trt_plugin_roundtrip.cpp", "-o", program, "-ldl"])
    result = subprocess.run([str(program), str(built.library)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "failures: 0" in result.stdout


@needs_tools
def test_configure_without_headers_skips_the_library_and_says_why(tmp_path):
    # A find root with nothing in it hides any TensorRT this machine may have installed.
    configured = run(["cmake", "-S", ROOT, "-B", tmp_path / "build", f"-DCMAKE_FIND_ROOT_PATH={tmp_path / 'empty'}",
                      "-DCMAKE_FIND_ROOT_PATH_MODE_INCLUDE=ONLY"])
    assert "sdplugins_trt: skipped, TensorRT's NvInfer.h not found" in configured
    assert "sdplugins_trt" not in (tmp_path / "build" / "Makefile").read_text()


@needs_tools
def test_configure_with_a_wrong_header_dir_fails(tmp_path):
    result = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"),
                             f"-DTENSORRT_INCLUDE_DIR={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "has no NvInfer.h" in result.stderr and str(tmp_path) in result.stderr


# ---- the Python loader, against a stand-in for TensorRT's plugin registry ----------------------------

class FakeRegistry:
    """Registers our six creators when load_library is given a path, as TensorRT's registry would."""

    def __init__(self, loads: bool = True, names=trt_plugins.PLUGIN_NAMES):
        self.loads, self.names, self.loaded = loads, names, []
        # TensorRT's own GroupNorm: a creator of another namespace.
        self.plugin_creator_list = [SimpleNamespace(name="GroupNorm", plugin_version="1",
                                                    plugin_namespace=TENSORRT_NAMESPACE)]

    def load_library(self, path):
        self.loaded.append(path)
        if not self.loads:
            return None
        self.plugin_creator_list += [SimpleNamespace(name=n, plugin_version=PLUGIN_VERSION,
                                                     plugin_namespace=PLUGIN_NAMESPACE) for n in self.names]
        return object()


def fake_trt(registry):
    return SimpleNamespace(__version__="8.6.0", get_plugin_registry=lambda: registry)


@pytest.fixture
def built_library(tmp_path, monkeypatch):
    path = tmp_path / TRT_LIBRARY_FILE
    path.write_bytes(b"")
    monkeypatch.setenv(TRT_LIBRARY_ENV, str(path))
    return path


def test_loader_loads_once_and_checks_the_creators(built_library):
    registry = FakeRegistry()
    assert trt_plugins.load_plugin_library(fake_trt(registry)) == built_library
    assert trt_plugins.load_plugin_library(fake_trt(registry)) == built_library
    assert registry.loaded == [str(built_library)]  # a second load would be refused by TensorRT


def test_loader_reports_a_refused_library(built_library):
    with pytest.raises(UsageError, match="TensorRT 8.6.0 could not load the plugin library"):
        trt_plugins.load_plugin_library(fake_trt(FakeRegistry(loads=False)))


def test_loader_reports_missing_creators(built_library):
    registry = FakeRegistry(names=trt_plugins.PLUGIN_NAMES[:-1])
    with pytest.raises(UsageError, match="registry lacks SDPGeLU .version 1, namespace 'sdplugins'"):
        trt_plugins.load_plugin_library(fake_trt(registry))


def test_loader_says_why_when_the_library_is_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv(TRT_LIBRARY_ENV, str(tmp_path / "missing.so"))
    assert trt_plugins.status().startswith(f"TensorRT plugin library not built: {tmp_path / 'missing.so'} is missing")
    registry = FakeRegistry()
    with pytest.raises(UsageError, match="not built"):
        trt_plugins.load_plugin_library(fake_trt(registry))
    assert registry.loaded == []
