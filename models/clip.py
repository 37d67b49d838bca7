"""CLIP text encoders: token ids -> per-token text embeddings (the denoiser's text context).

Which layer's states are the context is the family's (models.families: SD 1.x/2.x the last layer's of one encoder;
SDXL and SD3 the penultimate layer's of two, `clip`: CLIP ViT-L, `clip2`: OpenCLIP bigG, joined by the pipeline), and
so is whose pooled, projected output (`text_embeds`) the pipeline reads too (Family.pooled_text: SDXL's second, as one
of its UNet's added conditions; both of SD3's, its transformer's pooled projections; Flux's one CLIP's unprojected
pooled output alone, Family.projected_pooled).
"""

from __future__ import annotations

import torch

from models import CLIP, CLIP2
from models.base import StageModel

POOLED = "text_embeds"  # the pooled, projected output's name (diffusers' SDXL name for it)


class _TextEmbeddings(torch.nn.Module):
    def __init__(self, text_encoder, penultimate: bool, pooled: bool, projected: bool = True):
        super().__init__()
        self.text_encoder, self.penultimate, self.pooled, self.projected = text_encoder, penultimate, pooled, projected

    def forward(self, input_ids):
        # int32 ids keep TensorRT bindings simple; the embedding gather wants int64.
        outputs = self.text_encoder(input_ids.long(), output_hidden_states=self.penultimate, return_dict=True)
        states = outputs.hidden_states[-2] if self.penultimate else outputs[0]
        if not self.pooled:
            return states
        return states, outputs.text_embeds if self.projected else outputs.pooler_output


class CLIPModel(StageModel):
    name = CLIP
    component = "text_encoder"
    input_names = ("input_ids",)
    output_names = ("text_embeddings",)
    dynamic_axes = {"input_ids": {0: "B"}, "text_embeddings": {0: "B"}}
    encoder_class = "CLIPTextModel"
    takes_lora = True

    def __init__(self, source):
        super().__init__(source)
        if self.name in source.family.pooled_text:  # the pooled output too: projected, by the encoder's projection
            self.output_names = (*CLIPModel.output_names, POOLED)
            self.dynamic_axes = {**CLIPModel.dynamic_axes, POOLED: {0: "B"}}
            if source.family.projected_pooled:
                self.encoder_class = "CLIPTextModelWithProjection"

    def input_shapes(self, batch, height, width):
        return {"input_ids": (batch, self.source.text_length)}

    def output_shapes(self, batch, height, width):
        shapes = {"text_embeddings": (batch, self.source.text_length, self.config["hidden_size"])}
        if POOLED in self.output_names:
            width = "projection_dim" if self.source.family.projected_pooled else "hidden_size"
            shapes[POOLED] = (batch, self.config[width])
        return shapes

    def input_dtypes(self, dtype):
        return {"input_ids": torch.int32}

    def integer_input_bound(self, name):
        return self.config["vocab_size"]

    def load_module(self, attn_implementation: str | None = None):
        import transformers

        encoder = getattr(transformers, self.encoder_class).from_pretrained(
            self.source.component_dir(self.component), attn_implementation=attn_implementation)
        return self._embeddings(encoder)

    def _embeddings(self, encoder) -> torch.nn.Module:
        family = self.source.family
        return _TextEmbeddings(encoder, penultimate=family.penultimate_text, pooled=len(self.output_names) > 1,
                               projected=family.projected_pooled)

    def meta_module(self):
        import transformers

        with torch.device("meta"):
            return self._embeddings(getattr(transformers, self.encoder_class)(
                transformers.CLIPTextConfig.from_dict(self.config)))

    def component_module(self, module):
        return module.text_encoder

    def component_skeleton(self):
        import transformers

        encoder = getattr(transformers, self.encoder_class)
        with torch.device("meta"):
            return encoder(encoder.config_class.from_dict(self.config))

    def export_module(self):
        # Traced through SDPA, the float32 causal mask promotes fp16 scores, and the residual stream of
        # an fp16 export turns float32 after the first layer (mixed-type LayerNorms that strongly typed
        # TensorRT rejects). The eager attention path keeps every layer in the model's precision.
        return self.load_module(attn_implementation="eager")


class CLIP2Model(CLIPModel):
    """The second text encoder (SDXL's, SD3's: OpenCLIP bigG)."""

    name = CLIP2
    component = "text_encoder_2"
