"""Whether a request can fit in the memory of the device at hand, checked before anything loads.

The check uses a floor, never a guess: the stages' weights in the run's precision (counted from the weight files'
headers) plus the two largest activations that must exist at once, the VAE decoder's last convolution's input and
output at full resolution. A request whose floor exceeds the free memory cannot run, so it is refused in one line
with both numbers; one under it may still run out (that is caught too: demo.cli.command.run_command).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from core.errors import UsageError, field
from models.source import ModelSource
from models.validate import WEIGHTED, safetensors_header


def _parameters(path: Path) -> int:
    """How many parameters a safetensors file holds, from its header."""
    _, header = safetensors_header(path)
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def weight_bytes(source: ModelSource, dtype: torch.dtype) -> int:
    """The text encoder's, UNet's and VAE's weights in `dtype` (PyTorch .bin files: as stored)."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for component in (c for c in WEIGHTED if c in source.components):
        for path in sorted(source.component_dir(component).iterdir()):
            if path.suffix == ".safetensors":
                total += _parameters(path) * element
            elif path.suffix == ".bin":
                total += path.stat().st_size
    return total


def activation_floor(source: ModelSource, batch_size: int, height: int, width: int, dtype: torch.dtype) -> int:
    """The VAE decoder's last convolution: its input and output, both at full resolution, for the whole batch."""
    channels = source.config("vae")["block_out_channels"][0]
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * batch_size * channels * height * width * element


def free_bytes(device: torch.device) -> int | None:
    """Free memory where the stages run: the GPU's, or the host's available memory (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(source: ModelSource, batch_size: int, height: int, width: int, device: torch.device,
                 dtype: torch.dtype, loaded: bool = False) -> None:
    """A UsageError when even the request's memory floor exceeds what is free on `device` (`loaded`: the weights are
    there already, so the floor is the activations')."""
    free = free_bytes(device)
    if free is None:
        return
    weights = 0 if loaded else weight_bytes(source, dtype)
    activations = activation_floor(source, batch_size, height, width, dtype)
    if weights + activations > free:
        gib = 2**30
        raise UsageError(f"batch {batch_size} at {width}x{height} needs at least "
                         f"{(weights + activations) / gib:.1f} GiB on {device.type} ("
                         f"{'the weights loaded already' if loaded else f'weights {weights / gib:.1f} GiB'}, "
                         f"activations at least {activations / gib:.1f} GiB); {free / gib:.1f} GiB is free: use a "
                         f"smaller {field('batch_size')}, {field('height')} or {field('width')}")
