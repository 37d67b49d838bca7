"""The adaptive step cache's transformer parts (models.step_cache): diffusers' First Block Cache
(diffusers.hooks.first_block_cache) on SD3's and Flux's transformers, as three stages on the transformer stage's
weights.

- head: the embeddings and the first block (transformer_blocks[0]); returns both streams after it, the time
  embedding, and the indicator: that block's residual on the image's tokens (its output less its input);
- tail: the remaining blocks (Flux's double-stream ones, then its single-stream ones) and the output head (norm_out,
  proj_out, the tokens back to latents); returns the prediction and the residual the blocks added to the image's
  tokens after the first block;
- out: the output head on the first block's tokens plus a kept residual: a cached call's prediction.

Every call runs the head; where the schedule says whole, the tail, whose residual is kept; else the out part with
the kept residual (demo.pipelines.sd3.FlowPipeline.step_cache_call). diffusers' hooks keep the text stream's residual
too, but after the blocks only the image's tokens reach the output head: the text's is never read, so not kept.

Each part calls diffusers' own modules in the order their forward does, so that a whole call's prediction is the
transformer's own. The tokens' size comes from the latents (`hidden_states`, which the tail and out parts take for it).
"""

from __future__ import annotations

import torch

from core.errors import UsageError, field
from models import FLUX_TRANSFORMER, TRANSFORMER
from models.base import StageModel
from models.transformer import (
    GUIDANCE,
    FluxTransformerModel,
    SD3TransformerModel,
    flux_positions,
    flux_time,
    packed,
    unpacked,
)
from models.unet import LATENT

HEAD, TAIL, OUT = "head", "tail", "out"
# what the head returns (the indicator among them) and the tail keeps, by name (the transformer's inputs are others)
FIRST_HIDDEN, FIRST_CONTEXT, TEMB = "first_block_hidden_states", "first_block_encoder_hidden_states", "temb"
INDICATOR, TAIL_RESIDUAL = "first_block_residual", "tail_residual"
LATENTS = "hidden_states"  # the transformer's latents, which the tail and out parts take for the tokens' size


def part_stage(denoiser: str, part: str) -> str:
    """The stage name of a transformer stage's `part` (HEAD, TAIL, OUT): transformer_head, flux_transformer_tail..."""
    return f"{denoiser}_{part}"


class _SD3Parts:
    """SD3Transformer2DModel.forward's steps."""

    @staticmethod
    def blocks(transformer):
        return list(transformer.transformer_blocks)

    @staticmethod
    def embed(transformer, named):
        hidden = transformer.pos_embed(named[LATENTS]).contiguous()  # as diffusers: pos_embed's output is strided
        temb = transformer.time_text_embed(named["timestep"], named["pooled_projections"])
        return hidden, transformer.context_embedder(named["encoder_hidden_states"]), temb

    @staticmethod
    def block_inputs(transformer, latents, context) -> dict:
        return {}

    @staticmethod
    def output(transformer, hidden, temb, latents):
        """norm_out, proj_out and diffusers' unpatchify to the latents' size."""
        hidden = transformer.proj_out(transformer.norm_out(hidden, temb))
        p, channels = transformer.config.patch_size, transformer.out_channels
        rows, columns = latents.shape[-2] // p, latents.shape[-1] // p
        hidden = hidden.reshape(shape=(hidden.shape[0], rows, columns, p, p, channels))
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(shape=(hidden.shape[0], channels, rows * p, columns * p))


class _FluxParts:
    """FluxTransformer2DModel.forward's steps, on latents packed and unpacked as models.transformer's stage does."""

    def __init__(self, patch: int):
        self.patch = patch

    @staticmethod
    def blocks(transformer):
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    def embed(self, transformer, named):
        latents = named[LATENTS]
        hidden = transformer.x_embedder(packed(latents, self.patch))
        time = flux_time(named["timestep"], latents, named.get(GUIDANCE))
        timestep = time["timestep"].to(hidden.dtype) * 1000
        pooled = named["pooled_projections"]
        temb = (transformer.time_text_embed(timestep, pooled) if time["guidance"] is None
                else transformer.time_text_embed(timestep, time["guidance"].to(hidden.dtype) * 1000, pooled))
        return hidden, transformer.context_embedder(named["encoder_hidden_states"]), temb

    def block_inputs(self, transformer, latents, context) -> dict:
        positions = flux_positions(latents, context, self.patch)
        return {"image_rotary_emb": transformer.pos_embed(torch.cat((positions["txt_ids"], positions["img_ids"])))}

    def output(self, transformer, hidden, temb, latents):
        return unpacked(transformer.proj_out(transformer.norm_out(hidden, temb)), latents.shape, self.patch)


class _Part(torch.nn.Module):
    def __init__(self, transformer, steps, input_names: tuple[str, ...]):
        super().__init__()
        self.transformer, self.steps, self.input_names = transformer, steps, input_names


class _Head(_Part):
    def forward(self, *inputs):
        named = dict(zip(self.input_names, inputs))
        embedded, context, temb = self.steps.embed(self.transformer, named)
        context, hidden = self.transformer.transformer_blocks[0](
            hidden_states=embedded, encoder_hidden_states=context, temb=temb,
            **self.steps.block_inputs(self.transformer, named[LATENTS], context))
        return hidden, context, temb, hidden - embedded


class _Tail(_Part):
    def forward(self, *inputs):
        named = dict(zip(self.input_names, inputs))
        first, context, temb, latents = named[FIRST_HIDDEN], named[FIRST_CONTEXT], named[TEMB], named[LATENTS]
        extra = self.steps.block_inputs(self.transformer, latents, context)
        hidden = first
        for block in self.steps.blocks(self.transformer)[1:]:
            context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb, **extra)
        return self.steps.output(self.transformer, hidden, temb, latents), hidden - first


class _Out(_Part):
    def forward(self, *inputs):
        named = dict(zip(self.input_names, inputs))
        hidden = named[TAIL_RESIDUAL] + named[FIRST_HIDDEN]  # diffusers' order: the kept residual plus the output
        return self.steps.output(self.transformer, hidden, named[TEMB], named[LATENTS])


_MODULES = {HEAD: _Head, TAIL: _Tail, OUT: _Out}


class TransformerPartModel(StageModel):
    """One part (HEAD, TAIL, OUT) of a transformer stage `whole` (SD3's or Flux's, without ControlNets) under the
    adaptive step cache: part of that stage (the torch backend runs it on the stage's module, one copy of the
    weights)."""

    component = "transformer"

    def __init__(self, whole: SD3TransformerModel | FluxTransformerModel, part: str):
        self.name, self.part_of = part_stage(whole.name, part), whole.name
        super().__init__(whole.source)
        self.whole, self.part = whole, part
        streams = (FIRST_HIDDEN, FIRST_CONTEXT, TEMB)
        self.input_names = {HEAD: whole.input_names, TAIL: (*streams, LATENTS),
                            OUT: (FIRST_HIDDEN, TEMB, TAIL_RESIDUAL, LATENTS)}[part]
        self.output_names = {HEAD: (*streams, INDICATOR), TAIL: (LATENT, TAIL_RESIDUAL), OUT: (LATENT,)}[part]
        tokens, text = {0: "B", 1: "tokens"}, {0: "B", 1: "text_tokens"}
        axes = {**whole.dynamic_axes, FIRST_HIDDEN: tokens, INDICATOR: tokens, TAIL_RESIDUAL: tokens,
                FIRST_CONTEXT: text, TEMB: {0: "B"}}
        self.dynamic_axes = {name: axes[name] for name in (*self.input_names, *self.output_names) if name in axes}

    @property
    def width(self) -> int:
        """The transformer's own width (its heads times their width): its blocks' tokens'."""
        return self.config["num_attention_heads"] * self.config["attention_head_dim"]

    def _shapes(self, batch, height, width) -> dict[str, tuple[int, ...]]:
        inputs = self.whole.input_shapes(batch, height, width)
        tokens, text = (batch, self.whole.tokens(height, width), self.width), inputs["encoder_hidden_states"]
        return {**inputs, **self.whole.output_shapes(batch, height, width), FIRST_HIDDEN: tokens, INDICATOR: tokens,
                TAIL_RESIDUAL: tokens, FIRST_CONTEXT: (*text[:2], self.width), TEMB: (batch, self.width)}

    def input_shapes(self, batch, height, width):
        shapes = self._shapes(batch, height, width)
        return {name: shapes[name] for name in self.input_names}

    def output_shapes(self, batch, height, width):
        shapes = self._shapes(batch, height, width)
        return {name: shapes[name] for name in self.output_names}

    def input_dtypes(self, dtype):
        return {name: self.whole.input_dtypes(dtype).get(name, dtype) for name in self.input_names}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        if self.part == HEAD:  # the transformer's own (a timestep in its range, a guidance scale)
            return self.whole.sample_inputs(batch, height, width, device, dtype, generator)
        return super().sample_inputs(batch, height, width, device, dtype, generator)

    def wrap(self, transformer) -> torch.nn.Module:
        """The part's module around the transformer stage's diffusers transformer (component_module)."""
        flux = isinstance(self.whole, FluxTransformerModel)
        steps = _FluxParts(self.source.family.packed_latents) if flux else _SD3Parts()
        return _MODULES[self.part](transformer, steps, self.input_names)

    def load_module(self):
        return self.wrap(self.whole.component_module(self.whole.load_module()))

    def component_module(self, module):
        return module.transformer

    def meta_module(self):
        return self.wrap(self.whole.component_module(self.whole.meta_module()))


CACHED_TRANSFORMERS = {TRANSFORMER: SD3TransformerModel, FLUX_TRANSFORMER: FluxTransformerModel}


def cached_transformer_stages(source) -> list[StageModel]:
    """The transformer stage (it holds the weights) and its three parts, for the adaptive step cache; a UsageError
    naming cache_threshold for a transformer of one block (nothing to skip). ControlNets are refused with the adaptive
    cache before (demo.runtime.loader): on a transformer their samples go into every block, which a cached call
    skips."""
    whole = CACHED_TRANSFORMERS[source.family.denoiser_stage](source)
    blocks = whole.config.get("num_layers", 0) + whole.config.get("num_single_layers", 0)
    if blocks < 2:
        raise UsageError(f"{field('cache_threshold')}: the transformer of model '{source.name}' has {blocks} block; "
                         "the adaptive step cache skips all but the first, so needs two at least")
    return [whole, *(TransformerPartModel(whole, part) for part in (HEAD, TAIL, OUT))]
