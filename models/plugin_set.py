"""Which plugins the ONNX passes put into the graphs: `--plugins none|all|auto|<comma list>`.

`auto` means the plugins the ablation measured faster on this GPU's compute capability, from the
table it writes into the repository (results/plugins_auto.json:
{"<major>.<minor>": {"plugins": [...], "gpu": "...", "date": "...", "source": "..."}}); where the
table has no entry, or there is no GPU, it means none.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import UsageError

PLUGIN_KEYS = ("fMHA", "fMHCA", "GroupNorm", "LayerNorm", "SplitGeLU", "Seq2Spatial")
AUTO_TABLE = Path(__file__).resolve().parent.parent / "results" / "plugins_auto.json"
PLUGINS_HELP = (f"our CUDA plugins the ONNX passes put into the engines: none, all, a comma list of "
                f"{','.join(PLUGIN_KEYS)}, or auto: those measured faster on this GPU ({AUTO_TABLE.parent.name}/"
                f"{AUTO_TABLE.name}; none where it has no entry) (default: auto)")


def parse_plugin_set(text: str, compute_capability: str | None = None, table: Path = AUTO_TABLE) -> tuple[str, ...]:
    """A --plugins value as a sorted tuple of plugin keys; `compute_capability` ("9.0") resolves
    `auto` for a GPU other than this machine's."""
    if text == "none":
        return ()
    if text == "all":
        return tuple(sorted(PLUGIN_KEYS))
    if text == "auto":
        capability = compute_capability or local_compute_capability()
        entry = auto_plugin_entry(capability, table) if capability else None
        return tuple(sorted(entry["plugins"])) if entry else ()
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in PLUGIN_KEYS]
    if unknown or not names:
        raise UsageError(f"unknown plugin(s) {', '.join(unknown) or '(none)'} in --plugins '{text}'; use none, all, "
                         f"auto or a comma list of {', '.join(PLUGIN_KEYS)}")
    return tuple(sorted(set(names)))


def local_compute_capability() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def measured_entry(table: Path, compute_capability: str):
    """The entry for a compute capability ("9.0") in a table of measured choices (JSON keyed by compute
    capability), or None when it has none (or there is no table)."""
    try:
        entries = json.loads(table.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise UsageError(f"{table} is not valid JSON: {exc}") from exc
    return entries.get(compute_capability) if isinstance(entries, dict) else None


def auto_plugin_entry(compute_capability: str, table: Path = AUTO_TABLE) -> dict | None:
    """The table's entry for a compute capability, or None when it has none (or there is no table)."""
    entry = measured_entry(table, compute_capability)
    if entry is None:
        return None
    plugins = entry.get("plugins") if isinstance(entry, dict) else None
    if not isinstance(plugins, list) or any(name not in PLUGIN_KEYS for name in plugins):
        raise UsageError(f"{table}: entry '{compute_capability}' needs \"plugins\": a list of {', '.join(PLUGIN_KEYS)}")
    return entry
