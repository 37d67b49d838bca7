"""Decoded images as pixels, and how two images differ."""

from __future__ import annotations

import warnings

import numpy as np
import torch


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
    pixels = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def _warn_if_not_finite(images: torch.Tensor, dtype: torch.dtype) -> None:
    if not torch.isfinite(images).all():  # e.g. fp16 overflow: say so rather than save black images
        warnings.warn(f"non-finite values in the decoded images ({dtype}); they will be saved clamped",
                      RuntimeWarning, stacklevel=4)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats to 8-bit pixels, rounding as diffusers' numpy_to_pil does."""
    return (images * 255).round().astype(np.uint8)


def image_psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB between two 8-bit images (inf where they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
