import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Built-in models and other cached files go to a per-session directory, not the user's cache."""
    cache = os.environ.get("DEMO_DIFFUSION_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["DEMO_DIFFUSION_CACHE"] = cache
    yield


@pytest.fixture(scope="session")
def tiny():
    from demo.logs import configure_library_logging
    from models.source import resolve_model

    configure_library_logging(verbose=False)

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_stages(tiny):
    """The tiny model's text-to-image stages with the torch backend on the CPU (loaded once)."""
    import torch

    from demo.backends import create_stages
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES

    models = [STAGE_MODELS[name](tiny) for name in TEXT_TO_IMAGE_STAGES]
    return create_stages("torch", models, torch.device("cpu"), torch.float32)
