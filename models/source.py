"""Where a model comes from: a built-in name, a local diffusers-format directory, or a hub id.

Every source ends as a diffusers-format directory on disk; the architecture numbers the rest of the
toolkit needs (latent channels, VAE scale factor, text length and width, prediction type, native size)
are read from that directory's configs.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path

from core.errors import RunFailure, UsageError, field
from models.builtin import (
    BUILTIN_MODELS,
    BUILTIN_NAMES,
    BUILTIN_VAES,
    SHIPPED_MODELS,
    builtin_model_dir,
    builtin_vae_dir,
)
from models.cache import content_fingerprint, default_cache_dir
from models.families import Family, family_of
from models.recommended import Recommended
from models.single_file import SINGLE_FILE_SUFFIXES, convert_model_file, convert_vae_file
from models.validate import COMPONENTS, read_config, vae_config_as_loaded, validate_component, validate_model_folder

UNET_SIZE_MULTIPLE = 8  # what a UNet's image height and width must be multiples of (diffusers' SD pipelines' check)
SINGLE_FILE_DIR = "single-file"  # in the model cache: converted single-file checkpoints
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# The classifier-free guidance scale a request that gives none gets, on every model but those that say otherwise
# (ModelSource.default_guidance_scale).
DEFAULT_GUIDANCE_SCALE = 7.5
# What the VAE stages may run in, in place of the pipeline's precision (ModelSource.vae_precision): the torch dtype of
# each.
VAE_PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ModelSource:
    """A diffusers-format model directory and the architecture facts read from its configs."""

    name: str
    path: Path
    vae: Path | None = None  # another VAE's folder (--vae), in place of the model's own
    # VAE_PRECISIONS' name of what the VAE stages run in (None: the pipeline's precision, or what the family says)
    vae_precision: str | None = None

    def component_dir(self, component: str) -> Path:
        """Where a component's config and weights are."""
        return self.vae if component == "vae" and self.vae else self.path / component

    def config(self, component: str) -> dict:
        """A component's config, the VAE's as diffusers holds it once loaded (models.validate.vae_config_as_loaded)."""
        config = read_config(self.component_dir(component) / COMPONENTS[component][0], component)
        return vae_config_as_loaded(config) if component == "vae" else config

    @functools.cached_property
    def vae_class(self) -> str:
        """The VAE's diffusers class (one of models.validate.VAE_ENCODES_GAUSSIAN): its config's, else the one
        model_index.json names (validate_component checked that there is one)."""
        return self.config("vae").get("_class_name") or self.index["vae"][1]

    @functools.cached_property
    def index(self) -> dict:
        """model_index.json: the pipeline class and its options (empty for a folder without one)."""
        path = self.path / "model_index.json"
        return read_config(path, "model_index") if path.exists() else {}

    @functools.cached_property
    def family(self) -> Family:
        """Its family (models.families), from its own configs."""
        return family_of(self.index, self.config, self.name)

    @property
    def components(self) -> tuple[str, ...]:
        return self.family.model_components(self.index)

    @functools.cached_property
    def t5_tokenizer(self):
        """The tokenizer of the model's T5 text encoder (None: its family reads no T5, or the model has none)."""
        name = self.family.t5_tokenizer
        if name is None or name not in self.components:
            return None
        from transformers import T5TokenizerFast

        return T5TokenizerFast.from_pretrained(self.path, subfolder=name)

    @functools.cached_property
    def denoiser_config(self) -> dict:
        """The config of the component that denoises (the family's denoiser: a UNet, SD3's transformer), read once:
        the size, latent, mode and guidance facts each read it, a request's resolution among them."""
        return self.config(self.family.denoiser)

    @property
    def guidance(self) -> str:
        """How it is guided (models.families GUIDANCE_KINDS): classifier-free, or the scale embedded."""
        return self.family.guidance(self.denoiser_config)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the model's content for artifact cache keys.

        Config files are hashed; weight files by name, size and modification time (content_fingerprint).
        """
        files = [(p, p.relative_to(self.path).as_posix()) for p in sorted(self.path.rglob("*")) if p.is_file()]
        if self.vae:  # the other VAE's files stand in for the model's own
            files = [(p, rel) for p, rel in files if not rel.startswith("vae/")]
            files += [(p, f"vae/{p.relative_to(self.vae).as_posix()}") for p in sorted(self.vae.rglob("*"))
                      if p.is_file()]
        return content_fingerprint(files)

    @functools.cached_property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.config("vae")["block_out_channels"]) - 1)

    @property
    def image_size_multiple(self) -> int:
        """What an image's height and width must be multiples of: the VAE's scale factor times the denoiser's patch
        size where it cuts the latents into patches (SD3's transformer: 8 x 2, as diffusers' SD3 pipelines check;
        Flux's, its 2x2 packing), else 8 (diffusers' UNet pipelines' own multiple, whatever the VAE's scale)."""
        patch = self.latent_patch
        return self.vae_scale_factor * patch if patch else UNET_SIZE_MULTIPLE

    @property
    def image_size_multiple_text(self) -> str:
        """image_size_multiple as messages give it: with where it comes from, where not the UNets' 8."""
        multiple, factor = self.image_size_multiple, self.vae_scale_factor
        if multiple == UNET_SIZE_MULTIPLE:
            return str(multiple)
        return (f"{multiple} for model '{self.name}' (its VAE's scale factor {factor} x its {self.family.denoiser}'s "
                f"patch size {multiple // factor})")

    @property
    def latent_patch(self) -> int | None:
        """How many latents a side the denoiser takes as one token: its family's packing (Flux's 2, its config's
        patch_size the packed tokens' 1), else its config's patch size (SD3's 2); None: a UNet, which takes them
        whole."""
        return self.family.packed_latents or self.denoiser_config.get("patch_size")

    @property
    def packed_channels(self) -> int:
        """How many of the denoiser config's channels one latent channel is (Flux's 2x2 packing: 4; else 1)."""
        return (self.family.packed_latents or 1) ** 2

    def latent_shape(self, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        """The latents of `batch` images of height x width pixels (the one place that computes it)."""
        factor = self.vae_scale_factor
        return batch, self.latent_channels, height // factor, width // factor

    @property
    def latent_channels(self) -> int:
        """The channels of the latents the denoiser denoises: its output's (an inpainting UNet takes more)."""
        config = self.denoiser_config
        # Flux's transformer config gives no out_channels: it gives out what it takes in
        return (config.get("out_channels") or config["in_channels"]) // self.packed_channels

    @property
    def input_channels(self) -> int:
        """The channels of the latents the denoiser takes (an inpainting UNet's: the mask's and masked image's too)."""
        return self.denoiser_config["in_channels"] // self.packed_channels

    @property
    def inpainting(self) -> bool:
        """An inpainting model: its denoiser takes the mask and the masked image's latents beside the latents (9 input
        channels for 4; SD3's 33 for 16), where its family has such denoisers (Family.inpainting_denoisers)."""
        return self.family.inpainting_denoisers and self.input_channels == 2 * self.latent_channels + 1

    @property
    def text_length(self) -> int:
        """The token length of its (first) text encoder (an SDXL refiner's first is CLIP2's)."""
        encoder = next(name for name in ("text_encoder", "text_encoder_2") if name in self.components)
        return self.config(encoder)["max_position_embeddings"]

    @property
    def text_width(self) -> int:
        """The width of the text the denoiser attends to (its family says where its config has it)."""
        return self.denoiser_config[self.family.text_width_key]

    @property
    def prediction_type(self) -> str:
        return self.config("scheduler").get("prediction_type", "epsilon")

    @property
    def native_image_size(self) -> int:
        sample_size = self.denoiser_config.get("sample_size") or self.family.default_sample_size
        if isinstance(sample_size, (list, tuple)):
            sample_size = sample_size[0]
        return sample_size * self.vae_scale_factor

    @property
    def image_size_range(self) -> tuple[int, int]:
        """Supported height/width in pixels: half to twice the native size (256..1024 for SD 1.5)."""
        return self.native_image_size // 2, self.native_image_size * 2

    @functools.cached_property
    def recommended(self) -> Recommended:
        """What the model says it runs best with (models.recommended): what its family recommends for its pipeline
        class (LCM's 4 steps at 8.5) and guidance (FLUX.1 [schnell]'s 4 steps); a shipped model's own guidance
        scale replaces its family's (`scenes-sd3` was trained for its own, not SD3's 7)."""
        class_name = self.index.get("_class_name")
        said = self.family.recommendation(class_name, self.guidance)
        if said and said.guidance_scale is not None and self.shipped is not None:
            said = replace(said, guidance_scale=self.shipped.GUIDANCE_SCALE)
        return replace(said, by=f"model {self.name} ({class_name})") if said else Recommended()

    @property
    def shipped(self):
        """The package of the shipped built-in whose folder this is (by name or by path), else None."""
        return next((package for package in SHIPPED_MODELS.values()
                     if self.path.resolve() == package.MODEL_DIR.resolve()), None)

    @property
    def default_guidance_scale(self) -> float:
        """The guidance scale a request that gives none gets, where neither a LoRA nor the model recommends one: a
        shipped model's own (its folder, by name or by path), else DEFAULT_GUIDANCE_SCALE."""
        return DEFAULT_GUIDANCE_SCALE if self.shipped is None else self.shipped.GUIDANCE_SCALE


def resolve_model(spec: str, cache_dir: Path | None = None, vae: str | None = None, config: str | None = None,
                  prediction_type: str | None = None, given: str = "model",
                  vae_precision: str | None = None) -> ModelSource:
    """Turn a --model value (a single file with its --model-config and --prediction-type; a --vae folder, file or
    built-in name; and --vae-precision, one of VAE_PRECISIONS) into a ModelSource; raises UsageError with the reason
    when it cannot, naming the field `given` where the file is at fault (model, refiner)."""
    cache_dir = cache_dir or default_cache_dir()
    path = Path(spec).expanduser()
    if spec not in BUILTIN_NAMES and path.is_file():  # a single-file checkpoint: converted once, cached
        source = ModelSource(spec, convert_model_file(path, None if config is None else Path(config).expanduser(),
                                                      prediction_type, cache_dir / SINGLE_FILE_DIR, given=given))
    else:
        for name, value in (("model_config", config), ("prediction_type", prediction_type)):
            if value is not None:
                raise UsageError(f"{field(name)} describes a single-file model; model '{spec}' is not a file")
        source = _resolve_model(spec, cache_dir, given)
    source = replace(source, vae=_vae_folder(vae, source, cache_dir)) if vae else source
    if vae_precision == "fp16" and source.family.fp16_runs_fp32("vae", source.config("vae")):
        raise UsageError(f"{field('vae_precision')} fp16: model '{source.name}''s VAE overflows in fp16 (its config "
                         f"asks for fp32); use {field('vae_precision')} bf16, which has fp32's range")
    return replace(source, vae_precision=vae_precision)


def looks_like_path(spec: str) -> bool:
    """Whether a --model value that names nothing here was meant as a file or folder rather than a hub id
    (owner/name) or a built-in's name: it starts with /, . or ~, ends as a single-file checkpoint does, or has
    more than one slash."""
    return spec.startswith(("/", ".", "~")) or spec.lower().endswith(SINGLE_FILE_SUFFIXES) or spec.count("/") > 1


def _resolve_model(spec: str, cache_dir: Path, given: str) -> ModelSource:
    if spec in BUILTIN_MODELS:
        return ModelSource(spec, builtin_model_dir(spec, cache_dir / "builtin"))
    if spec in SHIPPED_MODELS:
        shipped = SHIPPED_MODELS[spec]
        reason = shipped.damage()
        if reason:
            raise RunFailure(f"the built-in model '{spec}' shipped with the package is damaged ({reason}): reinstall "
                             "the package")
        return ModelSource(spec, shipped.MODEL_DIR)
    path = Path(spec).expanduser()
    if path.is_dir():
        validate_model_folder(path, spec)
        return ModelSource(spec, path.resolve())
    if not path.exists() and looks_like_path(spec):
        raise UsageError(f"{field(given)} {spec}: no such file or directory")
    if _HUB_ID.match(spec) and not path.exists():
        return ModelSource(spec, _download_from_hub(spec))
    raise UsageError(
        f"unknown model '{spec}': not a built-in ({', '.join(BUILTIN_NAMES)}), "
        "not a diffusers-format directory, not a single-file checkpoint, not a hub id"
    )


def _vae_folder(spec: str, source: ModelSource, cache_dir: Path) -> Path:
    """A --vae value as a checked VAE folder: a built-in's name (models.builtin.BUILTIN_VAES, made on first use), an
    AutoencoderKL or AutoencoderTiny folder, a model folder holding one in vae/, or a single-file VAE (converted once,
    described by the model's own VAE config), whose latents are the UNet's."""
    folder = builtin_vae_dir(spec, cache_dir / "builtin") if spec in BUILTIN_VAES else Path(spec).expanduser()
    if folder.is_file():
        folder = convert_vae_file(folder, source.config("vae"), cache_dir / SINGLE_FILE_DIR)
    if (folder / "vae" / COMPONENTS["vae"][0]).is_file():
        folder = folder / "vae"
    if not (folder / COMPONENTS["vae"][0]).is_file():
        raise UsageError(f"{field('vae')} {spec}: not a VAE folder (no {COMPONENTS['vae'][0]} in it or in its vae/)")
    config = validate_component(folder, "vae", subject=f"{field('vae')} {spec}")
    channels = source.latent_channels
    if config.get("latent_channels") != channels:
        raise UsageError(f"{field('vae')} {spec}: its latents have {config.get('latent_channels')} channels, model "
                         f"'{source.name}''s UNet takes {channels}")
    return folder.resolve()


def _download_from_hub(hub_id: str) -> Path:
    from diffusers import DiffusionPipeline

    try:
        path = Path(DiffusionPipeline.download(hub_id))
    except Exception as exc:  # network, auth, missing repo: one clear line for the user
        raise UsageError(f"cannot fetch model '{hub_id}' from the hub: {root_cause(exc)}") from exc
    validate_model_folder(path, hub_id)
    return path


def root_cause(exc: BaseException) -> str:
    """The first line of the innermost exception `exc` was raised from (the hub client's own message points at a
    traceback the user never sees), with its type."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{(str(exc).strip().splitlines() or ['no detail'])[0]} ({type(exc).__name__})"
