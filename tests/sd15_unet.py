"""sd1.5-arch's UNet (random weights) exported in fp16 and optimized with every plugin: the heaviest fixture of the
suite, so a background job (tests/background.py) that runs beside the tests before test_plugin_passes needs it.

fp16 because exporting and optimizing it take 2.5 min and 11 GB on 2 cores, against 4.7 min and 21 GB in fp32 (above
protobuf's 2 GB, polygraphy goes through disk); tiny covers both precisions. Its config's sample_size is 8 instead of
64: that only sets the latent size the export traces at, not the architecture.

    python -m tests.sd15_unet DIRECTORY   # writes DIRECTORY/sd1.5-arch-unet (the model) and DIRECTORY/onnx
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from models import STAGE_MODELS
from models.builtin import BUILTIN_MODELS
from models.source import ModelSource
from plugins.contract import PLUGIN_KEYS

SD15_UNET = dict(BUILTIN_MODELS["sd1.5-arch"]["unet"], sample_size=8)


def unet_model(tiny: ModelSource, directory: Path, config: dict, seed: int):
    """The UNet stage of a model directory written here: tiny's, with a UNet of `config` (random
    weights). The UNet stage reads nothing from the other components but the text length."""
    from diffusers import UNet2DConditionModel

    shutil.copytree(tiny.path, directory, ignore=shutil.ignore_patterns("unet"))
    torch.manual_seed(seed)
    UNet2DConditionModel(**config).save_pretrained(directory / "unet")
    return load(directory)


def load(directory: Path):
    """The UNet stage of a model directory unet_model wrote."""
    return STAGE_MODELS["unet"](ModelSource(directory.name, directory))


def build(directory: Path) -> None:
    from demo.runtime.logs import configure_library_logging
    from models.source import resolve_model

    configure_library_logging(verbose=False)
    (directory / "onnx").mkdir(parents=True)
    model = unet_model(resolve_model("tiny"), directory / "sd1.5-arch-unet", SD15_UNET, seed=3)
    model.prepare_onnx(directory / "onnx", "cpu", torch.float16, log=print, plugins=tuple(sorted(PLUGIN_KEYS)))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
