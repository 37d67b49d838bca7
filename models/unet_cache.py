"""The step cache's UNet halves (DeepCache, Ma et al., CVPR 2024): a full pass that also returns the deep features,
and a shallow pass that takes them in place of everything deeper.

A UNet2DConditionModel's skip connections ("branches"), shallowest first, are its down path's outputs in the order
the up path consumes them backwards: 0 is conv_in's output, then each down layer's (a ResNet, and its transformer
where the block has one), then each down block's downsampler's. Branch K is consumed by one up layer; the features
entering that up layer (before the skip is concatenated) are what a full pass keeps. A shallow pass recomputes
branches 0..K (conv_in and the down layers before the first that only deeper branches need) and runs the up path
from that layer on, starting from the kept features: DeepCache's `cache_branch_id` for SD 1.x/2.x and SDXL UNets
(two layers a block, so three branches a block: its layers and its downsampler).

Both passes call diffusers' own modules (ResNets, transformers, samplers, embeddings) in diffusers' order
(UNet2DConditionModel.forward and its blocks' forward), so the full pass gives the UNet's output bit for bit and
our plugins substitute into both as into the UNet.

With ControlNets, a full pass adds their residuals where diffusers does (each skip connection's, the mid block's),
and a shallow pass adds those of the branches it recomputes (0..K), which a ControlNet's own shallow pass gives
(controlnet_shallow_residuals: conv_in and the same down layers); what the deeper residuals did is in the kept
features, the mid block's included.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from core.errors import UsageError, field

DEEP_FEATURES = "deep_features"  # the tensor a full pass keeps and a shallow pass takes


@dataclass(frozen=True)
class Branches:
    """Where each skip branch of a UNet config comes from and goes: `down[j - 1]` makes branch j (block, layer; layer
    None: the block's downsampler), `up[f]` is the f-th up layer run (block, layer), which consumes branch
    len(up) - 1 - f."""

    down: tuple[tuple[int, int | None], ...]
    up: tuple[tuple[int, int], ...]
    channels: tuple[int, ...]  # block_out_channels
    final_down_size: int  # the number of downsamplers (the up path's upsamplers)
    cross_attention: tuple[tuple[bool, ...], tuple[bool, ...]]  # per down block, per up block: attends to the text

    @classmethod
    def of(cls, config: dict) -> Branches:
        blocks = len(config["down_block_types"])
        layers = config["layers_per_block"]
        layers = [layers] * blocks if isinstance(layers, int) else list(layers)
        down = []
        for block in range(blocks):
            down += [(block, layer) for layer in range(layers[block])]
            if block < blocks - 1:  # diffusers gives every down block but the last a downsampler
                down.append((block, None))
        up = tuple((block, layer) for block, count in enumerate(reversed(layers)) for layer in range(count + 1))
        attends = tuple(tuple("CrossAttn" in kind for kind in config.get(key, ()))  # a ControlNet has no up path
                        for key in ("down_block_types", "up_block_types"))
        return cls(tuple(down), up, tuple(config["block_out_channels"]), blocks - 1, attends)

    @property
    def count(self) -> int:
        return len(self.down) + 1

    def check(self, branch: int) -> None:
        if not 0 <= branch < self.count:
            raise UsageError(f"{field('cache_branch')} {branch}: this UNet's skip branches are 0 to {self.count - 1}")

    def entry_layer(self, branch: int) -> int:
        """The up layer (index into `up`) that consumes `branch`: where a shallow pass starts."""
        return self.count - 1 - branch

    def shallow_down(self, branch: int) -> tuple[tuple[int, int | None], ...]:
        """The down layers a shallow pass from `branch` recomputes (branch 0: conv_in alone)."""
        return self.down[:branch]

    def shallow_reads_time(self, branch: int) -> bool:
        """Whether a ControlNet's shallow pass from `branch` reads the time embedding: a ResNet among its layers."""
        return any(layer is not None for _, layer in self.shallow_down(branch))

    def down_reads_text(self, branch: int) -> bool:
        """Whether the down layers a shallow pass from `branch` recomputes attend to the text."""
        return any(self.cross_attention[0][block] for block, layer in self.shallow_down(branch) if layer is not None)

    def shallow_reads_text(self, branch: int) -> bool:
        """Whether a shallow pass from `branch` attends to the text (else its export has no text input)."""
        return self.down_reads_text(branch) or any(self.cross_attention[1][block]
                                                   for block, _ in self.up[self.entry_layer(branch):])

    def branch_size(self, branch: int, height: int, width: int) -> tuple[int, int]:
        """The spatial size of `branch` for latents of height x width (downsamplers: 3x3 convolutions of stride 2)."""
        halvings = sum(1 for _, layer in self.down[:branch] if layer is None)
        for _ in range(halvings):
            height, width = math.ceil(height / 2), math.ceil(width / 2)
        return height, width

    def feature_shape(self, branch: int, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        """The kept features' shape at `branch` for latents of batch x height x width: the channels of the up layer
        (or mid block) before it, at the branch's own size (they are concatenated)."""
        entry = self.entry_layer(branch)
        channels = self.channels[-1] if entry == 0 else self.channels[::-1][self.up[entry - 1][0]]
        return (batch, channels, *self.branch_size(branch, height, width))


@contextlib.contextmanager
def traced_under(*modules):
    """While an ONNX export traces: the ops inside scoped under `modules` (outermost first) as when each calls the
    next, so that nodes are named by their module's whole path (/unet/down_blocks.1/attentions.0/...), as in the plain
    UNet's export (the provenance of anonymous weights reads it, models.provenance). Nothing otherwise."""
    state, names = torch._C._get_tracing_state(), torch.jit._trace._trace_module_map
    scopes = [names[module] for module in modules] if state is not None and names else []
    for scope in scopes:
        state.push_scope(scope)
    try:
        yield
    finally:
        for _ in scopes:
            state.pop_scope()


def _down_layer(block, layer: int, hidden, emb, text):
    hidden = block.resnets[layer](hidden, emb)
    if getattr(block, "attentions", None) is not None:
        hidden = block.attentions[layer](hidden, encoder_hidden_states=text, return_dict=False)[0]
    return hidden


def _up_layer(block, layer: int, hidden, skip, emb, text):
    hidden = block.resnets[layer](torch.cat([hidden, skip], dim=1), emb)
    if getattr(block, "attentions", None) is not None:
        hidden = block.attentions[layer](hidden, encoder_hidden_states=text, return_dict=False)[0]
    return hidden


def cached_forward(unet, branches: Branches, branch: int, sample, timestep, encoder_hidden_states,
                   added_cond_kwargs=None, features=None, down_residuals=None, mid_residual=None, timestep_cond=None):
    """UNet2DConditionModel.forward (no adapter or class labels), as a full pass when `features` is None (returns the
    prediction and the features entering the up layer of `branch`) or as a shallow pass from `features` (returns the
    prediction). ControlNet residuals, where given, are added as diffusers adds them: `down_residuals` to the skip
    connections the pass computes (all of them, or 0..branch), `mid_residual` (a full pass's) to the mid block's
    output. `timestep_cond`: the guidance scale's embedding, where the UNet takes one (models.families EMBEDDED)."""
    with traced_under(unet):
        return _cached_forward(unet, branches, branch, sample, timestep, encoder_hidden_states, added_cond_kwargs,
                               features, down_residuals, mid_residual, timestep_cond)


def _time_embedding(model, sample, timestep, added_cond_kwargs):
    """A ControlNetModel's time embedding, as its forward makes it (the time ids added in for SDXL's)."""
    emb = model.time_embedding(model.time_proj(timestep.expand(sample.shape[0])).to(dtype=sample.dtype), None)
    if added_cond_kwargs is not None:  # SDXL's text-time embedding (the only one a cached ControlNet may have)
        text_embeds, time_ids = added_cond_kwargs["text_embeds"], added_cond_kwargs["time_ids"]
        time_embeds = model.add_time_proj(time_ids.flatten()).reshape((text_embeds.shape[0], -1))
        emb = emb + model.add_embedding(torch.concat([text_embeds, time_embeds], dim=-1).to(emb.dtype))
    return emb


def controlnet_shallow_residuals(controlnet, branches: Branches, branch: int, sample, timestep, encoder_hidden_states,
                                 added_cond_kwargs, embedding) -> list[torch.Tensor]:
    """A ControlNetModel's residuals for skip connections 0..branch (unscaled), as its forward computes them, from its
    conditioning image's `embedding`: conv_in and the down layers a shallow UNet pass recomputes, each through its
    zero convolution; the time embedding only where a ResNet reads it (branch 0 has none)."""
    with traced_under(controlnet):
        emb = (_time_embedding(controlnet, sample, timestep, added_cond_kwargs)
               if branches.shallow_reads_time(branch) else None)
        hidden = controlnet.conv_in(sample) + embedding
        skips = [hidden]
        for block_index, layer in branches.shallow_down(branch):
            block = controlnet.down_blocks[block_index]
            with traced_under(block):
                hidden = (block.downsamplers[0](hidden) if layer is None
                          else _down_layer(block, layer, hidden, emb, encoder_hidden_states))
            skips.append(hidden)
        return [zero_conv(skip) for skip, zero_conv in zip(skips, controlnet.controlnet_down_blocks)]


def _cached_forward(unet, branches, branch, sample, timestep, encoder_hidden_states, added_cond_kwargs, features,
                    down_residuals, mid_residual, timestep_cond):
    upsample_factor = 2 ** branches.final_down_size
    forward_upsample_size = any(size % upsample_factor != 0 for size in sample.shape[-2:])
    if unet.config.center_input_sample:
        sample = 2 * sample - 1.0
    emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), timestep_cond)
    aug_emb = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                                 added_cond_kwargs=added_cond_kwargs)
    emb = emb + aug_emb if aug_emb is not None else emb
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    text = unet.process_encoder_hidden_states(encoder_hidden_states=encoder_hidden_states,
                                              added_cond_kwargs=added_cond_kwargs)

    hidden = unet.conv_in(sample)
    skips = [hidden]
    for block_index, layer in branches.down if features is None else branches.shallow_down(branch):
        block = unet.down_blocks[block_index]
        with traced_under(block):
            hidden = (block.downsamplers[0](hidden) if layer is None
                      else _down_layer(block, layer, hidden, emb, text))
        skips.append(hidden)
    if down_residuals is not None:
        skips = [skip + residual for skip, residual in zip(skips, down_residuals, strict=True)]
    if features is None and unet.mid_block is not None:
        if getattr(unet.mid_block, "has_cross_attention", False):
            hidden = unet.mid_block(hidden, emb, encoder_hidden_states=text)
        else:
            hidden = unet.mid_block(hidden, emb)
    if mid_residual is not None:
        hidden = hidden + mid_residual

    entry = branches.entry_layer(branch)
    kept = None
    for index in range(entry if features is not None else 0, len(branches.up)):
        if index == entry:
            if features is None:
                kept = hidden
            else:
                hidden = features
        block_index, layer = branches.up[index]
        block = unet.up_blocks[block_index]
        with traced_under(block):
            hidden = _up_layer(block, layer, hidden, skips.pop(), emb, text)
            if layer == len(block.resnets) - 1 and block.upsamplers is not None:
                size = skips[-1].shape[2:] if forward_upsample_size else None
                hidden = block.upsamplers[0](hidden, size)
    if unet.conv_norm_out is not None:
        hidden = unet.conv_act(unet.conv_norm_out(hidden))
    prediction = unet.conv_out(hidden)
    return prediction if features is not None else (prediction, kept)
