"""The interface every stage model shares: I/O names, shapes, profiles, sample inputs, export, optimize."""

from __future__ import annotations

import abc
import shutil
from pathlib import Path
from typing import ClassVar

import torch

from core.artifacts import cached_build
from models.onnx_io import save_onnx
from models.optimizer import optimize_onnx_file
from models.source import ModelSource

ONNX_OPSET = 17
# Bump when export or optimization code changes what it writes, so cached artifacts are rebuilt.
EXPORT_VERSION = 3
OPTIMIZE_VERSION = 1

Range = tuple[int, int, int]  # (min, opt, max)


class StageModel(abc.ABC):
    """One pipeline stage (CLIP, UNet, VAE decoder, VAE encoder) of a diffusers-format model.

    `batch` is always the batch the stage itself sees (twice the image batch for CLIP and UNet under
    classifier-free guidance); `height` and `width` are image sizes in pixels.
    """

    name: ClassVar[str]  # artifact and report name
    component: ClassVar[str]  # diffusers subfolder holding the weights
    input_names: ClassVar[tuple[str, ...]]
    output_names: ClassVar[tuple[str, ...]]
    dynamic_axes: ClassVar[dict[str, dict[int, str]]]

    def __init__(self, source: ModelSource):
        self.source = source
        self.config = source.config(self.component)

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.source.vae_scale_factor
        return height // factor, width // factor

    @abc.abstractmethod
    def input_shapes(self, batch: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Concrete shape of every input for this batch and image size."""

    @abc.abstractmethod
    def output_shapes(self, batch: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Concrete shape of every output for this batch and image size."""

    def input_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """Inputs are in the model's precision unless a stage says otherwise."""
        return {name: dtype for name in self.input_names}

    def shape_profile(self, batch: Range, height: Range, width: Range) -> dict[str, tuple[tuple[int, ...], ...]]:
        """(min, opt, max) shape per input, for TensorRT optimization profiles."""
        corners = [self.input_shapes(b, h, w) for b, h, w in zip(batch, height, width)]
        return {name: tuple(corner[name] for corner in corners) for name in self.input_names}

    def sample_inputs(
        self, batch: int, height: int, width: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """Random inputs of the right shapes and dtypes (never zeros: they hide bugs)."""
        dtypes = self.input_dtypes(dtype)
        inputs = {}
        for name, shape in self.input_shapes(batch, height, width).items():
            if dtypes[name].is_floating_point:
                value = torch.randn(shape, generator=generator)
            else:
                value = torch.randint(0, self.integer_input_bound(name), shape, generator=generator)
            inputs[name] = value.to(device=device, dtype=dtypes[name])
        return inputs

    def integer_input_bound(self, name: str) -> int:
        raise NotImplementedError(f"{self.name} has no integer input {name}")

    @abc.abstractmethod
    def load_module(self) -> torch.nn.Module:
        """The PyTorch module, taking inputs in `input_names` order and returning one tensor per output."""

    def export_module(self) -> torch.nn.Module:
        """The module ONNX export traces; the same computation as load_module()."""
        return self.load_module()

    # ---- ONNX ----------------------------------------------------------------------------------
    def export_onnx(self, path: Path, device: str | torch.device, dtype: torch.dtype, opset: int = ONNX_OPSET) -> None:
        """Export with dynamic axes; weights go to `<name>.data` beside `path` when above 2 GB."""
        import onnx

        module = self.export_module().to(device=device, dtype=dtype).eval()
        height = width = self.source.native_image_size
        inputs = self.sample_inputs(self.export_batch, height, width, device, dtype)
        raw_dir = path.parent / "raw"  # the exporter may scatter large weights over many files here
        raw_dir.mkdir()
        raw = raw_dir / path.name
        with torch.no_grad():
            torch.onnx.export(
                module,
                tuple(inputs[n] for n in self.input_names),
                str(raw),
                input_names=list(self.input_names),
                output_names=list(self.output_names),
                dynamic_axes=self.dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        del module
        model = onnx.load(str(raw))
        shutil.rmtree(raw_dir)
        save_onnx(model, path)

    # Exporting at batch 2 keeps the tracer from specialising on a batch of one.
    export_batch: ClassVar[int] = 2

    def onnx_key(self, dtype: torch.dtype, opset: int = ONNX_OPSET) -> dict:
        return {
            "stage": self.name,
            "model": self.source.fingerprint,
            "dtype": str(dtype).removeprefix("torch."),
            "opset": opset,
            "torch": torch.__version__,
            "export_version": EXPORT_VERSION,
        }

    def prepare_onnx(
        self, onnx_dir: Path, device: str | torch.device, dtype: torch.dtype,
        force_export: bool = False, force_optimize: bool = False, log=print,
    ) -> Path:
        """Export and optimize through the artifact cache; returns the optimized ONNX path."""
        key = self.onnx_key(dtype)
        raw = cached_build(
            onnx_dir / f"{self.name}.onnx", key, lambda p: self.export_onnx(p, device, dtype), force_export, log
        )
        opt_key = dict(key, optimize_version=OPTIMIZE_VERSION)
        return cached_build(
            onnx_dir / f"{self.name}.opt.onnx",
            opt_key,
            lambda p: optimize_onnx_file(raw, p, self.name, log),
            force_export or force_optimize,
            log,
        )
