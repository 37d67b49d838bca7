"""Our CUDA plugins: kernels in plugins/src, C ABI in plugins/include/sdplugins.h, PyTorch ops in
plugins.torch_ops, TensorRT plugins in plugins.trt_plugins; the contract they all follow in
plugins.contract, and the defaults measured per GPU in plugins.tuned.

`plugins.status()` says whether the PyTorch ops can run here and, if not, why; importing never fails.
Importing this package (or plugins.contract, plugins.tuned) does not import torch.
"""


def status() -> str:
    """'available', or why the plugins cannot run here (plugins.torch_ops.status)."""
    from plugins.torch_ops import status as torch_ops_status

    return torch_ops_status()


def available() -> bool:
    from plugins.torch_ops import available as torch_ops_available

    return torch_ops_available()
