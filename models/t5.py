"""The T5 text encoder (SD3's third, T5 v1.1 XXL): token ids -> its last layer's states, which the pipeline joins
after the CLIP encoders' along the sequence (models.families: Family.t5_length tokens)."""

from __future__ import annotations

import torch

from models import T5
from models.base import ONNX_OPSET, StageModel


class _LastStates(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids):
        # int32 ids keep TensorRT bindings simple; the embedding gather wants int64. No attention mask: diffusers'
        # SD3 pipelines attend to the padding too.
        return self.encoder(input_ids.long(), return_dict=False)[0]


class T5Model(StageModel):
    name = T5
    component = "text_encoder_3"
    input_names = ("input_ids",)
    output_names = ("text_embeddings",)
    dynamic_axes = {"input_ids": {0: "B"}, "text_embeddings": {0: "B"}}

    @property
    def text_length(self) -> int:
        return self.source.family.t5_length

    def input_shapes(self, batch, height, width):
        return {"input_ids": (batch, self.text_length)}

    def output_shapes(self, batch, height, width):
        return {"text_embeddings": (batch, self.text_length, self.config["d_model"])}

    def input_dtypes(self, dtype):
        return {"input_ids": torch.int32}

    def integer_input_bound(self, name):
        return self.config["vocab_size"]

    def load_module(self, attn_implementation: str | None = None):
        from transformers import T5EncoderModel

        return _LastStates(T5EncoderModel.from_pretrained(self.source.component_dir(self.component),
                                                          attn_implementation=attn_implementation))

    def export_module(self):
        # Traced through SDPA, a bf16 export casts its scale to complex128 (ONNX type 15, torch's bf16 number), which
        # no TensorRT parses; T5's eager attention (no scale: its weights are trained unscaled) exports as it computes.
        return self.load_module(attn_implementation="eager")

    def onnx_key(self, dtype, opset=ONNX_OPSET):
        return dict(super().onnx_key(dtype, opset), attention="eager")  # ONNX exported through SDPA before it

    def meta_module(self):
        from transformers import T5Config, T5EncoderModel

        with torch.device("meta"):
            return _LastStates(T5EncoderModel(T5Config.from_dict(self.config)))
