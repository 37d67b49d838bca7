"""ControlNet: a ControlNetModel folder (its config.json and weights, diffusers' save_pretrained layout), resolved by
name (the built-ins) or path and checked against the model it steers; and its two stages: the conditioning image ->
its embedding (once per image), and the UNet's inputs and that embedding -> the residuals it adds to the UNet's skip
connections and mid block (every step), each scaled by its own entry of `conditioning_scale` (the pipeline sets them:
the ControlNet's scale, zero outside its guidance window, and guess mode's ramp), so that one stage, and one engine,
serves every schedule.

The generated built-ins have random weights, their zero-initialised output convolutions included (a ControlNet made
from a UNet adds nothing until it is trained): for tests, CPU demos and benchmarks of the real architectures.
`shapes-controlnet` is trained (models/shapes/train_controlnet.py) and shipped with the `shapes` model it steers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import RunFailure, UsageError, field
from models import CONTROL_IMAGE, CONTROLNET, control_image_stage, controlnet_stage, shallow_controlnet_stage
from models import UNET as UNET_STAGE
from models.base import ONNX_OPSET, StageModel
from models.builtin import CONTROLNET_NAMES, GENERATED_CONTROLNETS, SHIPPED_CONTROLNETS, _to_stderr, made_once
from models.cache import content_fingerprint, default_cache_dir
from models.families import CONTROLNET as CONTROLNET_FEATURE
from models.families import Family, family_of_denoiser
from models.single_file import convert_controlnet_file
from models.source import SINGLE_FILE_DIR, ModelSource, resolve_model
from models.unet import ADDED_CONDITIONS, TEXT, UNetModel, residual_names, residual_shapes
from models.unet_cache import Branches, controlnet_shallow_residuals
from models.validate import validate_controlnet_folder

CONFIG = "config.json"
# A conditioning image's embedding: the output of its image stage, an input of its ControlNet's.
EMBEDDING = "controlnet_cond_embedding"
BUILTIN_CONTROLNET_VERSION = 2  # of the generated ones' folders (2: a manifest of their files)


@dataclass(frozen=True)
class ControlNetSource:
    """A ControlNet folder: where it is, its config, and what its files hash to (engines are keyed by it)."""

    name: str
    path: Path
    config: dict

    @functools.cached_property
    def fingerprint(self) -> str:
        """Its content for artifact keys, as the model's (content_fingerprint)."""
        return content_fingerprint([(file, file.name) for file in sorted(self.path.iterdir()) if file.is_file()])

    @property
    def family(self) -> Family:
        """The family whose denoisers it steers (from its config's class; a UNet's ControlNet: its config is a UNet's,
        less the up blocks)."""
        return family_of_denoiser(self.config)

    @property
    def diffusers_class(self) -> type:
        """diffusers' class of it (its family's ControlNets': ControlNetModel, SD3ControlNetModel, ...)."""
        import diffusers

        return getattr(diffusers, self.family.controlnet_class)

    @property
    def pools_residuals(self) -> bool:
        """Whether each of its residuals is averaged over its height and width (config global_pool_conditions: a
        ControlNet of the image's global content, as shuffle's); diffusers' pipelines run such a one in guess mode,
        its residuals not ramped."""
        return bool(self.config.get("global_pool_conditions"))

    def check_for(self, source: ModelSource) -> None:
        """A UsageError where this ControlNet cannot steer `source`'s denoiser: a family without ControlNets, another
        family; for a UNet, another cross-attention width, other latents (a transformer's is checked further by
        models.flow_controlnet.check_transformer_controlnet)."""
        own = f"{field('controlnets')} {self.name}"
        source.family.require(CONTROLNET_FEATURE, source.name, field("controlnets"))
        if self.family is not source.family:
            raise UsageError(f"{own} is a ControlNet of {self.family.label} models; model '{source.name}' is of the "
                             f"{source.family.label} family")
        if source.family.denoiser_stage != UNET_STAGE:  # a transformer's: models.stages.check_controlnets
            return
        unet = source.denoiser_config
        if self.config["cross_attention_dim"] != unet["cross_attention_dim"]:
            raise UsageError(f"{own} attends to text {self.config['cross_attention_dim']} wide; model "
                             f"'{source.name}' has {unet['cross_attention_dim']}")
        factor = 2 ** (len(self.config["conditioning_embedding_out_channels"]) - 1)
        if factor != source.vae_scale_factor:
            raise UsageError(f"{own} brings its image down {factor}x to latent size; model '{source.name}''s latents "
                             f"are {source.vae_scale_factor}x smaller than its images")
        if self.config["in_channels"] != source.latent_channels or self.config["block_out_channels"] != unet[
                "block_out_channels"]:
            raise UsageError(f"{own} is made for another UNet (channels {self.config['block_out_channels']}, latents "
                             f"{self.config['in_channels']}); model '{source.name}' has {unet['block_out_channels']}, "
                             f"{source.latent_channels}")


def resolve_controlnet(text: str, base: ModelSource | None = None) -> ControlNetSource:
    """A built-in ControlNet's name (a shipped one checked, a generated one made on first use and again where its
    folder was damaged since), a ControlNetModel folder (checked: models.validate.validate_controlnet_folder), or a
    single file in the original layout for `base` (converted once, its config from base's UNet's) (a one-line
    UsageError for anything else; a damaged shipped one: a RunFailure)."""
    where = f"{field('controlnets')} {text}"
    if text in SHIPPED_CONTROLNETS:
        package = SHIPPED_CONTROLNETS[text]
        if reason := package.damage():
            raise RunFailure(f"{where}: the ControlNet shipped with the package is damaged ({reason}): reinstall it")
        path = package.CONTROLNET_DIR
    elif text in GENERATED_CONTROLNETS:
        path = builtin_controlnet_dir(text)
    elif Path(text).is_file():
        if base is None:
            raise UsageError(f"{where}: a single-file ControlNet is converted for its model; give the model too")
        path = convert_controlnet_file(Path(text), base.denoiser_config, default_cache_dir() / SINGLE_FILE_DIR)
    else:
        path = Path(text)
    if not (path / CONFIG).exists():
        raise UsageError(f"{where}: no such ControlNet (a folder with {CONFIG}, or one of "
                         f"{', '.join(CONTROLNET_NAMES)})")
    return ControlNetSource(text, path, validate_controlnet_folder(path, where))


def builtin_controlnet_dir(name: str) -> Path:
    """The built-in ControlNet's folder, generated once (random weights, seed 0) and again where it was damaged
    since, as the built-in models are (models.builtin.made_once)."""
    directory = default_cache_dir() / "builtin" / f"{name}-c{BUILTIN_CONTROLNET_VERSION}"
    return made_once(directory, lambda staging: build_builtin_controlnet(resolve_model(GENERATED_CONTROLNETS[name]),
                                                                         staging), _to_stderr,
                     f"generating built-in ControlNet '{name}' into {directory} (once) ...",
                     lambda damage: f"built-in ControlNet '{name}' in {directory} is damaged ({damage}): generating it "
                                    "again")


def build_builtin_controlnet(base: ModelSource, directory: Path) -> None:
    """A ControlNetModel made from `base`'s UNet (its architecture and weights), every output convolution drawn at
    random instead of zero, saved into `directory`."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        unet = UNet2DConditionModel.from_pretrained(base.component_dir(base.family.denoiser))
        # its conditioning embedding brings the image down to latent size: one halving per entry after the first
        embedding = (16, 32, 96, 256, 512)[:base.vae_scale_factor.bit_length()]
        controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=embedding)
        zeroed = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                  controlnet.controlnet_cond_embedding.conv_out]
        for conv in zeroed:
            torch.nn.init.normal_(conv.weight, std=0.3 / conv.weight[0].numel() ** 0.5)
            torch.nn.init.normal_(conv.bias, std=0.02)
    finally:
        torch.random.set_rng_state(generator_state)
    controlnet.to(unet.dtype).save_pretrained(directory)


class _ConditioningEmbedding(torch.nn.Module):
    """ControlNetModel.forward's first use of its conditioning image, alone: the channel order put right, embedded."""

    def __init__(self, controlnet):
        super().__init__()
        self.embedding = controlnet.controlnet_cond_embedding
        self.flip = controlnet.config.controlnet_conditioning_channel_order == "bgr"

    def forward(self, image):
        return self.embedding(torch.flip(image, dims=[1]) if self.flip else image)


def _scaled(residuals, scales, pooled: bool) -> tuple:
    """Each residual times its scale, then, `pooled`, averaged over its height and width, as ControlNetModel.forward
    does for a ControlNet of global conditions; the average broadcast to the residual's size, so that the stage's
    outputs, and the UNet's residual inputs, have the same shapes either way."""
    scaled = (residual * scale for residual, scale in zip(residuals, scales))
    return tuple(residual.mean(dim=(2, 3), keepdim=True).expand_as(residual) if pooled else residual
                 for residual in scaled)


class _ScaledControlNet(torch.nn.Module):
    """ControlNetModel.forward on an embedded conditioning image (_ConditioningEmbedding's), each residual scaled (and,
    `pooled`, averaged: _scaled)."""

    def __init__(self, controlnet, pooled: bool):
        super().__init__()
        controlnet.controlnet_cond_embedding = torch.nn.Identity()  # its input is embedded already
        # in order, and averaged after scaling, here
        controlnet.register_to_config(controlnet_conditioning_channel_order="rgb", global_pool_conditions=False)
        self.controlnet, self.pooled = controlnet, pooled

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        *added, embedding, scales = rest
        added_cond_kwargs = dict(zip(ADDED_CONDITIONS, added)) if added else None
        down, mid = self.controlnet(sample, timestep, encoder_hidden_states, controlnet_cond=embedding,
                                    conditioning_scale=1.0, added_cond_kwargs=added_cond_kwargs, return_dict=False)
        return _scaled((*down, mid), scales, self.pooled)


class _ShallowScaledControlNet(torch.nn.Module):
    """_ScaledControlNet's residuals of skip connections 0..branch alone (models.unet_cache), on the inputs named
    `input_names` (a shallow pass from branch 0 reads neither the time nor the text)."""

    def __init__(self, controlnet, branch: int, input_names: tuple[str, ...], pooled: bool):
        super().__init__()
        self.controlnet, self.branch, self.input_names, self.pooled = controlnet, branch, input_names, pooled
        self.branches = Branches.of(controlnet.config)

    def forward(self, *inputs):
        named = dict(zip(self.input_names, inputs))
        added = {name: named[name] for name in ADDED_CONDITIONS if name in named} or None
        residuals = controlnet_shallow_residuals(self.controlnet, self.branches, self.branch, named["sample"],
                                                 named.get("timestep"), named.get(TEXT), added, named[EMBEDDING])
        return _scaled(residuals, named["conditioning_scale"], self.pooled)


class _ControlNetStage(StageModel):
    """A stage computed with a ControlNet folder's module (`controlnet`): its wrap() around its ControlNetModel."""

    component = CONTROLNET  # its own folder, not one of the model's (no LoRA is made for it)
    # what it makes goes into another stage: the embedding into the ControlNet's, the residuals into the UNet's
    feeds_a_stage = True

    def __init__(self, source: ModelSource, controlnet: ControlNetSource):
        self.source, self.config, self.controlnet = source, controlnet.config, controlnet  # its shapes: the model's

    def onnx_key(self, dtype, opset=ONNX_OPSET):
        return dict(super().onnx_key(dtype, opset), controlnet=self.controlnet.fingerprint)

    def load_module(self):
        return self.wrap(self.controlnet.diffusers_class.from_pretrained(self.controlnet.path))

    def wrap(self, controlnet) -> torch.nn.Module:
        """The stage's module around the diffusers ControlNet (the torch backend's shallow pass wraps its full
        stage's)."""
        raise NotImplementedError

    def component_module(self, module):
        return module.controlnet

    def meta_module(self):
        with torch.device("meta"):
            return self.wrap(self.controlnet.diffusers_class.from_config(self.controlnet.config))


class ControlNetStageModel(_ControlNetStage):
    """One ControlNet of a pipeline (the `index`-th: stage controlnet<index>): the UNet's own inputs, its conditioning
    image's embedding (`controlnet_cond_embedding`, ControlNetImageModel's output: the same at every step, so made
    once per image) and a scale per residual -> the residuals."""

    def __init__(self, source: ModelSource, controlnet: ControlNetSource, index: int, scale: float = 1.0):
        """`scale`: how strongly it steers (diffusers' controlnet_conditioning_scale), what the pipeline multiplies
        its residuals by (an input of the stage, not part of it)."""
        super().__init__(source, controlnet)
        self.scale = scale
        self.name = controlnet_stage(index)
        self.count = Branches.of(controlnet.config).count  # residuals: one per skip connection, then the mid's
        added = controlnet.family.added_conditions
        self.input_names = ("sample", "timestep", "encoder_hidden_states", *added, EMBEDDING, "conditioning_scale")
        self.output_names = residual_names(self.count)
        self.dynamic_axes = {"sample": {0: "B", 2: "latent_height", 3: "latent_width"},
                             "encoder_hidden_states": {0: "B"}, **{name: {0: "B"} for name in added},
                             EMBEDDING: {0: "B", 2: "latent_height", 3: "latent_width"},
                             **{name: {0: "B", 2: f"{name}_h", 3: f"{name}_w"} for name in self.output_names}}

    def wrap(self, controlnet):
        return _ScaledControlNet(controlnet, self.controlnet.pools_residuals)

    def input_shapes(self, batch, height, width):
        unet = UNetModel(self.source).input_shapes(batch, height, width)
        return {**{name: unet[name] for name in self.input_names if name in unet},
                EMBEDDING: embedding_shape(self.controlnet, batch, *self.latent_size(height, width)),
                "conditioning_scale": (self.count + 1,)}

    def output_shapes(self, batch, height, width):
        return residual_shapes(self.controlnet.config, batch, *self.latent_size(height, width))

    def input_dtypes(self, dtype):
        return {**{name: dtype for name in self.input_names}, "timestep": torch.float32,
                "conditioning_scale": torch.float32}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        inputs = super().sample_inputs(batch, height, width, device, dtype, generator)
        inputs["timestep"] = (torch.rand((1,), generator=generator) * 999).to(device)
        inputs["conditioning_scale"] = torch.rand((self.count + 1,), generator=generator).to(device)
        return inputs

    def onnx_key(self, dtype, opset=ONNX_OPSET):
        return dict(super().onnx_key(dtype, opset), conditioning=EMBEDDING)  # not the image, as its first engines took

    @property
    def artifact_name(self) -> str:
        return f"{CONTROLNET}-{self.controlnet.fingerprint}"


class ShallowControlNetStageModel(ControlNetStageModel):
    """The `index`-th ControlNet's shallow pass under the step cache (stage controlnet<index>_shallow): the residuals
    of skip connections 0..`cache_branch` alone, which a shallow UNet pass from that branch reads; with its full
    stage's weights (the torch backend runs both on one module) and scales (the same `conditioning_scale`, of which
    it reads the first cache_branch + 1). Only what those layers read is an input: a ResNet reads the time (and
    SDXL's added conditions), a transformer the text."""

    def __init__(self, source: ModelSource, controlnet: ControlNetSource, index: int, cache_branch: int,
                 scale: float = 1.0):
        super().__init__(source, controlnet, index, scale)
        self.cache_branch, self.part_of = cache_branch, self.name
        self.name = shallow_controlnet_stage(index)
        branches = Branches.of(controlnet.config)
        branches.check(cache_branch)
        foreign = controlnet.family.foreign_added_embedding(controlnet.config)  # what _time_embedding cannot make
        if foreign:
            raise UsageError(f"{field('controlnets')} {controlnet.name}: the step cache does not take a ControlNet "
                             f"with '{foreign}' added embeddings")
        unread = (() if branches.shallow_reads_time(cache_branch) else ("timestep", *ADDED_CONDITIONS)) + (
            () if branches.down_reads_text(cache_branch) else (TEXT,))
        self.input_names = tuple(name for name in self.input_names if name not in unread)
        self.output_names = self.output_names[:cache_branch + 1]
        self.dynamic_axes = {name: axes for name, axes in self.dynamic_axes.items()
                             if name in (*self.input_names, *self.output_names)}

    def input_shapes(self, batch, height, width):
        return self._read(super().input_shapes(batch, height, width), self.input_names)

    def input_dtypes(self, dtype):
        return self._read(super().input_dtypes(dtype), self.input_names)

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        return self._read(super().sample_inputs(batch, height, width, device, dtype, generator), self.input_names)

    def output_shapes(self, batch, height, width):
        return self._read(super().output_shapes(batch, height, width), self.output_names)

    @staticmethod
    def _read(values: dict, names: tuple[str, ...]) -> dict:
        return {name: values[name] for name in names}

    def wrap(self, controlnet):
        return _ShallowScaledControlNet(controlnet, self.cache_branch, self.input_names,
                                        self.controlnet.pools_residuals)

    def onnx_key(self, dtype, opset=ONNX_OPSET):
        return dict(super().onnx_key(dtype, opset), cache_branch=self.cache_branch)

    @property
    def artifact_name(self) -> str:
        return f"{super().artifact_name}.cache{self.cache_branch}"


class ControlNetImageModel(_ControlNetStage):
    """The `index`-th ControlNet's conditioning image (`controlnet_cond`, in [0, 1] at image size, diffusers' channel
    order) -> its embedding at latent size (stage controlnet<index>_image): what the ControlNet adds to its first
    layer's output, the same at every step, so the pipeline runs this once per image."""

    input_names = ("controlnet_cond",)
    output_names = (EMBEDDING,)
    dynamic_axes = {"controlnet_cond": {0: "B", 2: "height", 3: "width"},
                    EMBEDDING: {0: "B", 2: "latent_height", 3: "latent_width"}}

    def __init__(self, source: ModelSource, controlnet: ControlNetSource, index: int):
        super().__init__(source, controlnet)
        self.name = control_image_stage(index)

    def wrap(self, controlnet):
        return _ConditioningEmbedding(controlnet)

    def input_shapes(self, batch, height, width):
        return {"controlnet_cond": (batch, self.controlnet.config["conditioning_channels"], height, width)}

    def output_shapes(self, batch, height, width):
        return {EMBEDDING: embedding_shape(self.controlnet, batch, *self.latent_size(height, width))}

    def sample_inputs(self, batch, height, width, device="cpu", dtype=torch.float32, generator=None):
        shape = self.input_shapes(batch, height, width)["controlnet_cond"]
        return {"controlnet_cond": torch.rand(shape, generator=generator).to(device, dtype)}

    @property
    def artifact_name(self) -> str:
        return f"{CONTROLNET}-{self.controlnet.fingerprint}{CONTROL_IMAGE}"


def embedding_shape(controlnet: ControlNetSource, batch: int, height: int, width: int) -> tuple[int, ...]:
    """A conditioning image embedding's shape for latents of batch x height x width: the first block's channels."""
    return batch, controlnet.config["block_out_channels"][0], height, width
