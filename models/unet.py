"""UNet: noisy latents, timestep and text embeddings -> the model's prediction (noise or v).

Its other inputs follow from its family and config (models.families): SDXL's added conditions (the second text
encoder's pooled embeddings `text_embeds` and the six time ids: original size, crop corner, target size), and, where
the model embeds the guidance scale (LCM's `time_cond_proj_dim`), that embedding (`timestep_cond`).

With the step cache (models.unet_cache), the UNet stage made with a cache branch also returns the deep features
there, and a second stage, UNetShallowModel, takes them: the shallow pass the cached steps run. Both hold the same
weights (the torch backend shares one module between them; engines each hold theirs, and a LoRA refits both).
"""

from __future__ import annotations

import torch

from models import UNET, UNET_SHALLOW
from models.base import ONNX_OPSET, StageModel
from models.unet_cache import DEEP_FEATURES, Branches, cached_forward

# diffusers' names of the added conditions (added_cond_kwargs), of the text, of the guidance scale's embedding
ADDED_CONDITIONS = ("text_embeds", "time_ids")
TEXT, LATENT, TIMESTEP_COND = "encoder_hidden_states", "latent", "timestep_cond"


class _NamedInputs(torch.nn.Module):
    """A UNet wrapper taking the stage's inputs in `input_names` order, sorted here into what diffusers' UNet takes:
    the added conditions, the guidance embedding, a ControlNet's residuals (each skip connection's, the mid block's)."""

    def __init__(self, unet, input_names: tuple[str, ...]):
        super().__init__()
        self.unet, self.input_names, self.branches = unet, input_names, Branches.of(unet.config)
        *self.down_residuals, self.mid_residual = residual_names(self.branches.count)

    def sorted(self, inputs) -> tuple[dict, dict | None, list | None]:
        named = dict(zip(self.input_names, inputs))
        added = {name: named[name] for name in ADDED_CONDITIONS if name in named} or None
        down = [named[name] for name in self.down_residuals if name in named] or None
        return named, added, down


class _Denoiser(_NamedInputs):
    """The UNet's forward, as diffusers' pipelines call it."""

    def forward(self, *inputs):
        named, added, down = self.sorted(inputs)
        return self.unet(named["sample"], named["timestep"], named[TEXT], timestep_cond=named.get(TIMESTEP_COND),
                         added_cond_kwargs=added, down_block_additional_residuals=None if down is None else tuple(down),
                         mid_block_additional_residual=named.get(self.mid_residual), return_dict=False)[0]


class _CachingDenoiser(_NamedInputs):
    """The step cache's passes (models.unet_cache.cached_forward): the full pass returns the prediction and the deep
    features at `branch`; with the deep features among the inputs, the shallow pass from them returns the prediction.
    ControlNet residuals among the inputs go in where diffusers adds them."""

    def __init__(self, unet, branch: int, input_names: tuple[str, ...]):
        super().__init__(unet, input_names)
        self.branch = branch

    def forward(self, *inputs):
        named, added, down = self.sorted(inputs)
        return cached_forward(self.unet, self.branches, self.branch, named["sample"], named["timestep"],
                              named.get(TEXT), added, named.get(DEEP_FEATURES), down, named.get(self.mid_residual),
                              named.get(TIMESTEP_COND))


class UNetModel(StageModel):
    name = UNET
    label = "UNet"
    component = "unet"
    input_names = ("sample", "timestep", "encoder_hidden_states")
    output_names = (LATENT,)
    takes_lora = True
    takes_int8 = True
    dynamic_axes = {
        "sample": {0: "B", 2: "latent_height", 3: "latent_width"},
        "encoder_hidden_states": {0: "B"},
        LATENT: {0: "B", 2: "latent_height", 3: "latent_width"},
    }

    def __init__(self, source, cache_branch: int | None = None, controlled: bool = False):
        """`cache_branch`: the step cache's branch (models.unet_cache), whose deep features the stage then returns
        too (None: no cache). `controlled`: it takes ControlNet residuals (models.controlnet.residual_names) too."""
        super().__init__(source)
        self.cache_branch, self.controlled = cache_branch, controlled
        own = (*source.family.added_conditions, *((TIMESTEP_COND,) if self.guidance_width else ()))
        if own:  # the family and config decide the inputs
            self.input_names = (*UNetModel.input_names, *own)
            self.dynamic_axes = {**UNetModel.dynamic_axes, **{name: {0: "B"} for name in own}}
        if controlled:
            shapes = residual_shapes(self.config, 1, 1, 1)
            self.input_names = (*self.input_names, *shapes)
            self.dynamic_axes = {**self.dynamic_axes,
                                 **{name: {0: "B", 2: f"{name}_h", 3: f"{name}_w"} for name in shapes}}
        if cache_branch is not None:
            Branches.of(self.config).check(cache_branch)
            self.dynamic_axes = {**self.dynamic_axes, DEEP_FEATURES: {0: "B", 2: "feature_height", 3: "feature_width"}}
            self.output_names = (*self.output_names, DEEP_FEATURES)

    @property
    def artifact_name(self) -> str:
        controlled = ".controlled" if self.controlled else ""
        return self.name + controlled + ("" if self.cache_branch is None else f".cache{self.cache_branch}")

    def feature_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        """The deep features' shape at the stage's cache branch for this batch and image size."""
        return Branches.of(self.config).feature_shape(self.cache_branch, batch, *self.latent_size(height, width))

    @property
    def added_conditions(self) -> bool:
        return bool(self.source.family.added_conditions)

    @property
    def guidance_width(self) -> int | None:
        """The width of the guidance scale's embedding it takes (None: it takes none)."""
        return self.source.family.guidance_embedding_width(self.config)

    @property
    def text_embeds_width(self) -> int:
        """The pooled text embeddings' width: the second text encoder's projection."""
        return self.source.config("text_encoder_2")["projection_dim"]

    @property
    def time_ids(self) -> int:
        """How many time ids: 6 (original size, crop corner, target size), 5 for a refiner (an aesthetic score in
        place of the target size); what the added-embedding projection takes beyond the text embeddings."""
        rest = self.config["projection_class_embeddings_input_dim"] - self.text_embeds_width
        return rest // self.config["addition_time_embed_dim"]

    def input_shapes(self, batch, height, width):
        h, w = self.latent_size(height, width)
        shapes = {
            "sample": (batch, self.config["in_channels"], h, w),
            "timestep": (1,),
            "encoder_hidden_states": (batch, self.source.text_length, self.config["cross_attention_dim"]),
        }
        if self.guidance_width:
            shapes[TIMESTEP_COND] = (batch, self.guidance_width)
        if self.added_conditions:
            shapes.update(text_embeds=(batch, self.text_embeds_width), time_ids=(batch, self.time_ids))
        if self.controlled:
            shapes.update(residual_shapes(self.config, batch, h, w))
        return shapes

    def output_shapes(self, batch, height, width):
        h, w = self.latent_size(height, width)
        shapes = {LATENT: (batch, self.config["out_channels"], h, w)}
        if DEEP_FEATURES in self.output_names:
            shapes[DEEP_FEATURES] = self.feature_shape(batch, height, width)
        return shapes

    def input_dtypes(self, dtype):
        # Timesteps reach 999 and some schedulers use fractional ones: keep them in float32.
        return {**{name: dtype for name in self.input_names}, "timestep": torch.float32}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        inputs["timestep"] = (torch.rand((1,), generator=generator) * 999).to(device)
        if self.added_conditions:  # sizes and crop corners, as the pipeline gives them
            inputs["time_ids"] = (torch.rand((batch, self.time_ids), generator=generator) * 1024).round().to(
                device=device, dtype=dtype)
        return inputs

    def load_module(self):
        from diffusers import UNet2DConditionModel

        return self.wrap(UNet2DConditionModel.from_pretrained(self.source.component_dir(self.component)))

    def wrap(self, unet) -> torch.nn.Module:
        """The stage's module around a loaded UNet2DConditionModel (the torch backend's shallow stage wraps the full
        stage's)."""
        if self.cache_branch is not None:
            return _CachingDenoiser(unet, self.cache_branch, self.input_names)
        return _Denoiser(unet, self.input_names)

    def meta_module(self):
        return self.wrap(self.component_skeleton())

    def onnx_key(self, dtype, opset=ONNX_OPSET):
        key = super().onnx_key(dtype, opset)
        key = key if self.cache_branch is None else dict(key, cache_branch=self.cache_branch)
        return dict(key, controlled=True) if self.controlled else key

    def component_module(self, module):
        return module.unet

    def component_skeleton(self):
        from diffusers import UNet2DConditionModel

        with torch.device("meta"):
            return UNet2DConditionModel.from_config(self.config)


class UNetShallowModel(UNetModel):
    """The step cache's shallow pass: the UNet's inputs (with ControlNets, the residuals of the branches it recomputes)
    and the deep features a full pass kept -> the prediction."""

    name = UNET_SHALLOW
    part_of = UNET

    def __init__(self, source, cache_branch: int, controlled: bool = False):
        super().__init__(source, cache_branch, controlled)
        branches = Branches.of(self.config)
        reads_text = branches.shallow_reads_text(cache_branch)
        deeper = residual_names(branches.count)[cache_branch + 1:]  # what they did is in the kept features
        self.input_names = (*(name for name in self.input_names if (reads_text or name != TEXT) and name not in deeper),
                            DEEP_FEATURES)
        self.output_names = (LATENT,)
        self.dynamic_axes = {name: axes for name, axes in self.dynamic_axes.items()
                             if name in (*self.input_names, *self.output_names)}

    def input_shapes(self, batch, height, width):
        shapes = {**super().input_shapes(batch, height, width), DEEP_FEATURES: self.feature_shape(batch, height, width)}
        return {name: shapes[name] for name in self.input_names}


def residual_names(count: int) -> tuple[str, ...]:
    """The UNet's residual inputs (a ControlNet's outputs), by name: one per skip connection, then the mid block's."""
    return (*(f"down_residual_{i}" for i in range(count)), "mid_residual")


def residual_shapes(config: dict, batch: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
    """Each residual's shape for latents of batch x height x width, from a UNet's or ControlNet's config."""
    branches = Branches.of(config)
    channels = config["block_out_channels"]
    shapes = [(batch, channels[0], height, width)]
    for index, (block, _) in enumerate(branches.down, start=1):
        shapes.append((batch, channels[block], *branches.branch_size(index, height, width)))
    shapes.append((batch, channels[-1], *branches.branch_size(branches.count - 1, height, width)))
    return dict(zip(residual_names(len(shapes) - 1), shapes))
