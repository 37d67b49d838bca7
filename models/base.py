"""The interface every stage model shares: I/O names, shapes, profiles, sample inputs, export, optimize."""

from __future__ import annotations

import abc
import contextlib
import shutil
from pathlib import Path
from typing import ClassVar, Iterator

import torch

from core.artifacts import artifact_lock, cached_build
from models.onnx_io import save_onnx
from models.optimizer import optimize_onnx_file
from models.provenance import export_provenance
from models.quantize import INT8_INFIX, Int8Request
from models.source import ModelSource
from plugins.contract import OURS

ONNX_OPSET = 17
# Bump when export or optimization code changes what it writes, so cached artifacts are rebuilt.
EXPORT_VERSION = 4
OPTIMIZE_VERSION = 3

Range = tuple[int, int, int]  # (min, opt, max)


class StageModel(abc.ABC):
    """One pipeline stage (CLIP, UNet, VAE decoder, VAE encoder) of a diffusers-format model.

    `batch` is always the batch the stage itself sees (twice the image batch for CLIP and UNet under
    classifier-free guidance); `height` and `width` are image sizes in pixels.
    """

    name: ClassVar[str]  # artifact and report name
    label: ClassVar[str | None] = None  # what the latency table calls it where it names it ("UNet x 4"; None: its name)
    component: ClassVar[str]  # diffusers subfolder holding the weights
    input_names: ClassVar[tuple[str, ...]]
    output_names: ClassVar[tuple[str, ...]]
    dynamic_axes: ClassVar[dict[str, dict[int, str]]]
    # Its component takes LoRA (models.lora): its ONNX records which parameters each initializer holds, for engine
    # refit (models.provenance).
    takes_lora: ClassVar[bool] = False
    # --int8 quantizes its engine (models.quantize): where int8 pays (the UNet's convolutions and token-wide linear
    # layers); the quantization finds each weight's module through the LoRA provenance, so takes_lora too.
    takes_int8: ClassVar[bool] = False
    # Another stage whose weights this one computes with (the step cache's shallow UNet pass: the UNet's): its
    # settings are that stage's, and the torch backend runs both on one module.
    part_of: ClassVar[str | None] = None
    # Its outputs are read by another stage alone, before this one runs again (a ControlNet's residuals, by the UNet):
    # the torch backend hands them over in its own memory layout, from its CUDA graph's buffers (no clone, no
    # conversion: the reading stage's graph copies them into its inputs once).
    feeds_a_stage: ClassVar[bool] = False

    def __init__(self, source: ModelSource):
        self.source = source
        self.component = source.family.stage_component(self.name, self.component)  # Flux's T5: text_encoder_2
        self.config = source.config(self.component)

    @property
    def artifact_name(self) -> str:
        """What its ONNX and engine files are named after (a variant of a stage keeps its files beside the plain
        one's)."""
        return self.name

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        return self.source.latent_shape(1, height, width)[2:]

    @abc.abstractmethod
    def input_shapes(self, batch: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Concrete shape of every input for this batch and image size."""

    @abc.abstractmethod
    def output_shapes(self, batch: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Concrete shape of every output for this batch and image size."""

    def stage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The precision this stage runs in when the pipeline runs in `dtype` (the same, unless its config asks for
        more)."""
        return dtype

    def input_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """Inputs are in the model's precision unless a stage says otherwise."""
        return {name: dtype for name in self.input_names}

    def shape_profile(self, batch: Range, height: Range, width: Range) -> dict[str, tuple[tuple[int, ...], ...]]:
        """(min, opt, max) shape per input, for TensorRT optimization profiles."""
        corners = [self.input_shapes(b, h, w) for b, h, w in zip(batch, height, width)]
        return {name: tuple(corner[name] for corner in corners) for name in self.input_names}

    def sample_inputs(
        self, batch: int, height: int, width: int, device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
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

    def component_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The diffusers or transformers model of `component` inside `module` (what load_module gave): the module
        paths LoRA files name are its (models.lora)."""
        raise NotImplementedError(f"{self.name} takes no LoRA")

    def meta_module(self) -> torch.nn.Module:
        """load_module()'s computation on the meta device, with no weight read: what its FLOPs are counted on."""
        raise NotImplementedError(f"{self.name} has no meta module")

    def component_skeleton(self) -> torch.nn.Module:
        """component_module's architecture alone, on the meta device: its module paths and weight shapes, with no
        weight read."""
        raise NotImplementedError(f"{self.name} takes no LoRA")

    # ---- ONNX ----------------------------------------------------------------------------------
    def export_onnx(self, path: Path, device: str | torch.device, dtype: torch.dtype, opset: int = ONNX_OPSET) -> None:
        """Export with dynamic axes; weights go to `<name>.data` beside `path` when above 2 GB; a stage that takes
        LoRA records beside it which parameter each initializer is (models.provenance)."""
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
        model = onnx.load(str(raw))
        shutil.rmtree(raw_dir)
        if self.takes_lora:
            export_provenance(model, module, self.component_module(module), self.component).write(path)
        del module
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

    def optimized_onnx_key(self, dtype: torch.dtype, plugins: tuple[str, ...] = (),
                           plugin_convention: str = OURS, int8: Int8Request | None = None) -> dict:
        """What makes the optimized ONNX (and so, in part, every engine built from it); `plugins` is
        the sorted tuple of plugin keys whose passes run (models.plugin_set.parse_plugin_set), and
        `plugin_convention` whose plugin nodes they emit (models.plugin_passes.CONVENTIONS); an INT8 one also has
        what made its calibration."""
        key = dict(self.onnx_key(dtype), optimize_version=OPTIMIZE_VERSION, plugins=list(plugins),
                   plugin_convention=plugin_convention)
        return key if int8 is None else dict(key, int8=int8.onnx_key())

    def optimized_onnx_path(self, onnx_dir: Path, int8: bool = False) -> Path:
        """INT8 ONNX has a file of its own, so that it and the fp16 one (and their engines) are kept side by side."""
        return onnx_dir / f"{self.artifact_name}{INT8_INFIX if int8 else ''}.opt.onnx"

    def prepare_onnx(
        self, onnx_dir: Path, device: str | torch.device, dtype: torch.dtype,
        force_export: bool = False, force_optimize: bool = False, log=print, plugins: tuple[str, ...] = (),
        plugin_convention: str = OURS, int8: Int8Request | None = None,
    ) -> Path:
        """Export and optimize through the artifact cache; returns the optimized ONNX path.

        The optimizer runs the passes of `plugins`, emitting `plugin_convention`'s nodes; what they
        replaced and skipped is stored with the artifact (models.plugin_passes.read_pass_report), and, for a
        stage that takes LoRA, where each initializer comes from (models.provenance.Provenance.read). With `int8`,
        it then quantizes the graph (models.quantize; its report: read_int8_report).

        Both files are checked by SHA-256 before anything is built from them, and a damaged one is
        rebuilt. The export happens inside the optimize step, under the optimized ONNX's lock: only
        that step reads the exported file, and no other process replaces it meanwhile.
        """
        exported = onnx_dir / f"{self.artifact_name}.onnx"

        def optimize(path: Path) -> None:
            raw = cached_build(exported, self.onnx_key(dtype), lambda p: self.export_onnx(p, device, dtype),
                               force_export, log, verify_content=True)
            optimize_onnx_file(raw, path, self.name, log, plugins, plugin_convention, provenance=self.takes_lora,
                               int8=int8)

        key = self.optimized_onnx_key(dtype, plugins, plugin_convention, int8)
        return cached_build(self.optimized_onnx_path(onnx_dir, int8 is not None), key, optimize,
                            force_export or force_optimize, log, verify_content=True)

    @contextlib.contextmanager
    def optimized_onnx(
        self, onnx_dir: Path, device: str | torch.device, dtype: torch.dtype,
        force_export: bool = False, force_optimize: bool = False, log=print, plugins: tuple[str, ...] = (),
        plugin_convention: str = OURS, int8: Int8Request | None = None,
    ) -> Iterator[Path]:
        """prepare_onnx, holding the optimized ONNX's lock until the block ends: no other process
        replaces the file (say, exporting it in another precision) while the caller builds from it."""
        with artifact_lock(self.optimized_onnx_path(onnx_dir, int8 is not None), log):
            yield self.prepare_onnx(onnx_dir, device, dtype, force_export, force_optimize, log, plugins,
                                    plugin_convention, int8)
