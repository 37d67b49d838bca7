"""CLIP text encoder: token ids -> per-token text embeddings (the UNet's cross-attention context)."""

from __future__ import annotations

import torch

from models.base import StageModel


class _TextEmbeddings(torch.nn.Module):
    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        # int32 ids keep TensorRT bindings simple; the embedding gather wants int64.
        return self.text_encoder(input_ids.long(), return_dict=False)[0]


class CLIPModel(StageModel):
    name = "clip"
    component = "text_encoder"
    input_names = ("input_ids",)
    output_names = ("text_embeddings",)
    dynamic_axes = {"input_ids": {0: "B"}, "text_embeddings": {0: "B"}}

    def input_shapes(self, batch, height, width):
        return {"input_ids": (batch, self.source.text_length)}

    def output_shapes(self, batch, height, width):
        return {"text_embeddings": (batch, self.source.text_length, self.config["hidden_size"])}

    def input_dtypes(self, dtype):
        return {"input_ids": torch.int32}

    def integer_input_bound(self, name):
        return self.config["vocab_size"]

    def load_module(self, attn_implementation: str | None = None):
        from transformers import CLIPTextModel

        encoder = CLIPTextModel.from_pretrained(self.source.path, subfolder=self.component,
                                                attn_implementation=attn_implementation)
        return _TextEmbeddings(encoder)

    def export_module(self):
        # Traced through SDPA, the float32 causal mask promotes fp16 scores, and the residual stream of
        # an fp16 export turns float32 after the first layer (mixed-type LayerNorms that strongly typed
        # TensorRT rejects). The eager attention path keeps every layer in the model's precision.
        return self.load_module(attn_implementation="eager")
