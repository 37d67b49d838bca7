"""Tuned defaults: what was measured fastest on a GPU of each compute capability, shipped with the package.

One data file, plugins/tuned_defaults.json (TUNED_DEFAULTS_FILE), with two sections:

- PLUGINS_AUTO ("plugins_auto"): the plugins `--plugins auto` puts into TensorRT engines, written by the
  ablation: {"<major>.<minor>": {"plugins": [...], "gpu": "...", "date": "...", "source": "..."}};
- TORCH_DEFAULTS ("torch_defaults"): the torch backend's settings where their flags are unset, written
  by the benchmark: {"<major>.<minor>": {"plugins": [...], "channels_last": bool, "cuda_graph": bool,
  "compile": "...", "gpu": "...", "date": "...", "source": "..."}}.

A model family may be measured apart (models.families Family.tuned_key: SDXL's UNet apart from SD 1.x/2.x's): its
entries are keyed "<major>.<minor>/<family>" (entry_key, "9.0/sdxl"), and its models take the compute capability's
plain entry where the file has none of their own (find_entry).

Read and written only through `read_entry`, `find_entry` and `write_entry`. Imports nothing heavy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from core.atomic import atomic_write_bytes
from core.errors import UsageError
from plugins.contract import PLUGIN_KEYS

TUNED_DEFAULTS_FILE = Path(__file__).resolve().parent / "tuned_defaults.json"
PLUGINS_AUTO = "plugins_auto"
TORCH_DEFAULTS = "torch_defaults"
SECTIONS = (PLUGINS_AUTO, TORCH_DEFAULTS)

_PLUGINS_FIELD = f"\"plugins\" (a list of {', '.join(PLUGIN_KEYS)})"
# What each section's entries need beyond their free-form notes (gpu, date, source, ...).
_REQUIRES = {
    PLUGINS_AUTO: _PLUGINS_FIELD,
    TORCH_DEFAULTS: f"{_PLUGINS_FIELD}, \"channels_last\" and \"cuda_graph\" (true/false) and \"compile\" "
                    "(a torch.compile mode)",
}


def _check_section(section: str) -> None:
    if section not in SECTIONS:
        raise ValueError(f"unknown tuned-defaults section {section!r}; one of {', '.join(SECTIONS)}")


def _well_formed(section: str, entry) -> bool:
    if not (isinstance(entry, dict) and isinstance(entry.get("plugins"), list)
            and all(name in PLUGIN_KEYS for name in entry["plugins"])):
        return False
    if section == TORCH_DEFAULTS:
        return (isinstance(entry.get("channels_last"), bool) and isinstance(entry.get("cuda_graph"), bool)
                and isinstance(entry.get("compile"), str))
    return True


def _load(path: Path) -> dict:
    """The file's sections ({} where there is no file); UsageError naming the file where it is broken."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or set(data) - set(SECTIONS) or any(not isinstance(v, dict) for v in data.values()):
        raise UsageError(f"{path}: expected a JSON object of sections ({', '.join(SECTIONS)}), each an object "
                         "keyed by compute capability")
    return data


def read_entry(section: str, compute_capability: str, path: Path = TUNED_DEFAULTS_FILE) -> dict | None:
    """The section's entry for a compute capability ("9.0"), checked; None where it has none (or there is
    no file). A file that is not valid JSON, or an entry of the wrong shape, is a UsageError naming the file."""
    _check_section(section)
    entry = _load(Path(path)).get(section, {}).get(compute_capability)
    if entry is None:
        return None
    if not _well_formed(section, entry):
        raise UsageError(f"{path}: \"{section}\" entry '{compute_capability}' needs {_REQUIRES[section]}")
    return entry


def entry_key(compute_capability: str, family: str | None = None) -> str:
    """The key of the entry measured on a compute capability ("9.0") for a family's models (its tuned key; None: the
    plain entry's)."""
    return f"{compute_capability}/{family}" if family else compute_capability


def find_entry(section: str, compute_capability: str, family: str | None = None,
               path: Path = TUNED_DEFAULTS_FILE) -> tuple[str, dict] | None:
    """The entry a model takes on a compute capability, with its key: its family's own where there is one, else the
    compute capability's; None where neither exists."""
    for key in dict.fromkeys((entry_key(compute_capability, family), compute_capability)):
        entry = read_entry(section, key, path)
        if entry is not None:
            return key, entry
    return None


def write_entry(section: str, key: str, entry: dict, path: Path = TUNED_DEFAULTS_FILE) -> None:
    """Set the section's entry under `key` (entry_key: "9.0", "9.0/sdxl"), keeping the other section and entries;
    the file is replaced atomically (a reader sees the old file or the new one, never half of one)."""
    _check_section(section)
    if not re.fullmatch(r"\d+\.\d+(?:/[a-z0-9.-]+)?", key):
        raise ValueError(f"entry key {key!r} is not <major>.<minor> or <major>.<minor>/<family>")
    if not _well_formed(section, entry):
        raise ValueError(f"a \"{section}\" entry needs {_REQUIRES[section]}, got {entry!r}")
    path = Path(path)
    data = _load(path)
    data.setdefault(section, {})[key] = entry
    atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode())
