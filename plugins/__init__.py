"""Our CUDA plugins: kernels in plugins/src, C ABI in plugins/include/sdplugins.h, PyTorch ops here.

`plugins.status()` says whether they can run here and, if not, why; importing never fails.
"""

from plugins.torch_ops import available, status  # noqa: F401
