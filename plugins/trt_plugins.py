"""Our TensorRT plugin library (plugins/trt, built as libsdplugins_trt.so) in TensorRT's plugin registry.

`load_plugin_library(trt)` loads it into the registry of the given `tensorrt` module, so that TensorRT's
ONNX parser maps the SDP* nodes of the plugin-node contract (plugins.contract: PLUGIN_NAMES, version
PLUGIN_VERSION, namespace PLUGIN_NAMESPACE) to our creators; call it before parsing.
`status()` says whether the library is built and, if not, why; importing never fails.
(`SDPLUGINS_TRT_LIBRARY` points at another build.)
"""

from __future__ import annotations

import os
from pathlib import Path

from core.errors import UsageError
from plugins.contract import PLUGIN_NAMES, PLUGIN_NAMESPACE, PLUGIN_VERSION, TRT_LIBRARY_ENV, TRT_LIBRARY_FILE

ROOT = Path(__file__).resolve().parent.parent
BUILD_COMMAND = "cmake -S . -B build -DTENSORRT_INCLUDE_DIR=<dir with NvInfer.h> && cmake --build build -j"


def library_path() -> Path:
    return Path(os.environ.get(TRT_LIBRARY_ENV, ROOT / "build" / TRT_LIBRARY_FILE))


def status() -> str:
    """'built', or why the TensorRT plugin library cannot be loaded."""
    path = library_path()
    if not path.is_file():
        return f"TensorRT plugin library not built: {path} is missing (build it with: {BUILD_COMMAND})"
    return "built"


def _registered(registry) -> set[str]:
    """Names of our creators (our namespace and version) in the registry."""
    # TensorRT 10+ lists every creator in all_creators; 8.6 has only plugin_creator_list.
    creators = registry.all_creators if hasattr(registry, "all_creators") else registry.plugin_creator_list
    return {c.name for c in creators if c.plugin_namespace == PLUGIN_NAMESPACE and c.plugin_version == PLUGIN_VERSION}


def load_plugin_library(trt) -> Path:
    """Loads libsdplugins_trt.so into `trt`'s plugin registry (once per process) and returns its path.

    Raises UsageError when it is not built, TensorRT refuses it, or our six creators are then missing."""
    reason = status()
    if reason != "built":
        raise UsageError(reason)
    path = library_path()
    registry = trt.get_plugin_registry()
    # TensorRT refuses a library whose creators it already holds: load only where none of ours is there.
    if not _registered(registry) and registry.load_library(str(path)) is None:
        raise UsageError(f"TensorRT {trt.__version__} could not load the plugin library {path} (its log says why)")
    missing = sorted(set(PLUGIN_NAMES) - _registered(registry))
    if missing:
        raise UsageError(f"TensorRT {trt.__version__}'s plugin registry lacks {', '.join(missing)} "
                         f"(version {PLUGIN_VERSION}, namespace '{PLUGIN_NAMESPACE}') after loading {path}")
    return path
