"""The torch backend's stage: the diffusers/transformers module itself, with our kernels, channels-last memory,
torch.compile and CUDA graphs as its settings say; and LoRA files fused into such stages' modules."""

from __future__ import annotations

import time

import torch

from demo.backends.base import LoraApplier, Stage
from demo.backends.torch.planted import plant
from demo.backends.torch.settings import (
    FALLBACK,
    GRAPHING_COMPILE_MODES,
    GraphedCall,
    TorchSettings,
    computed_part,
    shape_key,
    spec_key,
)
from models import UNET
from models.base import StageModel
from models.fp8 import Fp8Report, quantize_fp8, requantize_fp8
from models.lora import LoraFusion
from models.quantize import Calibration
from plugins.diffusers_modules import repack_qkv, substitute


def keep_float32_modules(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` cast to fp16 with the modules its models name in `_keep_in_fp32_modules` back in fp32, as
    from_pretrained(torch_dtype=float16) keeps them (transformers' rule: a name component matches). T5 v1.1's
    feed-forward output projections (`wo`) overflow fp16 with real weights (inf, then NaN text states); T5 casts their
    input to their dtype, so the product runs in fp32. Our stages load in fp32 and cast whole, hence this."""
    if dtype != torch.float16:
        return module
    for model in module.modules():
        kept = set(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, child in model.named_modules() if kept else ():
            if kept & set(name.split(".")):
                child.float()
    return module


class TorchStage(Stage):
    """Runs the diffusers/transformers module itself (the same module the ONNX export traces), with what
    `settings` asks for (settings.py): our kernels substituted into it, channels-last memory,
    torch.compile, a CUDA graph per input shape. Compiling and capturing happen in `prepare`, so a timed
    run never includes them; `prepare_seconds` says how long they took."""

    def __init__(self, model: StageModel, device: torch.device, dtype: torch.dtype,
                 settings: TorchSettings = FALLBACK, whole: TorchStage | None = None,
                 fp8: Calibration | None = None):
        """`whole`: the stage this one is part of (model.part_of), whose module (with our kernels in it) this one's
        wraps: one set of weights for both, and a LoRA fused into it is in both. `fp8`: with settings.fp8, the
        calibration the UNet's FP8 layers take their activation scales from (models.fp8; other stages ignore it)."""
        super().__init__(model)
        self.device, self.dtype, self.settings = torch.device(device), dtype, settings
        self.fp8: Fp8Report | None = None  # what quantize_fp8 did, in the stage that owns the module
        if whole is not None:
            self.module = model.wrap(whole.model.component_module(whole.module))
            self.substitution = whole.substitution
        else:
            self.module = keep_float32_modules(model.load_module().to(device=device, dtype=dtype), dtype).eval()
            plant(model, self.module, settings)  # test-only faults the settings carry (planted.py); none otherwise
            self.substitution = None
            if settings.plugins:
                self.substitution = substitute(computed_part(model.name, self.module), settings.plugins,
                                               channels_last=settings.channels_last)
            if settings.fp8 is not None and model.name == UNET:  # after the cast to dtype: the scales stay float32
                self.fp8 = quantize_fp8(model.component_module(self.module), fp8, settings.fp8_scales)
        if settings.channels_last:
            self.module.to(memory_format=torch.channels_last)
        self._forward = self.module
        if settings.compile != "none":
            mode = None if settings.compile == "default" else settings.compile
            self._forward = torch.compile(self.module, mode=mode, dynamic=False)
        self._graphs: dict[tuple, GraphedCall] = {}
        # one memory pool and one capture stream for this stage's graphs (GraphedCall: they replay one at a time)
        self._graph_pool = self._capture_stream = None
        self._prepared: set[tuple] = set()
        self.prepare_seconds = {"first_calls": 0.0, "capture": 0.0}

    def _layout(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The inputs in the module's memory layout."""
        if not self.settings.channels_last:
            return inputs
        return tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in inputs)

    def _run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = self._layout(inputs)
        graphed_by_compile = self.settings.compile in GRAPHING_COMPILE_MODES
        if graphed_by_compile:
            torch.compiler.cudagraph_mark_step_begin()
        outputs = self._forward(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if graphed_by_compile:  # its graph's next replay overwrites these outputs
            return tuple(t.clone(memory_format=self._output_format) for t in outputs)
        return outputs if self._output_format is torch.preserve_format else tuple(t.contiguous() for t in outputs)

    @property
    def _output_format(self) -> torch.memory_format:
        """Outputs another stage reads stay in the module's layout (that stage's, too); the pipeline's are made
        contiguous."""
        keep = self.model.feeds_a_stage or not self.settings.channels_last
        return torch.preserve_format if keep else torch.contiguous_format

    def _inputs(self, feed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(feed[name] for name in self.model.input_names)

    def _get_ready(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """First calls (compiling, with torch.compile; cudagraph trees record on the third) and capture."""
        start = time.perf_counter()
        for _ in range(3 if self.settings.compile in GRAPHING_COMPILE_MODES else 1):
            self._run(*inputs)
        self._add_seconds("first_calls", start)
        if self.settings.cuda_graph:
            start = time.perf_counter()
            # static buffers in the module's layout: what another stage hands over in it is copied in as is
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
                self._capture_stream = torch.cuda.Stream(device=self.device)
            self._graphs[shape_key(inputs)] = GraphedCall(self._run, self._layout(inputs),
                                                          clone_outputs=not self.model.feeds_a_stage,
                                                          pool=self._graph_pool, stream=self._capture_stream)
            self._add_seconds("capture", start)
        self._prepared.add(shape_key(inputs))

    def _add_seconds(self, kind: str, start: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prepare_seconds[kind] += time.perf_counter() - start

    def prepare(self, batch, height, width):
        if self.settings.compile == "none" and not self.settings.cuda_graph:
            return
        shapes, dtypes = self.model.input_shapes(batch, height, width), self.model.input_dtypes(self.dtype)
        if spec_key((shapes[n], dtypes[n]) for n in self.model.input_names) in self._prepared:
            return  # the pipeline prepares before every run
        with torch.inference_mode():
            self._get_ready(self._inputs(self.model.sample_inputs(batch, height, width, self.device, self.dtype)))

    def __call__(self, feed):
        inputs = self._inputs(feed)
        with torch.inference_mode():
            if self.settings.cuda_graph:
                if shape_key(inputs) not in self._graphs:  # a shape nobody prepared for
                    self._get_ready(inputs)
                outputs = self._graphs[shape_key(inputs)](*inputs)
            else:
                outputs = self._run(*inputs)
        return dict(zip(self.model.output_names, outputs))

    @classmethod
    def lora_applier(cls, stages: list[TorchStage]) -> LoraApplier:
        return FusedLoras(stages)

    def close(self) -> None:
        """Drops the module, its compiled code and graphs (their memory returns to torch's cache)."""
        self.module = self._forward = None
        self._graphs.clear()
        self._prepared.clear()


class FusedLoras(LoraApplier):
    """LoRA files fused into the stages' modules in place (models.lora.LoraFusion keeps the weights they change, so
    that switching never drifts)."""

    def __init__(self, stages: list[TorchStage]):
        self.stages = stages
        self.fusion = LoraFusion({stage.model.component: stage.model.component_module(stage.module)
                                  for stage in stages})

    def set(self, files):
        self.fusion.set(files)
        for stage in self.stages:
            if stage.substitution is not None and not stage.model.part_of:  # our fMHA reads a packed copy of Q, K, V
                repack_qkv(stage.model.component_module(stage.module))
            if stage.fp8 is not None:  # the FP8 layers read an FP8 copy of the fused weights
                requantize_fp8(stage.model.component_module(stage.module))
        return None
