"""The stage interface the pipeline runs, and its PyTorch implementation.

A stage maps named input tensors to named output tensors. The TensorRT backends implement the same
interface, so the pipeline never knows which one runs.
"""

from __future__ import annotations

import abc

import torch

from models.base import StageModel


class Stage(abc.ABC):
    def __init__(self, model: StageModel):
        self.model = model
        self.name = model.name

    def prepare(self, batch: int, height: int, width: int) -> None:
        """Get ready for calls at this stage batch and image size (engines size their buffers here)."""

    @abc.abstractmethod
    def __call__(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the stage on inputs named as in model.input_names; outputs are named as in output_names."""


class TorchStage(Stage):
    """Runs the diffusers/transformers module itself (the same module the ONNX export traces)."""

    def __init__(self, model: StageModel, device: torch.device, dtype: torch.dtype):
        super().__init__(model)
        self.module = model.load_module().to(device=device, dtype=dtype).eval()

    def __call__(self, feed):
        with torch.inference_mode():
            output = self.module(*(feed[name] for name in self.model.input_names))
        return {self.model.output_names[0]: output}
