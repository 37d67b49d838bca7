"""A model folder checked before anything heavy loads from it: every component's config parses and names a
class this toolkit can load, the scheduler config builds with a prediction type diffusers' schedulers know, the VAE's
scaling factor is a number, the denoiser attends to text as wide as its text encoders make it (SD3's transformer: T5's
width, its pooled text the CLIPs' projections), each tokenizer has its vocabulary, and every weight file is whole
(safetensors: header and size; PyTorch pickles: a readable zip). A ControlNet's folder likewise, its weights checked
against its config too. What fails is one UsageError naming the component and the file, not a traceback from deep
inside diffusers minutes later (or, for a tensor a file lacks, a module that diffusers loads half-initialised without
a word)."""

from __future__ import annotations

import inspect
import json
import struct
import zipfile
from pathlib import Path

from core.errors import UsageError, is_finite_number
from models import T5
from models.families import FAMILIES, Family, family_of

# component -> (the config file in its folder, the key naming its class, where that class lives)
COMPONENTS = {
    "text_encoder": ("config.json", "architectures", "transformers"),
    "tokenizer": ("tokenizer_config.json", "tokenizer_class", "transformers"),
    "text_encoder_2": ("config.json", "architectures", "transformers"),
    "tokenizer_2": ("tokenizer_config.json", "tokenizer_class", "transformers"),
    "text_encoder_3": ("config.json", "architectures", "transformers"),
    "tokenizer_3": ("tokenizer_config.json", "tokenizer_class", "transformers"),
    "unet": ("config.json", "_class_name", "diffusers"),
    "transformer": ("config.json", "_class_name", "diffusers"),
    "vae": ("config.json", "_class_name", "diffusers"),
    "scheduler": ("scheduler_config.json", "_class_name", "diffusers"),
    "controlnet": ("config.json", "_class_name", "diffusers"),  # a ControlNet's own folder, not a model's component
}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # the UNet attends to their states, concatenated
T5_ENCODER = "text_encoder_3"  # a T5 stage's encoder (SD3's): the transformer attends to its states' width
WEIGHTED = (*TEXT_ENCODERS, T5_ENCODER, "unet", "transformer", "vae", "controlnet")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")
# What a tokenizer folder's vocabulary is read from: transformers' one file, or CLIP's vocabulary and merges.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))


# The VAE classes the VAE stages load (models.vae), each with whether its encoder gives the latents' Gaussian (mean and
# log-variance, which the pipeline samples) or the latents themselves: diffusers' retrieve_latents tells them apart by
# `latent_dist` and `latents`.
VAE_ENCODES_GAUSSIAN = {"AutoencoderKL": True, "AutoencoderTiny": False}

WEIGHT_SUFFIXES = (".safetensors", ".bin")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


def read_config(path: Path, component: str, subject: str | None = None) -> dict:
    """A component's config as a dict, or a UsageError naming the file and what is wrong with it (after `subject`,
    what the message is about: by default the component)."""
    subject = subject or f"component '{component}'"
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise UsageError(f"{subject}: {path} is missing") from None
    except OSError as exc:
        raise UsageError(f"{subject}: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"{subject}: {path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{subject}: {path} holds a {type(config).__name__}, not a JSON object")
    return config


def vae_config_as_loaded(config: dict) -> dict:
    """A VAE config with what diffusers registers when it loads an AutoencoderTiny, which a saved config may lack
    (madebyollin's TAESD folders do): block_out_channels, its decoder's widths (diffusers' pipelines compute the VAE's
    scale factor from them), and force_upcast, always false."""
    if config.get("_class_name") != "AutoencoderTiny":
        return config
    import diffusers

    widths = inspect.signature(diffusers.AutoencoderTiny).parameters["decoder_block_out_channels"].default
    return {**config, "block_out_channels": list(config.get("decoder_block_out_channels", widths)),
            "force_upcast": False}


def _class_name(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, list):  # transformers: "architectures": ["CLIPTextModel"]
        value = value[0] if value else None
    return value if isinstance(value, str) else None


def safetensors_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header: its length in bytes and its JSON (a ValueError saying why it cannot be read)."""
    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"its header claims {length} bytes but the file has {size}")
        try:
            return length, json.loads(file.read(length))
        except ValueError as exc:
            raise ValueError(f"its header is not JSON ({exc})") from None


def check_safetensors(path: Path) -> str | None:
    """Why a safetensors file is not whole (None: its header parses and its tensors end where the file does)."""
    try:
        length, header = safetensors_header(path)
    except ValueError as exc:
        return str(exc)
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2]
    expected = 8 + length + max(ends, default=0)
    size = path.stat().st_size
    return None if expected == size else f"{size} bytes where its header says {expected} (truncated or padded)"


def check_weight_file(path: Path) -> str | None:
    """Why a weight file cannot be loaded (None: it looks whole)."""
    try:
        if path.suffix == ".safetensors":
            return check_safetensors(path)
        return None if zipfile.is_zipfile(path) else "not a PyTorch zip archive (damaged or truncated)"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"


def validate_model_folder(path: Path, name: str) -> None:
    """Check the folder of model `name` as the module docstring says; the first problem is a UsageError."""

    index_file = path / "model_index.json"
    index = read_config(index_file, "model_index") if index_file.exists() else {}
    family = family_of(index, lambda component: read_config(path / component / COMPONENTS[component][0], component),
                       name)
    configs = {}
    for component in family.model_components(index):
        file_name = COMPONENTS[component][0]
        if not (path / component / file_name).exists():
            raise UsageError(f"model '{name}' is missing component '{component}' (no {component}/{file_name} in "
                             f"{path})")
        configs[component] = validate_component(path / component, component, index.get(component, [None, None])[1:])
        if component == "scheduler":
            _check_scheduler(configs[component], path / component / file_name)
    _check_text_width(path, configs, family)


def validate_component(folder: Path, component: str, index_class: list | None = None,
                       subject: str | None = None) -> dict:
    """One component's folder: its config parses and names a class its library has (else the one model_index.json
    names, `index_class`), a VAE's scaling factor is a number, a tokenizer's vocabulary is there and parses, and its
    weights are whole. Returns the config. `subject`: what the messages are about (by default the component)."""
    import diffusers
    import transformers

    subject = subject or f"component '{component}'"
    file_name, key, library = COMPONENTS[component]
    module = {"diffusers": diffusers, "transformers": transformers}[library]
    file = folder / file_name
    config = read_config(file, component, subject)
    class_name = _class_name(config, key) or _class_name({key: index_class or []}, key)
    if class_name is None or not hasattr(module, class_name):
        raise UsageError(f"{subject}: {file} names class {class_name!r} ({key}), which "
                         f"{library} {module.__version__} does not have")
    if component == "vae":
        if class_name not in VAE_ENCODES_GAUSSIAN:
            raise UsageError(f"{subject}: its config names {class_name}, not an {' or an '.join(VAE_ENCODES_GAUSSIAN)}")
        _check_scaling_factor(config, file, subject)
    if component in TOKENIZERS:
        _check_tokenizer_files(folder, component, subject)
    if component in WEIGHTED:
        for weight in weight_files(folder, subject):
            reason = check_weight_file(weight)
            if reason:
                raise UsageError(f"{subject}: {weight} is damaged: {reason}")
    return config


def weight_files(folder: Path, subject: str) -> list[Path]:
    """The weight files in `folder`, or a UsageError where it has none."""
    weights = [p for p in sorted(folder.iterdir()) if p.suffix in WEIGHT_SUFFIXES]
    if not weights:
        raise UsageError(f"{subject}: no weights ({' or '.join(WEIGHT_SUFFIXES)}) in {folder}")
    return weights


def _check_scaling_factor(config: dict, file: Path, subject: str) -> None:
    """The latents are divided by it before decoding, and the encoder's multiplied by it."""
    factor = config.get("scaling_factor")
    if not (is_finite_number(factor) and factor > 0):
        given = f"scaling_factor {factor!r}" if "scaling_factor" in config else "no scaling_factor"
        raise UsageError(f"{subject}: {file} has {given}; it must be a number above 0")


def _check_tokenizer_files(folder: Path, component: str, subject: str) -> None:
    """A tokenizer without its vocabulary loads (transformers makes one of its special tokens alone) and turns every
    prompt into the same few ids: refused, as is a vocabulary file that does not parse."""
    present = next((names for names in TOKENIZER_FILES if all((folder / name).is_file() for name in names)), None)
    if present is None:
        ways = " or ".join(" and ".join(names) for names in TOKENIZER_FILES)
        raise UsageError(f"{subject}: no vocabulary in {folder} ({ways})")
    for name in present:
        if name.endswith(".json"):
            read_config(folder / name, component, subject)


def _check_text_width(path: Path, configs: dict[str, dict], family: Family) -> None:
    """The denoiser attends to text as wide as its text encoders make it (a model without text encoders, or a width
    its configs leave out, is not checked): a UNet to the CLIPs' states side by side; a denoiser of a family with a T5
    stage (SD3's and Flux's transformers, `joint_attention_dim`) to the T5's states (`d_model`), the CLIPs' side by
    side padded to that width (so no wider), and the CLIPs' pooled outputs side by side as the pooled text it takes
    (the family's pooled_width_key: `pooled_projection_dim`; their `projection_dim`s where the family projects them,
    SD3's, else their `hidden_size`s, Flux's)."""
    denoiser, key = family.denoiser, family.text_width_key
    file = path / denoiser / COMPONENTS[denoiser][0]
    t5_component = family.stage_component(T5, T5_ENCODER) if T5 in family.text_stages else None
    widths = {name: configs[name].get("hidden_size") for name in TEXT_ENCODERS
              if name in configs and name != t5_component}
    attends = configs[denoiser].get(key)
    if not widths or not all(isinstance(width, int) for width in (*widths.values(), attends)):
        return  # a width left out (the library's default then) or not a number: not for this check
    made = " + ".join(f"{width} ({name})" for name, width in widths.items())
    if t5_component is None:
        if attends != sum(widths.values()):
            raise UsageError(f"component '{denoiser}': {file} attends to text {attends} wide ({key}), but its text "
                             f"encoders' states are {made} wide (hidden_size)")
        return
    t5 = configs.get(t5_component, {}).get("d_model")
    if isinstance(t5, int) and attends != t5:
        raise UsageError(f"component '{denoiser}': {file} attends to text {attends} wide ({key}), but its T5's "
                         f"states are {t5} wide ({t5_component} d_model)")
    if sum(widths.values()) > attends:
        raise UsageError(f"component '{denoiser}': {file} attends to text {attends} wide ({key}), but its CLIP text "
                         f"encoders' states, side by side, are {made} wide (hidden_size): wider than the text they "
                         "are padded to")
    pooled = configs[denoiser].get(family.pooled_width_key) if family.pooled_width_key else None
    pooled_key = "projection_dim" if family.projected_pooled else "hidden_size"
    projections = {name: configs[name].get(pooled_key) for name in widths}
    if isinstance(pooled, int) and all(isinstance(width, int) for width in projections.values()) and \
            pooled != sum(projections.values()):
        given = " + ".join(f"{width} ({name})" for name, width in projections.items())
        raise UsageError(f"component '{denoiser}': {file} takes pooled text {pooled} wide "
                         f"({family.pooled_width_key}), but its text encoders' pooled outputs are {given} wide "
                         f"({pooled_key})")


def validate_controlnet_folder(folder: Path, subject: str) -> dict:
    """A ControlNet's folder (a family's ControlNet class: ControlNetModel, SD3ControlNetModel, FluxControlNetModel)
    checked as a model's components are, and its weights against its config: exactly the tensors the config implies,
    each of its shape. Returns its config as diffusers reads it (the defaults of the fields it leaves out filled in,
    as loading it would, and its class name)."""
    import diffusers
    import torch

    file = folder / COMPONENTS["controlnet"][0]
    config = validate_component(folder, "controlnet", subject=subject)
    classes = tuple(dict.fromkeys(family.controlnet_class for family in FAMILIES))
    class_name = config.get("_class_name")
    if class_name not in classes:
        raise UsageError(f"{subject}: {file} names a {class_name}, not a {' or '.join(classes)}")
    try:
        with torch.device("meta"):  # shapes without memory: a full-size ControlNet costs nothing to check
            module = getattr(diffusers, class_name).from_config(config)
    except Exception as exc:  # a config diffusers cannot build from: one line naming the file
        reason = " ".join(str(exc).split())[:200]
        raise UsageError(f"{subject}: {file} does not build a {class_name}: {reason}") from None
    weights = weight_files(folder, subject)
    # diffusers reads the safetensors where there are any, else the PyTorch files
    read = [p for p in weights if p.suffix == ".safetensors"] or weights
    problem = tensor_misfit(_file_tensors(read, subject), module.state_dict())
    if problem:
        names = ", ".join(p.name for p in read)
        raise UsageError(f"{subject}: {names} does not fit {file}: {problem}")
    return {"_class_name": class_name, **module.config}


def _file_tensors(files: list[Path], subject: str) -> dict:
    """The tensors in weight files (whole, check_weight_file), as shapes alone (meta tensors), or a UsageError naming
    the file whose tensors cannot be read."""
    import pickle

    import torch

    tensors = {}
    for path in files:
        try:
            if path.suffix == ".safetensors":
                _, header = safetensors_header(path)
                read = {name: torch.empty(entry["shape"], device="meta") for name, entry in header.items()
                        if name != "__metadata__"}
            else:  # a PyTorch zip: its pickle read with weights_only (no code runs), its storages left on disk
                read = torch.load(path, map_location="meta", weights_only=True)
            tensors.update({name: tensor for name, tensor in read.items() if isinstance(tensor, torch.Tensor)})
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, pickle.UnpicklingError) as exc:
            raise UsageError(f"{subject}: {path} is damaged: its tensors cannot be read "
                             f"({' '.join(str(exc).split())[:200] or type(exc).__name__})") from None
    return tensors


def tensor_misfit(given: dict, expected: dict) -> str | None:
    """The first tensor, in the module's order, that `given` (a file's tensors) lacks or has of another shape, else the
    first it has beyond the module's (`expected`, its state dict) (None: they fit)."""
    for key, tensor in expected.items():
        if key not in given:
            return f"the file has no tensor for {key}"
        if given[key].shape != tensor.shape:
            return f"tensor {key} is {list(given[key].shape)} in the file, {list(tensor.shape)} in the config"
    extra = next((key for key in given if key not in expected), None)
    return extra and f"the file has tensor {extra}, which the config has not"


def _check_scheduler(config: dict, file: Path) -> None:
    import diffusers

    prediction = config.get("prediction_type", "epsilon")
    if prediction not in PREDICTION_TYPES:
        raise UsageError(f"component 'scheduler': {file} has prediction_type {prediction!r}; diffusers' schedulers "
                         f"take {', '.join(PREDICTION_TYPES)}")
    try:
        getattr(diffusers, config["_class_name"]).from_config(config)
    except Exception as exc:  # a config diffusers cannot build from: one line naming the file
        raise UsageError(f"component 'scheduler': {file} does not build a {config['_class_name']}: "
                         f"{' '.join(str(exc).split())[:200]}") from None
