"""LoRA: low-rank weight deltas from LoRA files, as diffusers' load_lora_weights + fuse_lora(lora_scale=SCALE) makes
them, for the denoiser (a UNet: SD 1.x/2.x, SDXL; a transformer: SD3, Flux.1) and the CLIP text encoders (those of
its family's Family.lora_components the model has).

    lora = read_lora("style.safetensors")             # the file's layers (a UsageError where it is bad)
    targets = model_targets(source)                   # the model's modules, from its configs (or lora_targets(module))
    for component, weight, delta in lora_deltas([(lora, 0.8)], targets):
        ...                                           # ("unet", "down_blocks.0...attn1.to_q.weight", delta)

read_lora, model_targets and lora_deltas are pure: they read files and tensors and change nothing, so engine refit can
take the same deltas as the torch backend (LoraFusion: fused into the loaded modules in place, out again bit for
bit).

A LoRA is a safetensors file, a folder holding one by diffusers' name (pytorch_lora_weights.safetensors, what
save_lora_weights and save_lora_adapter write), or a built-in's name (LORA_NAMES: `shapes-outline`, `shapes-lcm`,
shipped with `shapes`). The key formats (one file may mix them):
- diffusers / PEFT: `<component>.<module>.lora_A.weight` / `.lora_B.weight`, the component `unet`, `transformer`,
  `text_encoder` or `text_encoder_2` (what the pipelines' save_lora_weights write); a text encoder's module with or
  without `text_model.`. A file none of whose keys has a component prefix is the UNet's alone (what diffusers'
  unet.save_lora_adapter writes and unet.load_lora_adapter(prefix=None) reads; a transformer's, so read, is refused
  on its model). An adapter config in the file's metadata (diffusers' `lora_adapter_metadata`: lora_alpha,
  alpha_pattern, use_rslora; unprefixed in a UNet-only file) scales as PEFT does.
- older diffusers: `.lora.down.weight` / `.lora.up.weight`, `.lora_linear_layer.down.weight` / `.up.weight`, the
  attention processors' `<attention>.processor.to_q_lora.down.weight` (to_k, to_v, to_out), and `<module>.alpha`.
- kohya (A1111): `lora_unet_<module>`, `lora_te_` / `lora_te1_` (text_encoder), `lora_te2_` (text_encoder_2), the
  module's path with `_` for `.` (the UNet's in diffusers' or, as kohya's SDXL LoRAs spell it, Stability's names:
  input_blocks, middle_block, output_blocks), each `.lora_down.weight`, `.lora_up.weight` and `.alpha`. Linear, 1x1
  and kxk convolution LoRA (LoCon without lora_mid).
- kohya's Flux.1 LoRAs (sd-scripts, ai-toolkit): `lora_unet_<module>` in Black Forest Labs' names (double_blocks_0_
  img_attn_qkv, single_blocks_0_linear1, img_in, final_layer_..., FLUX_BFL_NAMES), their fused projections split over
  diffusers' modules (as diffusers' _convert_kohya_flux_lora_to_diffusers splits them, the sizes the model's own), and
  `lora_transformer_<module>` in diffusers' names; `lora_te1_` for the CLIP text encoder.

delta = up @ down (a kxk convolution's: down's kernel through up's 1x1, as PEFT composes them), times alpha / rank
(1 where the file gives no alpha) and the user's scale, in float32; several files add up. Where one file's alphas
differ from module to module, each module takes its own (kohya's meaning): diffusers 0.42 gives the attention
projections and text-encoder modules of such a file its most common alpha instead. Of a kohya Flux.1 file, diffusers
0.42 leaves the final layer's alphas out (its TODO) and drops the embedders' and the final layer's modules (named
without "transformer." by its converter): here they apply as every other module's.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from core.errors import RunFailure, UsageError, is_finite_number
from models.builtin import LORA_NAMES, SHIPPED_LORAS
from models.clip import CLIP2Model, CLIPModel
from models.recommended import Recommended, in_lora_file
from models.stages import STAGE_MODELS
from models.transformer import SD3TransformerModel
from models.unet import UNetModel

UNET, TRANSFORMER = UNetModel.component, SD3TransformerModel.component
TEXT_ENCODER, TEXT_ENCODER_2 = CLIPModel.component, CLIP2Model.component
COMPONENTS = (UNET, TRANSFORMER, TEXT_ENCODER, TEXT_ENCODER_2)
KOHYA_PREFIXES = {"lora_unet_": UNET, "lora_transformer_": TRANSFORMER, "lora_te_": TEXT_ENCODER,
                  "lora_te1_": TEXT_ENCODER, "lora_te2_": TEXT_ENCODER_2}
# Black Forest Labs' names of Flux.1's transformer modules (kohya's Flux LoRAs: lora_unet_<name>, "_" for ".") -> the
# diffusers FluxTransformer2DModel's modules; several where BFL's one projection is diffusers' several, its output
# rows theirs in turn (as diffusers' _convert_kohya_flux_lora_to_diffusers splits them). {i}: a block's index.
FLUX_BFL_NAMES = {
    "double_blocks_{i}_img_attn_proj": ("transformer_blocks.{i}.attn.to_out.0",),
    "double_blocks_{i}_img_attn_qkv": tuple(f"transformer_blocks.{{i}}.attn.to_{p}" for p in "qkv"),
    "double_blocks_{i}_img_mlp_0": ("transformer_blocks.{i}.ff.net.0.proj",),
    "double_blocks_{i}_img_mlp_2": ("transformer_blocks.{i}.ff.net.2",),
    "double_blocks_{i}_img_mod_lin": ("transformer_blocks.{i}.norm1.linear",),
    "double_blocks_{i}_txt_attn_proj": ("transformer_blocks.{i}.attn.to_add_out",),
    "double_blocks_{i}_txt_attn_qkv": tuple(f"transformer_blocks.{{i}}.attn.add_{p}_proj" for p in "qkv"),
    "double_blocks_{i}_txt_mlp_0": ("transformer_blocks.{i}.ff_context.net.0.proj",),
    "double_blocks_{i}_txt_mlp_2": ("transformer_blocks.{i}.ff_context.net.2",),
    "double_blocks_{i}_txt_mod_lin": ("transformer_blocks.{i}.norm1_context.linear",),
    "single_blocks_{i}_linear1": (*(f"single_transformer_blocks.{{i}}.attn.to_{p}" for p in "qkv"),
                                  "single_transformer_blocks.{i}.proj_mlp"),
    "single_blocks_{i}_linear2": ("single_transformer_blocks.{i}.proj_out",),
    "single_blocks_{i}_modulation_lin": ("single_transformer_blocks.{i}.norm.linear",),
    "img_in": ("x_embedder",), "txt_in": ("context_embedder",),
    "time_in_in_layer": ("time_text_embed.timestep_embedder.linear_1",),
    "time_in_out_layer": ("time_text_embed.timestep_embedder.linear_2",),
    "vector_in_in_layer": ("time_text_embed.text_embedder.linear_1",),
    "vector_in_out_layer": ("time_text_embed.text_embedder.linear_2",),
    "guidance_in_in_layer": ("time_text_embed.guidance_embedder.linear_1",),
    "guidance_in_out_layer": ("time_text_embed.guidance_embedder.linear_2",),
    "final_layer_linear": ("proj_out",),
    "final_layer_adaLN_modulation_1": ("norm_out.linear",),
}
# BFL's final modulation gives (shift, scale), diffusers' norm_out.linear (scale, shift): its rows' halves swapped.
FLUX_BFL_SWAPPED = "final_layer_adaLN_modulation_1"
FLUX_BFL_FIRST = re.compile(r"(double_blocks|single_blocks|img_in|txt_in|time_in|vector_in|guidance_in|final_layer)"
                            r"(_|$)")
TEXT_MODEL = "text_model."  # transformers' CLIPTextModel has flattened it away; LoRA files and ...WithProjection not
# diffusers' key endings -> which of the pair (before them: the component, then the module)
DIFFUSERS_SUFFIXES = {
    ".lora_A.weight": "down", ".lora_B.weight": "up",
    ".lora.down.weight": "down", ".lora.up.weight": "up",
    ".lora_linear_layer.down.weight": "down", ".lora_linear_layer.up.weight": "up",
    "_lora.down.weight": "down", "_lora.up.weight": "up",  # attention processors': to_q_lora -> to_q
}
# The attention processors' projection names -> the modules (the UNet's attention, CLIP's self-attention).
PROCESSOR_PROJECTIONS = {
    UNET: {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"},
    TEXT_ENCODER: {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"},
}
KOHYA_SUFFIXES = {".lora_down.weight": "down", ".lora_up.weight": "up"}
UNSUPPORTED = {  # key fragment -> why such a file is refused
    "lora_mid": "kohya LoCon's lora_mid (a Tucker-decomposed convolution) is not supported",
    "dora_scale": "DoRA (dora_scale) is not supported",
    "lora_magnitude_vector": "DoRA (lora_magnitude_vector) is not supported",
    "lora_B.bias": "LoRA biases (lora_B.bias) are not supported",
    "hada_w": "LyCORIS LoHa is not supported",
    "lokr_w": "LyCORIS LoKr is not supported",
}
LORA_METADATA = "lora_adapter_metadata"  # diffusers' safetensors metadata key: the components' PEFT LoraConfigs
PEFT_DEFAULT_ALPHA = 8  # peft's LoraConfig.lora_alpha where a config gives none
# diffusers' LORA_WEIGHT_NAME_SAFE and LORA_WEIGHT_NAME: the file its load_lora_weights takes from a folder, and the
# pickled one it falls back to (torch.load runs code: not read here)
LORA_WEIGHT_NAME_SAFE, LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors", "pytorch_lora_weights.bin"
SAFETENSORS_HEADER_LIMIT = 100_000_000  # safetensors' own bound on a header's size
Targets = Mapping[str, Mapping[str, tuple[int, ...]]]  # component -> lora_targets of its module


@dataclass(frozen=True)
class LoraLayer:
    """One module's pair: delta = up @ down x alpha / rank."""

    component: str  # unet, transformer, text_encoder, text_encoder_2
    name: str  # the module as the file names it: a dotted path, or kohya's with "_" (resolved by lora_deltas)
    down: torch.Tensor  # [rank, in] or [rank, in, kh, kw]
    up: torch.Tensor  # [out, rank] or [out, rank, 1, 1] (a fused BFL projection's: its modules' rows in turn)
    alpha: float | None  # None: the file's adapter config decides where it has one, else alpha = rank

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass(frozen=True)
class AdapterConfig:
    """What scales a component's deltas in its PEFT LoraConfig (diffusers' metadata), checked when read."""

    lora_alpha: float
    alpha_pattern: tuple[tuple[re.Pattern, float], ...]  # compiled as PEFT matches them, in the file's order
    use_rslora: bool

    def alpha(self, path: str) -> float:
        """The alpha PEFT gives module `path`: the first alpha_pattern matching the path's end, else lora_alpha."""
        return next((alpha for pattern, alpha in self.alpha_pattern if pattern.match(path)), self.lora_alpha)


@dataclass(frozen=True)
class LoraFile:
    path: str  # the file read (a folder's pytorch_lora_weights.safetensors)
    layers: tuple[LoraLayer, ...]
    configs: Mapping[str, AdapterConfig]  # component -> its adapter config, from diffusers' metadata
    prefixless: bool  # no key names its component: the UNet's alone
    recommended: Recommended = Recommended()  # the steps, guidance and scheduler it says it runs best with


def _refuse(path, message: str):
    raise UsageError(f"LoRA {path}: {message}")


def _weights_file(text: str | Path) -> Path:
    """The file a LoRA names: a built-in's (checked), the path itself, or a folder's pytorch_lora_weights.safetensors
    (as diffusers takes it)."""
    if str(text) in SHIPPED_LORAS:
        package, file = SHIPPED_LORAS[str(text)]
        if reason := package.damage():
            raise RunFailure(f"LoRA {text}: the LoRA shipped with the package is damaged ({reason}): reinstall it")
        return file
    path = Path(text)
    if not path.is_dir():
        return path
    if (path / LORA_WEIGHT_NAME_SAFE).is_file():
        return path / LORA_WEIGHT_NAME_SAFE
    if (path / LORA_WEIGHT_NAME).exists():
        _refuse(path, f"holds {LORA_WEIGHT_NAME}, a pickle, not {LORA_WEIGHT_NAME_SAFE}: only safetensors files are "
                      "read (save its state dict with safetensors.torch.save_file)")
    _refuse(path, f"is a folder without {LORA_WEIGHT_NAME_SAFE} (diffusers' LoRA file name): name the file itself")


def _shortfall(path: Path) -> str | None:
    """Why safetensors cannot open a file, where the file says more than safetensors does: it is empty, or shorter
    than its own header says (a download or copy cut off)."""
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if length > SAFETENSORS_HEADER_LIMIT or file.read(1) != b"{":  # no safetensors header at all
            return None
        needed = 8 + length
        if size >= needed:
            file.seek(8)
            try:
                entries = json.loads(file.read(length))
                needed += max((entry["data_offsets"][1] for key, entry in entries.items() if key != "__metadata__"),
                              default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                return None
    return f"is truncated: {size} bytes, where its header describes {needed}" if size < needed else None


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as file:
            return {key: file.get_tensor(key) for key in file.keys()}, file.metadata() or {}
    except FileNotFoundError:
        _refuse(path, f"no such file (nor a built-in LoRA: {', '.join(LORA_NAMES)})")
    except OSError as exc:
        _refuse(path, f"cannot be read ({exc.strerror or exc})")
    except SafetensorError as exc:
        _refuse(path, _shortfall(path) or f"is not a safetensors file ({exc})")


def _adapter_config(path: Path, component: str, fields: Mapping) -> AdapterConfig:
    """A component's LoraConfig fields as PEFT would scale by them; a one-line refusal for one it would fail on or
    misread (PEFT divides by lora_alpha's value and compiles each alpha_pattern key as a regular expression)."""
    where = f"{LORA_METADATA} {component}."
    for option in ("use_dora", "lora_bias"):
        if fields.get(option):
            _refuse(path, f"{where}{option} is set, which is not supported")
    alpha = fields.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not is_finite_number(alpha):
        _refuse(path, f"{where}lora_alpha must be a finite number, got {json.dumps(alpha)}")
    patterns = fields.get("alpha_pattern", {})
    if not isinstance(patterns, dict):
        _refuse(path, f"{where}alpha_pattern must be an object of module pattern -> alpha, got {json.dumps(patterns)}")
    compiled = []
    for pattern, value in patterns.items():
        if not is_finite_number(value):
            _refuse(path, f"{where}alpha_pattern '{pattern}' must give a finite number, got {json.dumps(value)}")
        try:
            compiled.append((re.compile(rf"(.*\.)?({pattern})$"), value))
        except re.error as exc:
            _refuse(path, f"{where}alpha_pattern '{pattern}' is not a regular expression ({exc})")
    rslora = fields.get("use_rslora", False)
    if not isinstance(rslora, bool):
        _refuse(path, f"{where}use_rslora must be true or false, got {json.dumps(rslora)}")
    return AdapterConfig(alpha, tuple(compiled), rslora)


def _adapter_configs(path: Path, metadata: Mapping[str, str], prefixless: bool) -> dict[str, AdapterConfig]:
    """diffusers' metadata: {"<component>.<LoraConfig field>": value} as one JSON string (a UNet-only file's fields
    unprefixed)."""
    if LORA_METADATA not in metadata:
        return {}
    try:
        fields = json.loads(metadata[LORA_METADATA])
        if prefixless:
            fields = {f"{UNET}.{key}": value for key, value in fields.items()}
        configs = {component: {key.removeprefix(f"{component}."): value for key, value in fields.items()
                               if key.startswith(f"{component}.")} for component in COMPONENTS}
    except (ValueError, AttributeError):
        _refuse(path, f"its {LORA_METADATA} metadata is not a JSON object")
    return {component: _adapter_config(path, component, config) for component, config in configs.items() if config}


def _prefixed(key: str) -> bool:
    """Whether a key names its component (kohya's lora_unet_..., diffusers' unet. ...)."""
    return key.startswith(tuple(KOHYA_PREFIXES)) or key.partition(".")[0] in COMPONENTS


def _key_part(key: str, prefixless: bool = False) -> tuple[str, str, str] | None:
    """(component, module name, "down" / "up" / "alpha") for a LoRA key of a known format (`prefixless`: a diffusers
    key of the UNet's without "unet."); None for another."""
    for prefix, component in KOHYA_PREFIXES.items():
        if key.startswith(prefix):
            name, _, suffix = key[len(prefix):].partition(".")
            part = "alpha" if suffix == "alpha" else KOHYA_SUFFIXES.get(f".{suffix}")
            if component == UNET and FLUX_BFL_FIRST.match(name):  # kohya's Flux.1 LoRAs name its transformer so
                component = TRANSFORMER
            return (component, name, part) if part else None
    component, _, rest = key.partition(".")
    if prefixless:
        component, rest = UNET, key
    elif component not in COMPONENTS:
        return None
    rest = rest.replace(".processor.", ".")
    if rest.endswith(".alpha"):
        return component, rest.removesuffix(".alpha"), "alpha"
    for suffix, part in DIFFUSERS_SUFFIXES.items():
        if rest.endswith(suffix):
            name = rest.removesuffix(suffix)
            if suffix.startswith("_lora"):
                attention, _, projection = name.rpartition(".")
                projections = PROCESSOR_PROJECTIONS[UNET if component == UNET else TEXT_ENCODER]
                if projection not in projections:
                    return None
                name = f"{attention}.{projections[projection]}"
            return component, name, part
    return None


def read_lora(path: str | Path) -> LoraFile:
    """A LoRA safetensors file's layers (or a folder's pytorch_lora_weights.safetensors', or a built-in's), each
    module's down, up and alpha gathered from whichever format it is in; a one-line UsageError for a file that is
    missing, unreadable, not safetensors, cut short, or holds keys of no format above or a pair that is none (a
    damaged built-in: a RunFailure); with what it recommends (models.recommended)."""
    given, path = str(path), _weights_file(path)
    tensors, metadata = _read_tensors(path)
    if not tensors:
        _refuse(path, "holds no tensors")
    prefixless = not any(map(_prefixed, tensors))
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = defaultdict(dict)
    unknown = []
    for key, tensor in tensors.items():
        reason = next((why for fragment, why in UNSUPPORTED.items() if fragment in key), None)
        if reason:
            _refuse(path, f"{reason} ('{key}')")
        found = _key_part(key, prefixless)
        if found is None:
            unknown.append(key)
            continue
        component, name, part = found
        if part in parts[component, name]:
            _refuse(path, f"names the {part} of {component} module {name} twice ('{key}')")
        parts[component, name][part] = tensor
    unprefixed = [key for key in unknown if _key_part(key, prefixless=True)]
    if unprefixed:
        _refuse(path, f"key '{unprefixed[0]}' has no component prefix ({', '.join(f'{c}.' for c in COMPONENTS)}) "
                      f"while other keys have one ({len(unprefixed)} such keys)")
    if unknown:
        _refuse(path, f"holds keys of no LoRA format known here, such as '{unknown[0]}' ({len(unknown)} in all; "
                      "known: diffusers/PEFT unet./transformer./text_encoder.<module>.lora_A/lora_B or lora.down/"
                      "lora.up, kohya lora_unet_/lora_transformer_/lora_te_... with lora_down/lora_up and alpha)")
    layers = []
    for (component, name), found in parts.items():
        missing = [part for part in ("down", "up") if part not in found]
        if missing:
            _refuse(path, f"{component} module {name} has no {missing[0]} weight")
        down, up = found["down"], found["up"]
        if not (down.is_floating_point() and up.is_floating_point()):
            _refuse(path, f"{component} module {name}: its weights are {down.dtype} and {up.dtype}, not floats")
        if down.dim() not in (2, 4) or up.dim() != down.dim() or up.shape[1] != down.shape[0] \
                or up.shape[2:] not in ((), (1, 1)):
            _refuse(path, f"{component} module {name}: down {list(down.shape)} and up {list(up.shape)} are no "
                          "low-rank pair")
        if down.shape[0] == 0:  # PEFT refuses r = 0 too
            _refuse(path, f"{component} module {name}: down {list(down.shape)} and up {list(up.shape)} have rank 0 "
                          "(a LoRA's rank is at least 1)")
        alpha = found.get("alpha")
        if alpha is not None and (alpha.numel() != 1 or not math.isfinite(float(alpha.item()))):
            _refuse(path, f"{component} module {name}: its alpha is not one finite number")
        layers.append(LoraLayer(component, name, down, up, None if alpha is None else float(alpha.item())))
    return LoraFile(str(path), tuple(layers), _adapter_configs(path, metadata, prefixless), prefixless,
                    in_lora_file(path, metadata, given))


# ---- the model side --------------------------------------------------------------------------------------------

def lora_targets(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """What a LoRA can change in a component's module (a diffusers UNet, a transformers text encoder): its Linear
    ([out, in]) and Conv2d ([out, in, kh, kw]) weights' shapes, by module path; embeddings aside."""
    return {name: tuple(child.weight.shape) for name, child in module.named_modules()
            if isinstance(getattr(child, "weight", None), torch.nn.Parameter) and child.weight.dim() in (2, 4)
            and not isinstance(child, torch.nn.Embedding)}


def model_targets(source) -> dict[str, dict[str, tuple[int, ...]]]:
    """lora_targets of the components a LoRA may change in a model (a models.source.ModelSource's: those of its
    family's lora_components it has) from their configs alone: no weight is read, so LoRA files are checked before
    the model loads, and engines know the modules."""
    family = source.family
    names = (*family.text_stages, family.denoiser_stage)
    wanted = {family.stage_component(name, STAGE_MODELS[name].component): name for name in names}
    return {component: lora_targets(STAGE_MODELS[name](source).component_skeleton())
            for component, name in wanted.items() if component in family.lora_components
            and component in source.components}


# Stability's (sgm) names of the UNet's modules that kohya's SDXL LoRAs use, beside diffusers'.
SGM_FIXED = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
             "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
             "add_embedding.linear_2": "label_emb.0.2"}
SGM_RESNET = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
              "conv_shortcut": "skip_connection"}
SGM_MID = {("resnets", "0"): "middle_block.0", ("attentions", "0"): "middle_block.1",
           ("resnets", "1"): "middle_block.2"}
UNET_PART = re.compile(r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)")


def _sgm_names(paths) -> dict[str, str]:
    """diffusers UNet module path -> its sgm name: input_blocks count conv_in, then per level its resnet (with
    attention) layers and a downsampler; output_blocks per level its layers, the last with the upsampler after its
    resnet and attention."""
    resnets, attentions = Counter(), set()
    for path in paths:
        match = UNET_PART.match(path)
        if match and match[3] in ("resnets", "attentions"):
            if match[3] == "resnets":
                resnets[match[1], int(match[2])] = max(resnets[match[1], int(match[2])], int(match[4]) + 1)
            else:
                attentions.add((match[1], int(match[2])))
    names = {}
    for path in paths:
        if path in SGM_FIXED:
            names[path] = SGM_FIXED[path]
            continue
        mid = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d)\.(.+)", path)
        match = UNET_PART.fullmatch(path)
        if mid and (mid[1], mid[2]) in SGM_MID:
            rest = SGM_RESNET.get(mid[3], mid[3]) if mid[1] == "resnets" else mid[3]
            names[path] = f"{SGM_MID[mid[1], mid[2]]}.{rest}"
        elif match:
            blocks, level, kind, index, rest = match[1], int(match[2]), match[3], int(match[4]), match[5]
            rest = SGM_RESNET.get(rest, rest) if kind == "resnets" else rest
            if blocks == "down_blocks":
                first = 1 + sum(resnets[blocks, lower] + 1 for lower in range(level))
                names[path] = {"resnets": f"input_blocks.{first + index}.0.{rest}",
                               "attentions": f"input_blocks.{first + index}.1.{rest}",
                               "downsamplers": f"input_blocks.{first + resnets[blocks, level]}.0.op"}[kind]
            else:
                first = sum(resnets[blocks, lower] for lower in range(level))
                last = first + resnets[blocks, level] - 1
                upsampler = 2 if (blocks, level) in attentions else 1
                names[path] = {"resnets": f"output_blocks.{first + index}.0.{rest}",
                               "attentions": f"output_blocks.{first + index}.1.{rest}",
                               "upsamplers": f"output_blocks.{last}.{upsampler}.{rest}"}[kind]
    return names


def _flat(name: str) -> str:
    return name.replace(".", "_")


def _flux_bfl_names(paths) -> dict[str, tuple[str, ...]]:
    """BFL's names (FLUX_BFL_NAMES) of a Flux.1 transformer's modules (one with single_transformer_blocks: SD3's has
    none) -> their diffusers paths, each name whose modules it has all of."""
    if not any(path.startswith("single_transformer_blocks.") for path in paths):
        return {}
    present = set(paths)
    blocks = {int(match[1]) for path in paths if (match := re.match(r"(?:single_)?transformer_blocks\.(\d+)\.", path))}
    names = {}
    for name, modules in FLUX_BFL_NAMES.items():
        for index in sorted(blocks) if "{i}" in name else (None,):
            made = tuple(module.format(i=index) for module in modules)
            if present.issuperset(made):
                names[name.format(i=index)] = made
    return names


def _name_table(component: str, paths) -> dict[str, tuple[str, ...]]:
    """Every name a LoRA file may give a target module, with "_" for ".", -> its path: the path itself; a text
    encoder's with and without text_model.; the UNet's sgm name; a Flux transformer's BFL names (one of them
    several modules: a fused projection's)."""
    sgm = _sgm_names(paths) if component == UNET else {}
    table = {}
    for path in paths:
        if component == UNET:
            aliases = [path, *([sgm[path]] if path in sgm else [])]
        elif component == TRANSFORMER:
            aliases = [path]
        else:
            aliases = [path, path.removeprefix(TEXT_MODEL) if path.startswith(TEXT_MODEL) else TEXT_MODEL + path]
        for alias in aliases:
            table.setdefault(_flat(alias), (path,))
    if component == TRANSFORMER:
        for name, modules in _flux_bfl_names(paths).items():
            table.setdefault(name, modules)
    return table


def _scaling(lora: LoraFile, layer: LoraLayer, path: str) -> float:
    """alpha / rank as PEFT computes it (alpha / sqrt(rank) under use_rslora); 1 without an alpha."""
    config = lora.configs.get(layer.component) if layer.alpha is None else None
    if config is None:
        return 1.0 if layer.alpha is None else layer.alpha / layer.rank
    rank = math.sqrt(layer.rank) if config.use_rslora else layer.rank
    return config.alpha(path) / rank


def _resolve(lora: LoraFile, targets: Targets, tables: Mapping[str, Mapping[str, tuple[str, ...]]]
             ) -> list[tuple[str, str, LoraLayer]]:
    """(component, module path, layer) per module the file changes, each checked against the model's module
    (`tables`: _name_table's, per component); a fused BFL projection's layer split over its modules, each its rows of
    up (down shared: up's rows times down are the fused delta's rows, exactly)."""
    resolved, seen = [], {}
    for layer in lora.layers:
        if layer.component not in targets:
            why = (f"its keys have no component prefix, so they are the UNet's: a transformer's need {TRANSFORMER}."
                   if lora.prefixless else "a LoRA for another model?")
            _refuse(lora.path, f"changes {layer.component}, which a LoRA does not change in this model (its LoRAs "
                               f"change {', '.join(targets)}: {why})")
        paths = tables[layer.component].get(_flat(layer.name))
        if paths is None:
            why = ("its keys have no component prefix, so they are the UNet's: a text encoder's need text_encoder. or "
                   "text_encoder_2." if lora.prefixless else "a LoRA for another model?")
            _refuse(lora.path, f"{layer.component} has no Linear or Conv2d module '{layer.name}' ({why})")
        weights = [targets[layer.component][path] for path in paths]
        rows = [weight[0] for weight in weights]
        if any(weight[1:] != tuple(layer.down.shape[1:]) for weight in weights) or sum(rows) != layer.up.shape[0]:
            modules = "module " + paths[0] if len(paths) == 1 else "modules " + ", ".join(paths)
            shapes = " and ".join(str(list(weight)) for weight in weights)
            _refuse(lora.path, f"{layer.component} {modules} {'has a' if len(paths) == 1 else 'have'} {shapes} "
                               f"weight{'s' * (len(paths) > 1)}; the LoRA's down {list(layer.down.shape)} and up "
                               f"{list(layer.up.shape)} do not fit {'it' if len(paths) == 1 else 'them'} (a LoRA for "
                               "another model?)")
        up = layer.up
        if _flat(layer.name) == FLUX_BFL_SWAPPED:
            up = torch.cat(up.chunk(2)[::-1])
        for path, part in zip(paths, up.split(rows)):
            if (layer.component, path) in seen:
                _refuse(lora.path, f"names {layer.component} module {path} twice ({seen[layer.component, path]}, "
                                   f"{layer.name})")
            seen[layer.component, path] = layer.name
            resolved.append((layer.component, path, LoraLayer(layer.component, layer.name, layer.down, part,
                                                              layer.alpha)))
    return resolved


def _delta(down: torch.Tensor, up: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's get_delta_weight for a Linear or a Conv2d (1x1: a matrix product; kxk: down's kernels through up)."""
    if down.dim() == 2:
        return (up @ down) * scaling
    if down.shape[2:] == (1, 1):
        return (up.squeeze(3).squeeze(2) @ down.squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3) * scaling
    return torch.nn.functional.conv2d(down.transpose(0, 1), up).transpose(0, 1) * scaling


def check_loras(loras: Sequence[tuple[LoraFile, float]], targets: Targets) -> dict[tuple[str, str], list]:
    """Each file (and its scale) against the model's modules: a one-line UsageError for the first that does not fit.
    Returns each changed module's (component, path) -> [(layer, alpha / rank x scale), ...]."""
    tables = {component: _name_table(component, paths) for component, paths in targets.items()}
    pairs: dict[tuple[str, str], list[tuple[LoraLayer, float]]] = defaultdict(list)
    for lora, scale in loras:
        if not math.isfinite(scale):
            _refuse(lora.path, f"the scale must be a finite number, got {scale}")
        for component, path, layer in _resolve(lora, targets, tables):
            pairs[component, path].append((layer, _scaling(lora, layer, path) * scale))
    return pairs


def lora_deltas(loras: Sequence[tuple[LoraFile, float]], targets: Targets,
                device: torch.device | str = "cpu") -> Iterator[tuple[str, str, torch.Tensor]]:
    """(component, "<module path>.weight", float32 delta on `device`) for each module the files change, their
    deltas (each x its scale) added up. Every file is checked first (check_loras); the deltas are then made one
    module at a time, as they are taken."""
    pairs = check_loras(loras, targets)

    def deltas():
        for (component, path), layers in pairs.items():
            total = None
            for layer, scaling in layers:
                delta = _delta(layer.down.to(device, torch.float32), layer.up.to(device, torch.float32), scaling)
                total = delta if total is None else total.add_(delta)
            yield component, f"{path}.weight", total

    return deltas()


class LoraFusion:
    """LoRA deltas fused into loaded components' weights (component name -> its module). Weights change in place
    (copy_), so compiled code and captured CUDA graphs, which hold their storage, see the new values; the touched
    weights' originals are kept on the host and copied back before the next set, so switching never drifts."""

    def __init__(self, components: Mapping[str, torch.nn.Module]):
        self.components = dict(components)
        self.targets = {name: lora_targets(module) for name, module in self.components.items()}
        self._originals: dict[tuple[str, str], torch.Tensor] = {}

    def set(self, loras: Sequence[tuple[LoraFile, float]]) -> None:
        """Fuse `loras` (file, scale), added up, in place of those fused before; none: the base weights, bit for bit.
        A file that does not fit the model changes nothing."""
        device = next(next(iter(self.components.values())).parameters()).device
        deltas = lora_deltas(loras, self.targets, device)
        with torch.no_grad():
            self._restore()
            for component, name, delta in deltas:
                weight = self.components[component].get_parameter(name)
                self._originals[component, name] = weight.detach().to("cpu", copy=True)
                weight.copy_((weight.float() + delta).to(weight.dtype))

    def _restore(self) -> None:
        for (component, name), original in self._originals.items():
            self.components[component].get_parameter(name).copy_(original)
        self._originals.clear()
