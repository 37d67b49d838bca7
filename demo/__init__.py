"""Stable Diffusion on TensorRT and PyTorch, with our own CUDA plugins.

The Python API:

    from demo import PipelineSpec, load_pipeline

    with load_pipeline(PipelineSpec(model="tiny")) as pipe:
        result = pipe("a red circle", seed=0)
    result.images[0].save("circle.png"); print(result.report.table())

PipelineSpec (demo.runtime.spec) says what to load, load_pipeline (demo.runtime.loader) loads it; a call takes a
prompt and the fields of demo.request.Request. The package's parts, in the order they build on each other: request
(the one request model and its checks), pipelines (one module per family), backends (torch, tensorrt), runtime (spec,
loader, loaded pipeline, report), and the faces on them: cli, serve, and this API.
"""

from __future__ import annotations

import importlib

# name -> the module defining it: imported on first use, so that `import demo` (every command's first step) stays
# light, and --help answers before torch is imported.
_API = {"PipelineSpec": "demo.runtime.spec", "StageOverride": "demo.runtime.spec",
        "load_pipeline": "demo.runtime.loader", "plan_pipeline": "demo.runtime.loader",
        "Pipeline": "demo.runtime.loaded", "Result": "demo.runtime.loaded", "Request": "demo.request",
        "EngineOptions": "demo.backends.tensorrt.options", "TorchOptions": "demo.backends.torch.options"}
__all__ = list(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'demo' has no attribute '{name}'")
    return getattr(importlib.import_module(_API[name]), name)
