"""What a model family is: the facts that tell one architecture's pipelines from another's, declared once, so that no
code outside the families asks "is this SDXL?" (models.families chooses the family from the model's own config).

A family declares its components (and which a model may lack), its denoiser's component (no code finds the denoiser
by the name "unet"), its text stages and how they read the text encoders, the added conditions its denoiser takes,
its guidance kind, its precisions and the precision each stage runs in, its tuned-defaults key, its LoRA components,
diffusers' pipelines it matches (for parity and the diffusers contender) and the features it supports. Its pipeline
classes per mode are in demo.pipelines (a layer above this one), keyed by the family's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from core import errors
from core.errors import UsageError
from models import UNET
from models.recommended import Recommended

# How a model is guided (Family.guidance):
CLASSIFIER_FREE = "classifier-free"  # two halves a step, the unconditional and the conditional (the batch doubled)
EMBEDDED = "embedded"  # the scale goes in as an embedding of the denoiser's (LCM's time_cond_proj_dim): one half
NO_GUIDANCE = "none"  # one half, no scale (also what classifier-free guidance becomes at a scale of 1 or below)
GUIDANCE_KINDS = (CLASSIFIER_FREE, EMBEDDED, NO_GUIDANCE)
# The denoiser config's key for the width of its guidance-scale embedding (EMBEDDED: LCM's UNets)
GUIDANCE_EMBEDDING_KEY = "time_cond_proj_dim"

# What a request does, from the images it brings (demo.request): each family runs some of these modes.
TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINTING = "text-to-image", "image-to-image", "inpainting"
MODES = (TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINTING)
# What a family may support (Family.features: these, and the modes beyond text-to-image); a spec or request for one
# it lacks is refused naming the family.
STEP_CACHE, CONTROLNET, REFINER, LORA, INT8 = "the step cache", "ControlNets", "a refiner", "LoRA", "INT8"
ADAPTIVE_CACHE = "the adaptive step cache"
CACHE_FORECAST = "the step cache's forecast"  # of First Block Cache's residual: the transformers'
# Its stages build into TensorRT engines (the backends that build them ask for it: Backend.family_feature); a family
# without it runs on the torch backend only, its engines not built yet.
ENGINES = "TensorRT engines"
# Its ControlNet pipelines take guess mode (a request's guess_mode).
GUESS_MODE = "guess mode"
# A precision (Family.precisions): the UNet's Linear GEMMs in FP8 e4m3 on the torch backend (models.fp8), everything
# else in FP8_BASE, as a run in that precision.
FP8, FP8_BASE = "fp8", "fp16"
# How precision fp8 scales its operands (models.fp8): per tensor, the activation's from the calibration (static) or
# from each input (dynamic); or per row, each activation row's and each weight row's from itself (row).
FP8_SCALES = ("static", "dynamic", "row")
DEFAULT_FP8_SCALES = "static"
UNET_PRECISIONS = ("fp16", "fp32", FP8)


@dataclass(frozen=True, eq=False)  # one object per family: compared by identity
class Family:
    """One family of models (SD 1.x/2.x, SDXL, ...): what the toolkit needs to know of it, nothing of its weights."""

    name: str  # the registry's key, and what demo.pipelines keys its pipelines by
    label: str  # as messages name it
    pipeline_classes: tuple[str, ...]  # model_index.json `_class_name`s it runs
    components: tuple[str, ...]  # every component a model of it may have (models.validate.COMPONENTS' names)
    text_stages: tuple[str, ...]  # the text encoders' stages, in the order the pipeline runs them
    # mode -> diffusers' pipelines for it, without and with ControlNets (None: diffusers has none), for parity tests
    # and diffusers' contender
    diffusers_pipelines: Mapping[str, tuple[str, str | None]]
    features: frozenset[str]
    denoiser: str = "unet"  # the component that denoises
    denoiser_stage: str = UNET  # and its stage (models.stages.STAGE_MODELS' name)
    optional: tuple[str, ...] = ()  # components a model of it may lack (an SDXL refiner: the first text encoder)
    penultimate_text: bool = False  # the text encoders' penultimate layer's states are the context (SDXL)
    added_conditions: tuple[str, ...] = ()  # the denoiser's inputs beside sample, timestep and text (SDXL's)
    precisions: tuple[str, ...] = ("fp16", "fp32")  # what its pipelines may run in (demo.runtime.spec.PRECISIONS')
    # what they run in on a GPU where a spec leaves it to the backend (the torch backend's; a GPU without bf16 kernels,
    # before Ampere, runs fp16): the precision its published weights are in, which diffusers' guides run it in
    gpu_precision: str = "fp16"
    upcast_vae: bool = False  # the VAE overflows in fp16: fp32 there where its config says force_upcast
    tuned_key: str | None = None  # its entries in plugins/tuned_defaults.json (None: the plain compute capability's)
    lora_components: tuple[str, ...] = ()  # the components a LoRA file may change
    diffusers_options: Mapping[str, object] = field(default_factory=dict)  # what its diffusers pipelines are made with
    refiner_components: tuple[str, ...] = ()  # with REFINER: the components a model must have to refine
    # model_index.json `_class_name` -> what a model of that pipeline runs best with (diffusers' defaults for it); a
    # (class name, guidance kind) key first, where a model's guidance changes them (FLUX.1 [schnell]'s 4 steps)
    recommended: Mapping[str | tuple[str, str], Recommended] = field(default_factory=dict)
    denoiser_classes: tuple[str, ...] = ("UNet2DConditionModel",)  # diffusers' classes of its denoisers' configs
    controlnet_class: str = "ControlNetModel"  # and of its ControlNets' (family_of_denoiser reads both)
    text_width_key: str = "cross_attention_dim"  # the denoiser config's key for the width of the text it attends to
    pooled_text: tuple[str, ...] = ()  # the text stages whose pooled, projected output the pipeline reads too
    # the denoiser config's key for the width of those pooled outputs side by side, where it takes them alone (SD3's;
    # None: not checked, SDXL's UNet taking them among its added conditions)
    pooled_width_key: str | None = None
    t5_length: int | None = None  # with a T5 text stage: its token length (diffusers' max_sequence_length default)
    t5_tokenizer: str | None = None  # and the component of its tokenizer
    # Its denoiser predicts a flow (rectified flow: SD3) rather than noise: only flow-matching schedulers step it, and
    # no other scheduler steps a flow.
    flow_matching: bool = False
    shifts_latents: bool = False  # its pipelines shift the latents by the VAE's shift_factor (diffusers' SD ones not)
    # the denoiser config's key saying that it embeds the guidance scale (LCM's UNets: its width; Flux's: a flag)
    guidance_key: str = GUIDANCE_EMBEDDING_KEY
    # how a model of it is guided where its denoiser embeds no scale (FLUX.1 [schnell], distilled to need none: none)
    unembedded_guidance: str = CLASSIFIER_FREE
    # its pooled text is the CLIPs' projections (CLIPTextModelWithProjection's text_embeds); False: CLIPTextModel's own
    # pooled output, unprojected (Flux's)
    projected_pooled: bool = True
    # stage name -> its component, where another than its model's own (Flux's T5 is its text_encoder_2)
    stage_components: Mapping[str, str] = field(default_factory=dict)
    # its denoiser takes the latents packed into tokens of this many latents a side (Flux's 2x2: four times the
    # channels, its config's patch_size the packed tokens' own 1); None: as they are
    packed_latents: int | None = None
    # a denoiser of it may be an inpainting one, taking the mask and the masked image's latents beside the latents
    # (models.source.ModelSource.inpainting: SD's and SDXL's 9-channel UNets, SD3's 33-channel transformer)
    inpainting_denoisers: bool = True
    # latents a side of its native size where the denoiser's config has no sample_size (Flux's transformer:
    # diffusers' FluxPipeline's default_sample_size)
    default_sample_size: int | None = None
    # stage -> what its engine is built in where the pipeline runs in fp16: bf16 where the TensorRT flavour builds bf16
    # (what the family's models are trained and published in), else this precision (models.source.VAE_PRECISIONS'
    # name: T5 overflows fp16 in its feed-forward, so fp32 there)
    bf16_engines: Mapping[str, str] = field(default_factory=dict)
    # the features (and modes) its engines take too (None: all of its own: ControlNet engines, LoRA refitted in, ...);
    # a TensorRT backend asked for another one is refused naming it (passed over under auto), the torch backend runs it
    engine_features: frozenset[str] | None = None

    # ---- which models are of it -----------------------------------------------------------------------------------
    def runs_pipeline(self, class_name: str) -> bool:
        return class_name in self.pipeline_classes

    def has_denoiser(self, config: dict) -> bool:
        """Whether a denoiser config (a model folder's without model_index.json, a ControlNet's) is of this family."""
        if config.get("_class_name", self.denoiser_classes[0]) not in (*self.denoiser_classes, self.controlnet_class):
            return False
        return (config.get("addition_embed_type") == "text_time") == bool(self.added_conditions)

    def foreign_added_embedding(self, config: dict) -> str | None:
        """The added embedding a denoiser config of this family names that its pipelines do not make (None: none)."""
        kind = config.get("addition_embed_type")
        return None if kind is None or (self.added_conditions and kind == "text_time") else kind

    def model_components(self, index: dict) -> tuple[str, ...]:
        """The components a model of this model_index.json has: all but the optional ones it leaves out or names as
        absent (null); without one ({}), all."""
        named = {name for name in self.optional if isinstance(index.get(name), list) and index[name][0]}
        absent = set(self.optional) - named if index else set()
        return tuple(name for name in self.components if name not in absent)

    # ---- how its models run ---------------------------------------------------------------------------------------
    def guidance(self, denoiser_config: dict) -> str:
        """The model's guidance kind (GUIDANCE_KINDS): embedded where its denoiser embeds the scale (diffusers'
        pipelines then skip the unconditional half), else the family's unembedded kind (classifier-free, or none)."""
        return EMBEDDED if denoiser_config.get(self.guidance_key) else self.unembedded_guidance

    def recommendation(self, class_name: str | None, guidance: str) -> Recommended | None:
        """What a model of pipeline `class_name` guided as `guidance` runs best with (None: the family says nothing)."""
        return self.recommended.get((class_name, guidance)) or self.recommended.get(class_name)

    def stage_component(self, stage: str, default: str) -> str:
        """The component stage `stage` reads in a model of this family (`default`: its stage model's own)."""
        return self.stage_components.get(stage, default)

    def guidance_embedding_width(self, denoiser_config: dict) -> int | None:
        """The width of the guidance scale's embedding the denoiser takes (`timestep_cond`; None: it takes none)."""
        return denoiser_config.get(GUIDANCE_EMBEDDING_KEY) or None

    def fp16_runs_fp32(self, component: str, config: dict) -> bool:
        """Whether a stage of `component` (its `config`) runs in fp32 when the pipeline runs in fp16 (the stage's own
        default precision: SDXL's VAE where its config says force_upcast)."""
        return component == "vae" and self.upcast_vae and config.get("force_upcast", True)

    def check_precision(self, precision: str, model: str) -> None:
        if precision not in self.precisions:
            raise UsageError(f"model '{model}' is of the {self.label} family, which runs in "
                             f"{', '.join(self.precisions)}, not {precision}")

    def can_refine(self, components: tuple[str, ...]) -> bool:
        """Whether a model of this family with these components can refine its base's latents (REFINER)."""
        return REFINER in self.features and set(self.refiner_components) <= set(components)

    def supports(self, feature: str) -> bool:
        return feature in self.features

    def require(self, feature: str, model: str, given: str) -> None:
        """A UsageError, naming the family, where the spec or request asks for a feature (`given`: the field, as
        core.errors.field names it) the family lacks."""
        if feature not in self.features:
            raise UsageError(f"{given}: model '{model}' is of the {self.label} family, which does not support "
                             f"{feature}")

    def engines_take(self, feature: str) -> bool:
        """Whether its TensorRT engines take `feature` (a mode among them), where the family has it."""
        return self.engine_features is None or feature in self.engine_features

    def require_on_engines(self, feature: str, model: str, given: str, backend: str) -> None:
        """A UsageError, naming the family and the backend, where a backend that builds engines (`backend`: its name,
        as core.errors.field gives it) is asked for a feature (`given`: the field) its engines do not take yet."""
        if not self.engines_take(feature):
            raise UsageError(f"{given} on {backend}: model '{model}' is of the {self.label} family, whose {ENGINES} "
                             f"do not take {feature} yet; use {errors.field('backend')} torch")

    def diffusers_pipeline(self, mode: str, controlled: bool = False) -> str:
        """diffusers' pipeline class name for `mode` (with ControlNets: its ControlNet twin)."""
        return self.diffusers_pipelines[mode][int(controlled)]
