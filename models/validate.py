"""A model folder checked before anything heavy loads from it: every component's config parses and names a
class this toolkit can load, the scheduler config builds with a prediction type diffusers' schedulers know, and
every weight file is whole (safetensors: header and size; PyTorch pickles: a readable zip). What fails is one
UsageError naming the component and the file, not a traceback from deep inside diffusers minutes later."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from core.errors import UsageError
from models.families import family_of

# component -> (the config file in its folder, the key naming its class, where that class lives)
COMPONENTS = {
    "text_encoder": ("config.json", "architectures", "transformers"),
    "tokenizer": ("tokenizer_config.json", "tokenizer_class", "transformers"),
    "text_encoder_2": ("config.json", "architectures", "transformers"),
    "tokenizer_2": ("tokenizer_config.json", "tokenizer_class", "transformers"),
    "unet": ("config.json", "_class_name", "diffusers"),
    "vae": ("config.json", "_class_name", "diffusers"),
    "scheduler": ("scheduler_config.json", "_class_name", "diffusers"),
}
WEIGHTED = ("text_encoder", "text_encoder_2", "unet", "vae")


WEIGHT_SUFFIXES = (".safetensors", ".bin")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


def read_config(path: Path, component: str) -> dict:
    """A component's config as a dict, or a UsageError naming the file and what is wrong with it."""
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise UsageError(f"component '{component}': {path} is missing") from None
    except OSError as exc:
        raise UsageError(f"component '{component}': cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"component '{component}': {path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"component '{component}': {path} holds a {type(config).__name__}, not a JSON object")
    return config


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
    for component in family.model_components(index):
        file_name = COMPONENTS[component][0]
        if not (path / component / file_name).exists():
            raise UsageError(f"model '{name}' is missing component '{component}' (no {component}/{file_name} in "
                             f"{path})")
        config = validate_component(path / component, component, index.get(component, [None, None])[1:])
        if component == "scheduler":
            _check_scheduler(config, path / component / file_name)


def validate_component(folder: Path, component: str, index_class: list | None = None) -> dict:
    """One component's folder: its config parses and names a class its library has (else the one model_index.json
    names, `index_class`), and its weights are whole. Returns the config."""
    import diffusers
    import transformers

    file_name, key, library = COMPONENTS[component]
    module = {"diffusers": diffusers, "transformers": transformers}[library]
    file = folder / file_name
    config = read_config(file, component)
    class_name = _class_name(config, key) or _class_name({key: index_class or []}, key)
    if class_name is None or not hasattr(module, class_name):
        raise UsageError(f"component '{component}': {file} names class {class_name!r} ({key}), which "
                         f"{library} {module.__version__} does not have")
    if component in WEIGHTED:
        weights = [p for p in sorted(folder.iterdir()) if p.suffix in WEIGHT_SUFFIXES]
        if not weights:
            raise UsageError(f"component '{component}': no weights ({' or '.join(WEIGHT_SUFFIXES)}) in {folder}")
        for weight in weights:
            reason = check_weight_file(weight)
            if reason:
                raise UsageError(f"component '{component}': {weight} is damaged: {reason}")
    return config


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
