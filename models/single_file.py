"""Single-file checkpoints: one .safetensors in the original Stable Diffusion layout (LDM's names, as A1111 and ComfyUI
save SD 1.x/2.x and SDXL models, VAEs and ControlNets), converted once into the diffusers folder the toolkit runs
and cached by the file's content.

The layout is told by the tensors' names alone (detect_layout): the UNet under `model.diffusion_model.`, the VAE
under `first_stage_model.`, and the text encoders: SD 1.x's CLIP ViT-L as transformers names it under
`cond_stage_model.transformer.`, SD 2.x's OpenCLIP ViT-H under `cond_stage_model.model.`, SDXL base's CLIP ViT-L and
OpenCLIP bigG under `conditioner.embedders.0.transformer.` and `conditioner.embedders.1.model.`, SDXL's refiner's
bigG alone under `conditioner.embedders.0.model.`.

A file holds weights and no configs. They come from a diffusers folder whose configs describe the file (`model_config`,
as diffusers' `from_single_file(config=...)`), or from the built-in architecture folders this module writes into the
cache (configs and CLIP's real tokenizer, never weights, nothing from the network): SD 1.5, SD 2.x (768 v-prediction
and 512 epsilon), SDXL 1.0 base and refiner. Diffusers' own state-dict converters (diffusers.loaders.single_file_utils)
rename the tensors. Whether they fit is checked before a weight is read or a converted file written: the file's
header gives every tensor's shape, the conversion runs on shape-only (meta) tensors, and each component built from its
config on the meta device must find exactly its tensors, shape for shape; the first that does not is one UsageError
naming the component and the tensor. The weights then load with strict=True and keep the file's dtype (an fp16 file
stays fp16).

The converted folder's name is a hash of the file's content (sha256), the configs' fingerprint and
SINGLE_FILE_FORMAT_VERSION; a file's digest is remembered by its path, size and modification time (digests.json in the
cache), so that a second run neither hashes gigabytes again nor converts anything. Folders are written whole or not at
all, under a lock, with a manifest; a damaged one is converted again. Pickles (.ckpt, .pt, .pth, .bin) are refused
unopened: loading one runs the code it holds.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

from core.atomic import atomic_write_bytes, file_lock, writable_reason
from core.errors import RunFailure, UsageError, field
from models.builtin import (
    BOS,
    BUILTIN_MODELS,
    EOS,
    SD15_SCHEDULER,
    SDXL_SCHEDULER,
    XL_PAD,
    _bytes_to_unicode,
    _to_stderr,
    made_once,
    scheduler_from,
)
from models.cache import content_fingerprint, default_cache_dir
from models.families import IMAGE_TO_IMAGE, SD, SDXL, TEXT_TO_IMAGE, family_of, family_of_denoiser
from models.validate import COMPONENTS, check_weight_file, read_config, safetensors_header, tensor_misfit

if TYPE_CHECKING:
    import torch

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
PICKLE_SUFFIXES = SINGLE_FILE_SUFFIXES[1:]
# Bump when what a conversion writes changes, so that cached folders are converted again.
SINGLE_FILE_FORMAT_VERSION = 1
PREDICTION_TYPES = ("epsilon", "v_prediction")
# SD 2.x files cannot tell epsilon from v-prediction. v-prediction (and 768x768) is what SD 2.0-v and 2.1, and most
# models made from them, were trained for, and what diffusers' from_single_file takes for SD 2.x without a config;
# SD 2.x-base files (512x512) need prediction_type="epsilon". The wrong one draws a blur or noise, not an error.
SD2_DEFAULT_PREDICTION = "v_prediction"

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CONTROLNET_PREFIX = "control_model."
DIGESTS = "digests.json"  # in the cache: file path -> size, modification time and content digest


class TextEncoder(NamedTuple):
    component: str  # its folder in a diffusers model
    prefix: str  # where its tensors are in the file
    open_clip: bool  # OpenCLIP's layout (fused q/k/v, ln_1, mlp.c_fc ...), else transformers' names


# Each layout's text encoders: what detect_layout looks for beside the UNet, and where convert_model_file finds them.
TEXT_ENCODERS = {
    "sdxl-base": (TextEncoder("text_encoder", "conditioner.embedders.0.transformer.", False),
                  TextEncoder("text_encoder_2", "conditioner.embedders.1.model.", True)),
    "sdxl-refiner": (TextEncoder("text_encoder_2", "conditioner.embedders.0.model.", True),),
    "sd2": (TextEncoder("text_encoder", "cond_stage_model.model.", True),),
    "sd1": (TextEncoder("text_encoder", "cond_stage_model.transformer.", False),),
}


@dataclass(frozen=True)
class Layout:
    """Which original layout a file's tensors are in: its family ("sd" or "sdxl") and variant ("sd1", "sd2",
    "sdxl-base", "sdxl-refiner")."""

    family: str
    variant: str

    @property
    def text_encoders(self) -> tuple[TextEncoder, ...]:
        return TEXT_ENCODERS[self.variant]

    @property
    def components(self) -> set[str]:
        """The components of the diffusers model it converts to."""
        encoders = {encoder.component for encoder in self.text_encoders}
        return {"unet", "vae", "scheduler", *encoders, *(_tokenizer_of(encoder) for encoder in encoders)}


def _tokenizer_of(text_encoder: str) -> str:
    return text_encoder.replace("text_encoder", "tokenizer")


def is_single_file(path: Path) -> bool:
    """Whether `path` is a file that may hold a single-file checkpoint (a folder is a diffusers model)."""
    path = Path(path)
    return path.is_file() and path.suffix.lower() in SINGLE_FILE_SUFFIXES


def detect_layout(keys: Iterable[str], name: str = "the file") -> Layout:
    """The layout of a file whose tensors are named `keys`; a one-line UsageError naming `name` where it is none of
    TEXT_ENCODERS' with a UNet."""
    keys = list(keys)

    def has(prefix: str) -> bool:
        return any(key.startswith(prefix) for key in keys)

    if has(UNET_PREFIX):
        for variant, encoders in TEXT_ENCODERS.items():
            if all(has(encoder.prefix) for encoder in encoders):
                return Layout("sdxl" if variant.startswith("sdxl") else "sd", variant)
    looked_for = " or ".join(" + ".join(e.prefix for e in encoders) for encoders in TEXT_ENCODERS.values())
    raise UsageError(f"{name}: not a Stable Diffusion checkpoint in the original layout (looked for {UNET_PREFIX} "
                     f"with {looked_for})")


# ---- the built-in architectures ----------------------------------------------------------------------------------

_SD15, _SDXL = BUILTIN_MODELS["sd1.5-arch"], BUILTIN_MODELS["sdxl-arch"]
_SD2_UNET = {**_SD15["unet"], "attention_head_dim": [5, 10, 20, 20], "cross_attention_dim": 1024,
             "use_linear_projection": True}
# OpenCLIP ViT-H/14's text tower as diffusers' SD 2.x text encoder: the penultimate layer's states (23 of its 24
# layers), then its final layer norm.
_SD2_TEXT = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 23, "num_attention_heads": 16,
             "max_position_embeddings": 77, "projection_dim": 512, "vocab_size": 49408, "hidden_act": "gelu"}
# SDXL 1.0's refiner (sd_xl_refiner.yaml: 384 channels x [1, 2, 4, 4], 64-wide heads, 4 transformer layers, attention
# at 2x and 4x down, bigG's 1280-wide states, 1280 + 5 x 256 added conditions).
_REFINER_UNET = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [384, 768, 1536, 1536],
    "layers_per_block": 2,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": [6, 12, 24, 24],
    "transformer_layers_per_block": 4,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2560,
    "cross_attention_dim": 1280,
    "norm_num_groups": 32,
}
_SD_OPTIONS = {"requires_safety_checker": False, "safety_checker": [None, None], "feature_extractor": [None, None],
               "image_encoder": [None, None]}
_XL_OPTIONS = {"feature_extractor": [None, None], "image_encoder": [None, None]}
# name -> its pipeline class, model_index.json options, component configs, and each text encoder's config and the
# token its tokenizer pads with (SD 1.x's CLIP pads with its end of text, OpenCLIP's tokenizers with "!").
ARCHITECTURES = {
    "sd1": dict(pipeline=SD.diffusers_pipeline(TEXT_TO_IMAGE), options=_SD_OPTIONS, unet=_SD15["unet"],
                vae=_SD15["vae"], scheduler=SD15_SCHEDULER, text={"text_encoder": (_SD15["text_encoder"], EOS)}),
    # SD 2.1 768-v's: v-prediction DDIM, attention upcast to fp32 (2.1's overflows fp16 without)
    "sd2-v": dict(pipeline=SD.diffusers_pipeline(TEXT_TO_IMAGE), options=_SD_OPTIONS,
                  unet={**_SD2_UNET, "sample_size": 96, "upcast_attention": True},
                  vae={**_SD15["vae"], "sample_size": 768},
                  scheduler={**SD15_SCHEDULER, "_class_name": "DDIMScheduler", "prediction_type": "v_prediction"},
                  text={"text_encoder": (_SD2_TEXT, XL_PAD)}),
    "sd2-base": dict(pipeline=SD.diffusers_pipeline(TEXT_TO_IMAGE), options=_SD_OPTIONS,
                     unet={**_SD2_UNET, "sample_size": 64}, vae=_SD15["vae"], scheduler=SD15_SCHEDULER,
                     text={"text_encoder": (_SD2_TEXT, XL_PAD)}),
    "sdxl-base": dict(pipeline=SDXL.diffusers_pipeline(TEXT_TO_IMAGE),
                      options={**_XL_OPTIONS, "force_zeros_for_empty_prompt": True},
                      unet=_SDXL["unet"], vae=_SDXL["vae"], scheduler=SDXL_SCHEDULER,
                      text={"text_encoder": (_SDXL["text_encoder"], EOS),
                            "text_encoder_2": (_SDXL["text_encoder_2"], XL_PAD)}),
    "sdxl-refiner": dict(pipeline=SDXL.diffusers_pipeline(IMAGE_TO_IMAGE),  # what saves SDXL's refiner
                         options={**_XL_OPTIONS, "text_encoder": [None, None], "tokenizer": [None, None],
                                  "requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False},
                         unet=_REFINER_UNET, vae=_SDXL["vae"], scheduler=SDXL_SCHEDULER,
                         text={"text_encoder_2": (_SDXL["text_encoder_2"], XL_PAD)}),
}
TEXT_ENCODER_CLASSES = {"text_encoder": "CLIPTextModel", "text_encoder_2": "CLIPTextModelWithProjection"}

# CLIP's BPE merges, as OpenAI's CLIP and OpenCLIP ship them: open_clip/bpe_simple_vocab_16e6.txt.gz from the
# open-clip-torch 3.3.0 wheel on PyPI, unchanged (MIT license, Copyright (c) 2012-2021 Gabriel Ilharco, Mitchell
# Wortsman, Nicholas Carlini, Rohan Taori, Achal Dave, Vaishaal Shankar, John Miller, Hongseok Namkoong, Hannaneh
# Hajishirzi, Ali Farhadi, Ludwig Schmidt). Real checkpoints' text encoders read its 49408 token ids.
CLIP_MERGES = Path(__file__).with_name("clip_merges.txt.gz")
CLIP_MERGE_COUNT = 49152 - 256 - 2  # the merges CLIP uses: its vocabulary less the byte alphabet and the two specials


def clip_vocabulary() -> tuple[dict[str, int], list[str]]:
    """CLIP's vocabulary (49408 tokens) and merges, built as OpenAI's CLIP builds them: the 256 byte symbols, the
    same with the end-of-word mark, each merge's result, then the start and end of text."""
    merges = gzip.decompress(CLIP_MERGES.read_bytes()).decode("utf-8").split("\n")[1:CLIP_MERGE_COUNT + 1]
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [symbol + "</w>" for symbol in alphabet] + [merge.replace(" ", "") for merge in merges]
    return {token: i for i, token in enumerate(tokens + [BOS, EOS])}, merges


def _write_tokenizer(directory: Path, pad: str, max_length: int):
    """CLIP's real tokenizer (a transformers CLIPTokenizer) into `directory`: vocab.json and merges.txt, and
    transformers' own files."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocabulary()
    directory.mkdir(parents=True)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer = CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), unk_token=EOS,
                              bos_token=BOS, eos_token=EOS, pad_token=pad, model_max_length=max_length)
    tokenizer.save_pretrained(directory)
    return tokenizer


def _write_architecture(name: str, directory: Path) -> None:
    """The configs of built-in architecture `name` in diffusers' layout, without weights."""
    import diffusers
    from transformers import CLIPTextConfig

    spec = ARCHITECTURES[name]
    index = {"_class_name": spec["pipeline"], "_diffusers_version": diffusers.__version__, **spec["options"]}
    for component, class_name in (("unet", "UNet2DConditionModel"), ("vae", "AutoencoderKL")):
        (directory / component).mkdir()
        config = {"_class_name": class_name, "_diffusers_version": diffusers.__version__, **spec[component]}
        (directory / component / "config.json").write_text(json.dumps(config, indent=2))
        index[component] = ["diffusers", class_name]
    scheduler = scheduler_from(spec["scheduler"])
    scheduler.save_config(directory / "scheduler")
    index["scheduler"] = ["diffusers", type(scheduler).__name__]
    for component, (config, pad) in spec["text"].items():
        tokenizer = _tokenizer_of(component)
        ids = _write_tokenizer(directory / tokenizer, pad, config["max_position_embeddings"])
        CLIPTextConfig(**config, architectures=[TEXT_ENCODER_CLASSES[component]], bos_token_id=ids.bos_token_id,
                       eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id).save_pretrained(
            directory / component)
        index[component] = ["transformers", TEXT_ENCODER_CLASSES[component]]
        index[tokenizer] = ["transformers", "CLIPTokenizer"]
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))


def architecture_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The config folder of built-in architecture `name` (ARCHITECTURES), written into the cache on first use."""
    cache_dir = _cache_root(cache_dir)
    directory = cache_dir / "configs" / f"{name}-v{SINGLE_FILE_FORMAT_VERSION}"
    return _cached(directory, functools.partial(_write_architecture, name), lambda _: None, f"architecture {name}")


# ---- conversion ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Part:
    """One module of a file: the component it becomes, where its tensors are, the module its config describes (made
    on the meta device), and diffusers' renaming of its tensors (the file's, by their full names)."""

    component: str
    prefix: str
    subfolder: str  # where it is saved in the converted folder ("": the folder itself)
    empty: Callable[[], torch.nn.Module]
    convert: Callable[[dict, torch.nn.Module], dict]


def _meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    import torch

    with torch.device("meta"):  # shapes without memory: the full-size architectures cost nothing to check
        return build()


def _diffusers_module(class_name: str, config: dict) -> Callable[[], torch.nn.Module]:
    import diffusers

    return lambda: _meta(lambda: getattr(diffusers, class_name).from_config(config))


def _text_encoder(folder: Path) -> Callable[[], torch.nn.Module]:
    import transformers

    config = transformers.CLIPTextConfig.from_pretrained(folder)
    class_name = (config.architectures or [TEXT_ENCODER_CLASSES[folder.name]])[0]
    return lambda: _meta(lambda: getattr(transformers, class_name)(config))


def _unwrapped(state: dict, model) -> dict:
    """transformers' CLIPTextModel names its tensors without `text_model.` (diffusers' converters give them with it);
    CLIPTextModelWithProjection keeps it."""
    return state if hasattr(model, "text_model") else {key.removeprefix("text_model."): v for key, v in state.items()}


def _clip_state(tensors: dict, model, prefix: str) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint

    # the position ids older transformers saved are a buffer, not a weight
    tensors = {key: value for key, value in tensors.items() if not key.endswith(".position_ids")}
    return _unwrapped(convert_ldm_clip_checkpoint(tensors, remove_prefix=prefix), model)


def _open_clip_state(tensors: dict, model, prefix: str) -> dict:
    """OpenCLIP's text tower as transformers' CLIP text model (diffusers' converter leaves out what that does not
    use: logit_scale, and for SD 2.x, whose text encoder gives the penultimate layer's states, the last layer and
    the projection)."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    return _unwrapped(convert_open_clip_checkpoint(model, tensors, prefix=prefix), model)


def _unet_state(tensors: dict, model) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    return convert_ldm_unet_checkpoint(tensors, model.config)


def _vae_state(tensors: dict, model) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return convert_ldm_vae_checkpoint(tensors, model.config)


def _controlnet_state(tensors: dict, model, prefix: str) -> dict:
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING, convert_controlnet_checkpoint

    tensors = {key.removeprefix(prefix): value for key, value in tensors.items()}
    state = convert_controlnet_checkpoint(tensors, model.config)
    # diffusers' converter leaves out the added embeddings (label_emb) an SDXL ControlNet has as its UNet does
    mapping = DIFFUSERS_TO_LDM_MAPPING["controlnet"]
    added = ([mapping["class_embed_type"]] if model.config.class_embed_type in ("timestep", "projection") else [])
    added += [mapping["addition_embed_type"]] if family_of_denoiser(model.config).added_conditions else []
    for names in added:
        state.update({new: tensors[old] for new, old in names.items()})
    return state


def _converted(part: _Part, tensors: dict, model, where: str) -> dict:
    """The part's tensors as its module names them, less those diffusers' converter found no source for (None: the
    fit check finds them missing)."""
    try:
        state = part.convert(tensors, model)
    except KeyError as exc:  # a converter indexing a tensor the file lacks
        raise UsageError(f"{where}: component '{part.component}': the file has no tensor "
                         f"{part.prefix}{str(exc.args[0]).removeprefix(part.prefix)}") from None
    return {key: value for key, value in state.items() if value is not None}


def _check_fit(parts: list[_Part], shapes: dict[str, list[int]], where: str, configs: str) -> None:
    """Each part's tensors converted as shapes alone against the module its config describes: exactly its tensors,
    each of its shape, or a one-line UsageError naming the component and the first that is not."""
    import torch

    for part in parts:
        model = part.empty()
        tensors = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()
                   if name.startswith(part.prefix)}
        problem = tensor_misfit(_converted(part, tensors, model, where), model.state_dict())
        if problem:
            raise UsageError(f"{where}: component '{part.component}' does not fit {configs}: {problem} (pass "
                             f"{field('model_config')}, a diffusers folder whose configs describe the file)")


def _write_parts(path: Path, parts: list[_Part], directory: Path) -> None:
    """Each part converted from the file, loaded strictly into its module (the file's dtypes kept) and saved."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as file:
        names = list(file.keys())
        for part in parts:
            model = part.empty()
            tensors = {name: file.get_tensor(name) for name in names if name.startswith(part.prefix)}
            state = _converted(part, tensors, model, str(path))
            model.load_state_dict({key: value.contiguous() for key, value in state.items()}, strict=True, assign=True)
            model.save_pretrained(directory / part.subfolder)


def _model_parts(layout: Layout, configs: Path) -> list[_Part]:
    """The file's modules, each described by its config in `configs`: the UNet, the VAE, the text encoders."""
    parts = [_Part("unet", UNET_PREFIX, "unet",
                   _diffusers_module("UNet2DConditionModel", _component_config(configs, "unet")), _unet_state),
             _Part("vae", VAE_PREFIX, "vae", _diffusers_module("AutoencoderKL", _component_config(configs, "vae")),
                   _vae_state)]
    for encoder in layout.text_encoders:
        convert = functools.partial(_open_clip_state if encoder.open_clip else _clip_state, prefix=encoder.prefix)
        parts.append(_Part(encoder.component, encoder.prefix, encoder.component,
                           _text_encoder(configs / encoder.component), convert))
    return parts


def _component_config(configs: Path, component: str) -> dict:
    config = read_config(configs / component / "config.json", component)
    return {key: value for key, value in config.items() if not key.startswith("_")}


def _write_model(path: Path, layout: Layout, configs: Path, prediction_type: str | None, directory: Path) -> None:
    """The converted model: its modules from the file, its tokenizers and scheduler from `configs` (the scheduler's
    prediction type replaced where one is given), and a model_index.json naming what it holds."""
    _write_parts(path, _model_parts(layout, configs), directory)
    for encoder in layout.text_encoders:
        tokenizer = _tokenizer_of(encoder.component)
        shutil.copytree(configs / tokenizer, directory / tokenizer)
    shutil.copytree(configs / "scheduler", directory / "scheduler")
    if prediction_type:
        scheduler = directory / "scheduler" / "scheduler_config.json"
        scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "prediction_type": prediction_type},
                                        indent=2))
    index = read_config(configs / "model_index.json", "model_index")
    for name, value in index.items():  # a safety checker, an image encoder ... the file does not hold
        if isinstance(value, list) and len(value) == 2 and name not in layout.components:
            index[name] = [None, None]
    if "requires_safety_checker" in index:
        index["requires_safety_checker"] = False
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))


def _model_configs(model_config: Path, layout: Layout, where: str) -> Path:
    """--model-config's folder, checked to describe a model of the file's family and components (each config
    readable)."""
    folder = Path(model_config).expanduser()
    index = read_config(folder / "model_index.json", "model_index")
    family = family_of(index, lambda component: read_config(folder / component / "config.json", component),
                       str(folder))
    theirs = set(family.model_components(index))
    if family.name != layout.family or theirs != layout.components:
        raise UsageError(f"{where} is an {layout.variant} checkpoint ({', '.join(sorted(layout.components))}); "
                         f"{field('model_config')} {folder} describes an {family.label} model "
                         f"({', '.join(sorted(theirs))})")
    for component in layout.components:
        read_config(folder / component / COMPONENTS[component][0], component)
    return folder.resolve()


def _config_fingerprint(folder: Path) -> str:
    """The configs' part of a conversion's key: every config and tokenizer file (a --model-config folder's weights, if
    it has any, are not used)."""
    return content_fingerprint([(p, p.relative_to(folder).as_posix()) for p in sorted(folder.rglob("*"))
                                if p.is_file() and p.suffix in (".json", ".txt")])


def convert_model_file(path: Path, model_config: Path | None = None, prediction_type: str | None = None,
                       cache_dir: Path | None = None, say: Callable[[str], None] = _to_stderr,
                       given: str = "model") -> Path:
    """A diffusers model folder (model_index.json, unet/, vae/, text_encoder(_2)/, tokenizer(_2)/, scheduler/) from a
    single-file checkpoint in the original layout, converted on first use and cached (module docstring).

    `model_config`: a diffusers folder whose configs describe the file (its weights are not read); without it, the
    built-in architecture of the file's layout. `prediction_type` ("epsilon" or "v_prediction") replaces the
    scheduler's; for SD 2.x without `model_config` it picks the architecture: v_prediction (SD 2.0-v, 2.1: 768x768),
    the default (SD2_DEFAULT_PREDICTION), or epsilon (SD 2.x-base: 512x512). `cache_dir`: default
    default_cache_dir() / "single-file".

    Raises UsageError (one line; nothing left in the cache) for a missing file, a pickle, a truncated or damaged
    safetensors, a file of unknown layout, a `model_config` of other components, tensors that do not fit the configs;
    RunFailure where the converted folder cannot be written (a full disk).
    """
    path = Path(path)
    where = f"{field(given)} {path}"  # `given`: the field that named the file (model, refiner)
    shapes = _file_shapes(path, where)
    layout = detect_layout(shapes, where)
    if prediction_type not in (None, *PREDICTION_TYPES):
        raise UsageError(f"{where}: prediction type {prediction_type!r} is none of {', '.join(PREDICTION_TYPES)}")
    cache_dir = _cache_root(cache_dir)
    if model_config is not None:
        configs = _model_configs(model_config, layout, where)
        described = f"the configs in {configs}"
    else:
        name = layout.variant
        if layout.variant == "sd2":
            name = "sd2-v" if (prediction_type or SD2_DEFAULT_PREDICTION) == "v_prediction" else "sd2-base"
        configs = architecture_dir(name, cache_dir)
        described = f"the built-in {name} architecture"
    key = _key(_file_digest(path, cache_dir), _config_fingerprint(configs), prediction_type)
    directory = cache_dir / f"{layout.variant}-{key}"
    return _cached(directory, functools.partial(_write_model, path, layout, configs, prediction_type), say, str(path),
                   before=lambda: _check_fit(_model_parts(layout, configs), shapes, where, described))


def convert_vae_file(path: Path, vae_config: dict, cache_dir: Path | None = None,
                     say: Callable[[str], None] = _to_stderr) -> Path:
    """An AutoencoderKL folder (config.json and weights) from a lone VAE file in the original layout (its names bare,
    or under first_stage_model. or vae.), described by `vae_config`: the base model's vae config (a file cannot tell
    SD's VAE from SDXL's, which differs in its scaling factor and fp32 upcast alone). Cached and refused as
    convert_model_file's files are."""
    from diffusers.loaders.single_file_utils import LDM_VAE_KEYS

    path = Path(path)
    where = f"{field('vae')} {path}"
    shapes = _file_shapes(path, where)
    prefix = next((p for p in (*LDM_VAE_KEYS, "") if f"{p}encoder.conv_in.weight" in shapes), None)
    if prefix is None:
        raise UsageError(f"{where}: not a VAE in the original layout (no encoder.conv_in.weight, bare or under "
                         f"{' or '.join(LDM_VAE_KEYS)})")
    config = {key: value for key, value in vae_config.items() if not key.startswith("_")}
    part = _Part("vae", prefix, "", _diffusers_module("AutoencoderKL", config), _vae_state)
    return _convert_part(path, part, config, shapes, where, cache_dir, say)


# What a ControlNet takes from the UNet it steers (as diffusers' ControlNetModel.from_unet does).
CONTROLNET_FROM_UNET = (
    "flip_sin_to_cos", "freq_shift", "down_block_types", "only_cross_attention", "block_out_channels",
    "layers_per_block", "downsample_padding", "mid_block_scale_factor", "act_fn", "norm_num_groups", "norm_eps",
    "cross_attention_dim", "transformer_layers_per_block", "encoder_hid_dim", "encoder_hid_dim_type",
    "attention_head_dim", "num_attention_heads", "use_linear_projection", "class_embed_type", "addition_embed_type",
    "addition_time_embed_dim", "num_class_embeds", "upcast_attention", "resnet_time_scale_shift",
    "projection_class_embeddings_input_dim", "mid_block_type",
)


def convert_controlnet_file(path: Path, unet_config: dict, cache_dir: Path | None = None,
                            say: Callable[[str], None] = _to_stderr) -> Path:
    """A ControlNetModel folder from an original-layout ControlNet file (its names under control_model., or bare): its
    config the base UNet's (`unet_config`, as ControlNetModel.from_unet takes it) with what the file's shapes say, the
    latent and hint channels and the conditioning embedding's widths (input_hint_block: a convolution, then pairs of
    one that keeps the width and one that halves the size, then the last). Cached and refused as convert_model_file's
    files are."""
    path = Path(path)
    where = f"{field('controlnets')} {path}"
    shapes = _file_shapes(path, where)
    prefix = CONTROLNET_PREFIX if any(name.startswith(CONTROLNET_PREFIX) for name in shapes) else ""
    hint = sorted((int(found.group(1)), shape) for name, shape in shapes.items()
                  if (found := re.fullmatch(re.escape(prefix) + r"input_hint_block\.(\d+)\.weight", name)))
    if len(hint) < 2 or f"{prefix}input_blocks.0.0.weight" not in shapes:
        raise UsageError(f"{where}: not a ControlNet in the original layout (no {CONTROLNET_PREFIX}input_hint_block "
                         f"and input_blocks tensors)")
    convolutions = [shape for _, shape in hint]
    config = {key: unet_config[key] for key in CONTROLNET_FROM_UNET if key in unet_config}
    config.update(in_channels=shapes[f"{prefix}input_blocks.0.0.weight"][1], conditioning_channels=convolutions[0][1],
                  conditioning_embedding_out_channels=[convolutions[0][0]] + [
                      shape[0] for shape in convolutions[2:-1:2]])
    part = _Part("controlnet", prefix, "", _diffusers_module("ControlNetModel", config),
                 functools.partial(_controlnet_state, prefix=prefix))
    return _convert_part(path, part, config, shapes, where, cache_dir, say)


def _convert_part(path: Path, part: _Part, config: dict, shapes: dict, where: str, cache_dir: Path | None,
                  say: Callable[[str], None]) -> Path:
    """A lone module's file converted into its folder, keyed by the file's content and its config."""
    cache_dir = _cache_root(cache_dir)
    key = _key(_file_digest(path, cache_dir), json.dumps(config, sort_keys=True), None)
    return _cached(cache_dir / f"{part.component}-{key}", functools.partial(_write_parts, path, [part]), say,
                   str(path), before=lambda: _check_fit([part], shapes, where, "its config"))


# ---- files, keys and the cache -------------------------------------------------------------------------------------

def _file_shapes(path: Path, where: str) -> dict[str, list[int]]:
    """A single file's tensor names and shapes from its header, or a one-line UsageError: missing, a pickle (never
    opened), not safetensors, truncated or damaged."""
    if not path.is_file():
        raise UsageError(f"{where}: {'not a file' if path.exists() else 'no such file'}")
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise UsageError(f"{where}: a {suffix} file is a pickle, and pickles run code when loaded: convert it to "
                         ".safetensors")
    if suffix != ".safetensors":
        raise UsageError(f"{where}: not a single-file checkpoint ({', '.join(SINGLE_FILE_SUFFIXES)})")
    reason = check_weight_file(path)
    if reason:
        raise UsageError(f"{where}: damaged or truncated: {reason}")
    _, header = safetensors_header(path)
    try:
        return {name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (KeyError, TypeError):
        raise UsageError(f"{where}: damaged: its header names a tensor without a shape") from None


def _cache_root(cache_dir: Path | None) -> Path:
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "single-file"
    reason = writable_reason(cache_dir)
    if reason:
        raise UsageError(f"the model cache '{cache_dir}' cannot be used: {reason} (set DEMO_DIFFUSION_CACHE to "
                         "another folder)")
    return cache_dir


def _key(digest: str, configs: str, prediction_type: str | None) -> str:
    parts = json.dumps([SINGLE_FILE_FORMAT_VERSION, digest, configs, prediction_type])
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def _read_digests(index: Path) -> dict:
    try:
        digests = json.loads(index.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: hashed again
        return {}
    return digests if isinstance(digests, dict) else {}


def _file_digest(path: Path, cache_dir: Path) -> str:
    """The sha256 of the file's content: hashed once, then remembered by its resolved path, size and modification
    time."""
    stat = path.stat()
    name, record = str(path.resolve()), {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    known = _read_digests(cache_dir / DIGESTS).get(name)
    if isinstance(known, dict) and {key: known.get(key) for key in record} == record and "sha256" in known:
        return known["sha256"]
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    try:
        with file_lock(cache_dir / f".{DIGESTS}.lock"):
            digests = _read_digests(cache_dir / DIGESTS)
            digests[name] = {**record, "sha256": digest.hexdigest()}
            atomic_write_bytes(cache_dir / DIGESTS, json.dumps(digests, indent=1).encode())
    except OSError as exc:
        raise RunFailure(f"cannot write {cache_dir / DIGESTS}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def _cached(directory: Path, write: Callable[[Path], None], say: Callable[[str], None], source: str,
            before: Callable[[], None] = lambda: None) -> Path:
    """`directory`, converted from `source` once (models.builtin.made_once: whole or not at all, under its lock, made
    again where damaged), after `before()` (the checks)."""
    return made_once(directory, write, say, f"converting {source} (once) into {directory} ...",
                     lambda damage: f"the conversion of {source} in {directory} is damaged ({damage}): converting it "
                                    "again", before)
