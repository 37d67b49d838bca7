"""UNet: noisy latents, timestep and text embeddings -> the model's prediction (noise or v).

An SDXL UNet (`addition_embed_type` "text_time" in its config) also takes the added conditions: the second
text encoder's pooled embeddings (`text_embeds`) and the six time ids (original size, crop corner, target size).

With the step cache (models.unet_cache), the UNet stage made with a cache branch also returns the deep features
there, and a second stage, UNetShallowModel, takes them: the shallow pass the cached steps run. Both hold the same
weights (the torch backend shares one module between them; engines each hold theirs, and a LoRA refits both).
"""

from __future__ import annotations

import torch

from models import UNET, UNET_SHALLOW
from models.base import ONNX_OPSET, StageModel
from models.unet_cache import DEEP_FEATURES, Branches, cached_forward

ADDED_CONDITIONS = ("text_embeds", "time_ids")
TEXT, LATENT = "encoder_hidden_states", "latent"


class _Denoiser(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, *added):
        added_cond_kwargs = dict(zip(ADDED_CONDITIONS, added)) if added else None
        return self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added_cond_kwargs,
                         return_dict=False)[0]


class _ControlledDenoiser(_Denoiser):
    """The UNet with a ControlNet's residuals (the last inputs: each skip connection's, then the mid block's) added in,
    as diffusers' ControlNet pipelines pass them."""

    def __init__(self, unet, residuals: int):
        super().__init__(unet)
        self.residuals = residuals

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        added, down, mid = rest[:-self.residuals - 1], rest[-self.residuals - 1:-1], rest[-1]
        added_cond_kwargs = dict(zip(ADDED_CONDITIONS, added)) if added else None
        return self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added_cond_kwargs,
                         down_block_additional_residuals=tuple(down), mid_block_additional_residual=mid,
                         return_dict=False)[0]


class _CachingDenoiser(_Denoiser):
    """The full pass: the prediction and the deep features at `branch`."""

    def __init__(self, unet, branch: int):
        super().__init__(unet)
        self.branches, self.branch = Branches.of(unet.config), branch

    def forward(self, sample, timestep, encoder_hidden_states, *added):
        added_cond_kwargs = dict(zip(ADDED_CONDITIONS, added)) if added else None
        return cached_forward(self.unet, self.branches, self.branch, sample, timestep, encoder_hidden_states,
                              added_cond_kwargs)


class _ShallowDenoiser(_CachingDenoiser):
    """The shallow pass from the deep features (the last input); without the text embeddings where it does not attend
    to the text (an ONNX export drops an input nothing reads)."""

    def __init__(self, unet, branch: int):
        super().__init__(unet, branch)
        self.reads_text = self.branches.shallow_reads_text(branch)

    def forward(self, sample, timestep, *rest):
        added, features, text = rest[:-1], rest[-1], None
        if self.reads_text:
            text, added = added[0], added[1:]
        added_cond_kwargs = dict(zip(ADDED_CONDITIONS, added)) if added else None
        return cached_forward(self.unet, self.branches, self.branch, sample, timestep, text, added_cond_kwargs,
                              features)


class UNetModel(StageModel):
    name = UNET
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
        if self.added_conditions:  # the config decides the inputs
            self.input_names = (*UNetModel.input_names, *ADDED_CONDITIONS)
            self.dynamic_axes = {**UNetModel.dynamic_axes, **{name: {0: "B"} for name in ADDED_CONDITIONS}}
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
        if self.controlled:
            return f"{self.name}.controlled"
        return self.name if self.cache_branch is None else f"{self.name}.cache{self.cache_branch}"

    def feature_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        """The deep features' shape at the stage's cache branch for this batch and image size."""
        return Branches.of(self.config).feature_shape(self.cache_branch, batch, *self.latent_size(height, width))

    @property
    def added_conditions(self) -> bool:
        return self.config.get("addition_embed_type") == "text_time"

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
        if self.controlled:
            return _ControlledDenoiser(unet, Branches.of(self.config).count)
        return _Denoiser(unet) if self.cache_branch is None else _CachingDenoiser(unet, self.cache_branch)

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
    """The step cache's shallow pass: the UNet's inputs and the deep features a full pass kept -> the prediction."""

    name = UNET_SHALLOW
    part_of = UNET

    def __init__(self, source, cache_branch: int):
        super().__init__(source, cache_branch)
        reads_text = Branches.of(self.config).shallow_reads_text(cache_branch)
        self.input_names = (*(name for name in self.input_names if reads_text or name != TEXT), DEEP_FEATURES)
        self.output_names = (LATENT,)
        self.dynamic_axes = {name: axes for name, axes in self.dynamic_axes.items()
                             if name in (*self.input_names, *self.output_names)}

    def input_shapes(self, batch, height, width):
        shapes = {**super().input_shapes(batch, height, width), DEEP_FEATURES: self.feature_shape(batch, height, width)}
        return {name: shapes[name] for name in self.input_names}

    def wrap(self, unet):
        return _ShallowDenoiser(unet, self.cache_branch)


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
