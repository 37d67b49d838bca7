"""Input images as the stages take them, decoded images as pixels, and how two images differ."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:
    from diffusers.image_processor import VaeImageProcessor


def preprocess(processor: VaeImageProcessor, image: Image.Image, height: int, width: int,
               device: torch.device) -> torch.Tensor:
    """processor.preprocess(image, height=height, width=width) (diffusers' image processor, one PIL image) on
    `device`, bit for bit: resized and converted by the processor's own methods, copied as 8-bit pixels (a quarter
    of the bytes) and looked up in what the processor makes of each of the 256 values (its float work is per value),
    so no float arithmetic differs on the device (CUDA divides by a scalar through its reciprocal). The float work
    diffusers does on the CPU takes tens of milliseconds a 1024x1024 image, inside every call."""
    config = processor.config
    height, width = processor.get_default_height_width(image, height, width)
    if config.do_resize:
        image = processor.resize(image, height, width)
    if config.do_convert_rgb:
        image = processor.convert_to_rgb(image)
    elif config.do_convert_grayscale:
        image = processor.convert_to_grayscale(image)
    levels = Image.fromarray(np.arange(256, dtype=np.uint8)[None])  # every 8-bit value, in one row
    values = processor.numpy_to_pt(processor.pil_to_numpy(levels)).flatten()
    if config.do_normalize:
        values = processor.normalize(values)
    if config.do_binarize:
        values = processor.binarize(values)
    pixels = torch.from_numpy(np.array(image)).to(device)
    pixels = (pixels[None] if pixels.dim() == 2 else pixels.permute(2, 0, 1))[None].contiguous()
    return values.to(device)[pixels.int()]


def postprocess(images: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Decoded images in [-1, 1] as float32 [B, H, W, 3] in [0, 1], as diffusers' image processor makes them."""
    _warn_if_not_finite(images, dtype)
    return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def device_pixels(images: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Decoded images in [-1, 1] as 8-bit [B, H, W, 3], computed where they are: bit for bit to_uint8(postprocess())
    (the same float32 operations; halving is exact; both round half to even), with a quarter of the bytes to copy
    and no arithmetic on the CPU, where a server's per-GPU processes would otherwise do it side by side. Laid out
    [B, H, W, 3] in memory too (the channels moved on the device): a permuted view stays one through .cpu()."""
    _warn_if_not_finite(images, dtype)
    return pixel_tensor(images).cpu().numpy()


def pixel_tensor(images: torch.Tensor) -> torch.Tensor:
    """device_pixels' 8-bit [B, H, W, 3] (contiguous) left where the images are, for a caller that copies it itself
    (demo.pipelines.stream: without waiting)."""
    pixels = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).contiguous()


def _warn_if_not_finite(images: torch.Tensor, dtype: torch.dtype) -> None:
    if not torch.isfinite(images).all():  # e.g. fp16 overflow: say so rather than save black images
        warn_not_finite(dtype, stacklevel=5)


def warn_not_finite(dtype: torch.dtype, stacklevel: int = 2) -> None:
    warnings.warn(f"non-finite values in the decoded images ({dtype}); they will be saved clamped",
                  RuntimeWarning, stacklevel=stacklevel)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats to 8-bit pixels, rounding as diffusers' numpy_to_pil does."""
    return (images * 255).round().astype(np.uint8)


def image_psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB between two 8-bit images (inf where they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
