"""Which plugins the ONNX passes put into the graphs: `--plugins none|all|auto|<comma list>`.

`auto` means the plugins the ablation measured faster on this GPU's compute capability, from the
"plugins_auto" section of the tuned defaults (plugins/tuned_defaults.json, read through plugins.tuned:
{"<major>.<minor>": {"plugins": [...], "gpu": "...", "date": "...", "source": "..."}}); where it has no
entry, or there is no GPU, it means none.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import UsageError, field
from plugins.contract import PLUGIN_KEYS
from plugins.tuned import PLUGINS_AUTO, TUNED_DEFAULTS_FILE, find_entry

PLUGINS_HELP = (f"our CUDA plugins the ONNX passes put into the engines: none, all, a comma list of "
                f"{','.join(PLUGIN_KEYS)}, or auto: those measured faster on this GPU "
                f"({TUNED_DEFAULTS_FILE.parent.name}/{TUNED_DEFAULTS_FILE.name}, section \"{PLUGINS_AUTO}\"; "
                "none where it has no entry) (default: auto)")


def parse_plugin_set(text: str, compute_capability: str | None = None,
                     table: Path = TUNED_DEFAULTS_FILE, family: str | None = None) -> tuple[str, ...]:
    """A --plugins value as a sorted tuple of plugin keys; `compute_capability` ("9.0") resolves
    `auto` for a GPU other than this machine's; `table` is the tuned-defaults file `auto` reads, for an SDXL
    family's models (its tuned key, plugins.tuned.entry_key)."""
    if text == "none":
        return ()
    if text == "all":
        return tuple(sorted(PLUGIN_KEYS))
    if text == "auto":
        capability = compute_capability or local_compute_capability()
        found = find_entry(PLUGINS_AUTO, capability, family, table) if capability else None
        return tuple(sorted(found[1]["plugins"])) if found else ()
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in PLUGIN_KEYS]
    if unknown or not names:
        raise UsageError(f"unknown plugin(s) {', '.join(unknown) or '(none)'} in {field('plugins')} '{text}'; use "
                         f"none, all, auto or a comma list of {', '.join(PLUGIN_KEYS)}")
    return tuple(sorted(set(names)))


def local_compute_capability() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"
