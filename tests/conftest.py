import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Under pytest-xdist (-n 2) the workers share the CPU: one thread each (and in what they start), not two each
# spinning against the other's.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"


def _no_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


def _no_tensorrt() -> str | None:
    return None if importlib.util.find_spec("tensorrt") else "TensorRT's Python package (tensorrt) is not installed"


# Marker -> why its tests cannot run here (None: they can). Tests say what they need with these markers
# (pytestmark = pytest.mark.gpu), and this is the one place that decides whether that is there.
NEEDS = {"gpu": _no_gpu, "tensorrt": _no_tensorrt}


# The slowest files, longest first (each a worker's for minutes, two waiting on a background job in line): under
# pytest-xdist they are handed out first, so that the two workers finish together rather than one alone at the end.
SLOWEST_FILES = ("test_plugin_passes.py", "test_quality.py", "test_step_cache.py", "test_serve.py",
                 "test_controlnet.py", "test_benchmark.py", "test_plugins_cpu.py", "test_lora_refit.py",
                 "test_int8.py")


def pytest_collection_modifyitems(config, items):
    if WORKER:  # every worker sorts alike: xdist checks that they collected the same
        order = {name: rank for rank, name in enumerate(SLOWEST_FILES)}
        items.sort(key=lambda item: order.get(item.path.name, len(order)))
    reasons = {}
    for item in items:
        for marker, why_not in NEEDS.items():
            if item.get_closest_marker(marker) is None:
                continue
            if marker not in reasons:
                reasons[marker] = why_not()
            if reasons[marker]:
                item.add_marker(pytest.mark.skip(reason=f"needs {marker}: {reasons[marker]}"))


def pytest_collection_finish(session):
    from tests import background

    if not WORKER:  # a worker collects every test but runs some: its jobs start where a test first needs them
        background.start_for(session.items)


def pytest_sessionfinish(session, exitstatus):
    from tests import background

    background.stop_all()


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Built-in models and other cached files go to a per-session directory, not the user's cache."""
    cache = os.environ.get("DEMO_DIFFUSION_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["DEMO_DIFFUSION_CACHE"] = cache
    yield


@pytest.fixture(scope="session")
def tiny():
    from demo.runtime.logs import configure_library_logging
    from models.source import resolve_model

    configure_library_logging(verbose=False)

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_sd35(tmp_path_factory):
    """tiny-sd3 with SD3.5's transformer features: Q/K RMSNorms, and MMDiT-X's second attention in its first block."""
    from models.builtin import BUILTIN_MODELS, build_sd3_model
    from models.source import resolve_model

    spec = BUILTIN_MODELS["tiny-sd3"]
    transformer = {**spec["transformer"], "qk_norm": "rms_norm", "dual_attention_layers": [0]}
    folder = tmp_path_factory.mktemp("tiny-sd3.5") / "model"
    build_sd3_model({**spec, "transformer": transformer}, folder)
    return resolve_model(str(folder))


@pytest.fixture(scope="session")
def tiny_stages(tiny):
    """The tiny model's text-to-image stages with the torch backend on the CPU (loaded once)."""
    from tests.parity import torch_stages

    return torch_stages(tiny)


@pytest.fixture
def no_loading(monkeypatch):
    """A test that every argument is checked before anything loads: loading a pipeline fails it."""
    from demo.runtime.loader import PipelinePlan

    def load(*_, **__):
        raise AssertionError("a model was loaded before every argument was checked")

    monkeypatch.setattr(PipelinePlan, "load", load)
