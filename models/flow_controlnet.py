"""ControlNets of the transformer families (SD3's SD3ControlNetModel, Flux's FluxControlNetModel), as diffusers'
StableDiffusion3ControlNetPipeline and FluxControlNetPipeline run them: a ControlNet stage (controlnet0, controlnet1,
...) takes the transformer's inputs, its control image's latents (the model's own VAE encoder makes them, shifted and
scaled: no image stage of its own) and its scale, and gives the samples the transformer adds to its blocks
(models.transformer's CONTROL_BLOCK, and Flux's CONTROL_SINGLE_BLOCK), each times the scale; those of several
ControlNets add up (diffusers' Multi models) and go into the transformer by name.

SD3.5 Large's ControlNets have no context embedder (they read no text) and borrow the transformer's position
embedding (use_pos_embed false), as diffusers' pipeline lends it. What their pipelines cannot run is refused in one
line when the ControlNet is checked against the model: SD3's inpainting ControlNets (extra conditioning channels),
Flux's that embed the image themselves (conditioning_embedding_channels: diffusers hands them the image, not its
latents), and Flux's union ControlNets (num_mode: they need a control mode a request cannot give yet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from core.errors import UsageError, field
from models import CONTROLNET, FLUX_TRANSFORMER, TRANSFORMER, controlnet_stage
from models.controlnet import ControlNetSource, _ControlNetStage
from models.transformer import (
    CONTROL_BLOCK,
    CONTROL_SINGLE_BLOCK,
    GUIDANCE,
    FluxTransformerModel,
    SD3TransformerModel,
    control_names,
    flux_positions,
    flux_time,
    packed,
)

if TYPE_CHECKING:
    from models.source import ModelSource

CONTROL_LATENTS = "controlnet_cond"  # a ControlNet stage's input: its control image's latents (diffusers' name)
SCALE = "conditioning_scale"  # and its scale at this step (0 outside its guidance window)


def _scaled(samples, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(sample * scale.to(sample.dtype) for sample in samples)


class _SD3ControlBlocks(torch.nn.Module):
    """SD3ControlNetModel.forward on the inputs named `input_names`: zero pooled projections where its config says
    force_zeros_for_pooled_projection, no text where it has no context embedder (joint_attention_dim null), as
    StableDiffusion3ControlNetPipeline hands them over; its samples times the scale."""

    def __init__(self, controlnet, input_names: tuple[str, ...]):
        super().__init__()
        self.controlnet, self.input_names = controlnet, input_names
        self.zero_pooled = bool(controlnet.config.force_zeros_for_pooled_projection)

    def forward(self, *inputs):
        named = dict(zip(self.input_names, inputs))
        pooled = named["pooled_projections"]
        samples = self.controlnet(hidden_states=named["hidden_states"], timestep=named["timestep"],
                                  encoder_hidden_states=named.get("encoder_hidden_states"),
                                  pooled_projections=torch.zeros_like(pooled) if self.zero_pooled else pooled,
                                  controlnet_cond=named[CONTROL_LATENTS], conditioning_scale=1.0,
                                  return_dict=False)[0]
        return _scaled(samples, named[SCALE])


class _FluxControlBlocks(torch.nn.Module):
    """FluxControlNetModel.forward on latents as the VAE makes them (the sample's and the control image's, packed as
    the transformer's stage packs them), on the inputs named `input_names`; its samples times the scale."""

    def __init__(self, controlnet, patch: int, input_names: tuple[str, ...]):
        super().__init__()
        self.controlnet, self.patch, self.input_names = controlnet, patch, input_names

    def forward(self, *inputs):
        named = dict(zip(self.input_names, inputs))
        latents, text = named["hidden_states"], named["encoder_hidden_states"]
        blocks, single_blocks = self.controlnet(
            hidden_states=packed(latents, self.patch), controlnet_cond=packed(named[CONTROL_LATENTS], self.patch),
            conditioning_scale=1.0, **flux_time(named["timestep"], latents, named.get(GUIDANCE)),
            pooled_projections=named["pooled_projections"], encoder_hidden_states=text,
            **flux_positions(latents, text, self.patch), return_dict=False)
        return _scaled((*(blocks or ()), *(single_blocks or ())), named[SCALE])


class TransformerControlNetStageModel(_ControlNetStage):
    """One ControlNet of a transformer family's pipeline (the `index`-th: stage controlnet<index>): the
    transformer's inputs (those it reads), its control image's latents and its scale -> its block samples."""

    transformer: type  # the transformer stage whose inputs it reads and whose blocks it steers
    # Whether its pipeline draws its control image's latents from the VAE encoder's Gaussian with the run's generator
    # (FluxControlNetPipeline, before the noise), or takes the Gaussian's mean (VAEEncoderModel.mean_latents):
    # StableDiffusion3ControlNetPipeline draws them from torch's global generator, which no seed sets, so the mean.
    samples_latents: bool = False

    def __init__(self, source: ModelSource, controlnet: ControlNetSource, index: int, scale: float = 1.0):
        """`scale`: how strongly it steers (diffusers' controlnet_conditioning_scale), what the pipeline multiplies
        its samples by (an input of the stage, not part of it)."""
        super().__init__(source, controlnet)
        self.scale, self.name = scale, controlnet_stage(index)
        self.steered = self.transformer(source)
        self.input_names = (*self.reads(), CONTROL_LATENTS, SCALE)
        self.output_names = control_samples(controlnet)
        self.dynamic_axes = {**{name: axes for name, axes in self.steered.dynamic_axes.items()
                                if name in self.input_names},
                             CONTROL_LATENTS: {0: "B", 2: "latent_height", 3: "latent_width"},
                             **{name: {0: "B", 1: "tokens"} for name in self.output_names}}

    def reads(self) -> tuple[str, ...]:
        """The transformer's inputs it reads."""
        return self.steered.own_inputs

    @property
    def shifts_latents(self) -> bool:
        """Whether its control image's latents are shifted by the VAE's shift factor before scaling."""
        return True

    @property
    def width(self) -> int:
        """The width of its samples (its inner dimension: the transformer's)."""
        return self.config["num_attention_heads"] * self.config["attention_head_dim"]

    def input_shapes(self, batch, height, width):
        own = self.steered.input_shapes(batch, height, width)
        return {**{name: own[name] for name in self.input_names if name in own},
                CONTROL_LATENTS: self.source.latent_shape(batch, height, width), SCALE: (1,)}

    def output_shapes(self, batch, height, width):
        return {name: (batch, self.steered.tokens(height, width), self.width) for name in self.output_names}

    def input_dtypes(self, dtype):
        own = self.steered.input_dtypes(dtype)
        return {**{name: own.get(name, dtype) for name in self.input_names}, SCALE: torch.float32}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        own = self.steered.sample_inputs(batch, height, width, device, dtype, generator)
        inputs.update({name: own[name] for name in ("timestep", GUIDANCE) if name in inputs})
        inputs[SCALE] = torch.rand((1,), generator=generator).to(device)
        return inputs

    @property
    def artifact_name(self) -> str:
        return f"{CONTROLNET}-{self.controlnet.fingerprint}"


class SD3ControlNetStageModel(TransformerControlNetStageModel):
    transformer = SD3TransformerModel

    def reads(self):
        has_text = self.config.get("joint_attention_dim") is not None  # SD3.5 Large's have no context embedder
        return tuple(name for name in super().reads() if has_text or name != "encoder_hidden_states")

    @property
    def shifts_latents(self):
        # StableDiffusion3ControlNetPipeline shifts them by 0 for a ControlNet that zeroes its pooled projections
        return not self.config.get("force_zeros_for_pooled_projection", True)

    @property
    def borrows_position_embedding(self) -> bool:
        """SD3.5 Large's ControlNets have no position embedding of their own (use_pos_embed false): the pipeline lends
        them the transformer's."""
        return self.config.get("use_pos_embed", True) is False

    def load_module(self):
        module = super().load_module()
        if self.borrows_position_embedding:
            module.controlnet.pos_embed = transformer_position_embedding(self.source).to(module.controlnet.dtype)
        return module

    def meta_module(self):
        module = super().meta_module()
        if self.borrows_position_embedding:
            with torch.device("meta"):
                module.controlnet.pos_embed = transformer_position_embedding(self.source, weights=False)
        return module

    def wrap(self, controlnet):
        return _SD3ControlBlocks(controlnet, self.input_names)


class FluxControlNetStageModel(TransformerControlNetStageModel):
    transformer = FluxTransformerModel
    samples_latents = True

    def reads(self):
        # the guidance scale where it embeds one itself (FluxControlNetPipeline asks its config, not the
        # transformer's)
        own = tuple(name for name in super().reads() if name != GUIDANCE)
        return (*own, GUIDANCE) if self.config.get("guidance_embeds") else own

    def input_shapes(self, batch, height, width):
        return {**super().input_shapes(batch, height, width), **({GUIDANCE: (1,)} if GUIDANCE in self.input_names
                                                                 else {})}

    def input_dtypes(self, dtype):
        return {**super().input_dtypes(dtype), **({GUIDANCE: torch.float32} if GUIDANCE in self.input_names else {})}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        if GUIDANCE in inputs:
            inputs[GUIDANCE] = torch.full((1,), 3.5, device=device)
        return inputs

    def wrap(self, controlnet):
        return _FluxControlBlocks(controlnet, self.source.family.packed_latents, self.input_names)


def transformer_position_embedding(source: ModelSource, weights: bool = True) -> torch.nn.Module:
    """SD3's transformer's position embedding alone (its PatchEmbed, as SD3ControlNetModel's
    _get_pos_embed_from_transformer makes it), with its weights read from the transformer's files (`weights`),
    without loading the rest."""
    from diffusers.models.embeddings import PatchEmbed
    from safetensors import safe_open

    config, prefix = source.denoiser_config, "pos_embed."
    embedding = PatchEmbed(height=config["sample_size"], width=config["sample_size"], patch_size=config["patch_size"],
                           in_channels=config["in_channels"],
                           embed_dim=config["num_attention_heads"] * config["attention_head_dim"],
                           pos_embed_max_size=config["pos_embed_max_size"])
    if weights:
        state = {}
        for file in sorted(source.component_dir(source.family.denoiser).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as opened:
                state.update({key.removeprefix(prefix): opened.get_tensor(key) for key in opened.keys()
                              if key.startswith(prefix)})
        embedding.load_state_dict(state, strict=True)
    return embedding


# the denoiser stage -> its ControlNets' stage model
CONTROLNET_STAGE_MODELS = {TRANSFORMER: SD3ControlNetStageModel, FLUX_TRANSFORMER: FluxControlNetStageModel}


def control_samples(controlnet: ControlNetSource) -> tuple[str, ...]:
    """The names of the samples a transformer's ControlNet gives: one per block of its own (Flux's: its double-stream
    blocks', then its single-stream ones')."""
    config = controlnet.config
    return (*control_names(CONTROL_BLOCK, config["num_layers"]),
            *control_names(CONTROL_SINGLE_BLOCK, config.get("num_single_layers", 0)))


def controlled_transformer_stages(source: ModelSource, controlnets) -> list:
    """The transformer taking the ControlNets' samples ((ControlNetSource, scale) each, checked:
    models.stages.check_controlnets), then each ControlNet's stage."""
    stage_model = CONTROLNET_STAGE_MODELS[source.family.denoiser_stage]
    stages = [stage_model(source, controlnet, index, scale) for index, (controlnet, scale) in enumerate(controlnets)]
    transformer = stage_model.transformer(source, stages[0].output_names, stages[0].width)
    return [transformer, *stages]


def check_together(controlnets) -> None:
    """A UsageError where a transformer's ControlNets ((ControlNetSource, scale) each) give other samples than the
    first's: diffusers' Multi models add them up block by block (a later Flux one without single-stream blocks adds
    none there: then the first's alone go in, as here, where they add up by name)."""
    first = controlnets[0][0]
    for controlnet, _ in controlnets[1:]:
        samples = control_samples(controlnet)
        if samples != control_samples(first) and not (set(samples) < set(control_samples(first)) and
                                                        not controlnet.config.get("num_single_layers", 1)):
            raise UsageError(f"{field('controlnets')} {controlnet.name} has {_layers(controlnet)}, "
                             f"{first.name} {_layers(first)}: ControlNets that steer one transformer together add "
                             "up their samples block by block, so they must have as many")


def _layers(controlnet: ControlNetSource) -> str:
    config = controlnet.config
    single = f" and {config['num_single_layers']} single-stream" if "num_single_layers" in config else ""
    return f"{config['num_layers']}{single} blocks"


def check_transformer_controlnet(controlnet: ControlNetSource, source: ModelSource) -> None:
    """A UsageError where a ControlNet of the model's family (ControlNetSource.check_for) cannot steer its
    transformer: another width of blocks, of text, of pooled projections, of latents, or another patch; or a kind its
    pipeline does not run (this module's docstring)."""
    config, transformer = controlnet.config, source.denoiser_config
    own = f"{field('controlnets')} {controlnet.name}"
    unsupported = {
        "extra_conditioning_channels": (bool(config.get("extra_conditioning_channels")),
                                        "takes extra conditioning channels (an inpainting ControlNet)"),
        "conditioning_embedding_channels": (config.get("conditioning_embedding_channels") is not None,
                                            "embeds its control image itself (conditioning_embedding_channels)"),
        "num_mode": (config.get("num_mode") is not None,
                     "is a union ControlNet (num_mode), which needs a control mode per image"),
    }
    for reason in (reason for refused, reason in unsupported.values() if refused):
        raise UsageError(f"{own} {reason}: not supported yet")
    keys = ["num_attention_heads", "attention_head_dim", "in_channels", "pooled_projection_dim"]
    keys += [key for key in ("patch_size",) if key in config and key in transformer]
    keys += ["joint_attention_dim"] if config.get("joint_attention_dim") is not None else []
    differ = [f"{key} {config[key]} (the transformer's {transformer[key]})" for key in keys
              if config[key] != transformer[key]]
    if differ:
        raise UsageError(f"{own} is made for another transformer than model '{source.name}''s: {', '.join(differ)}")
