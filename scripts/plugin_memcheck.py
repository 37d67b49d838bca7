"""Run every plugin kernel once on small, odd shapes; meant for `compute-sanitizer --tool memcheck`.

    compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/plugin_memcheck.py

Attention runs on each path this GPU has (plugins.contract.ATTENTION_PATH_ENV): the mma.sync kernels
everywhere, and on compute capability 9.0 the wgmma/TMA kernels too, every instantiation and scheduling mode.
"""

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Needs a CUDA GPU and our plugin library.").parse_args(argv)
    import torch

    from plugins import torch_ops as ops
    from plugins.contract import ATTENTION_PATH_ENV

    def randn(*shape):
        return torch.randn(*shape, device="cuda").half()

    if not ops.available():
        print(f"plugins unavailable: {ops.status()}")
        return 1
    paths = ["mma"] + (["wgmma"] if torch.cuda.get_device_capability() == (9, 0) else [])
    for path in paths:
        os.environ[ATTENTION_PATH_ENV] = path
        print(f"attention path: {path}")
        for d in (40, 64, 80, 160, 8, 48, 72, 128, 176, 256):  # every instantiation of both paths
            ops.fmha(randn(2, 77, 2, 3, d), 0.1)  # one K/V tile
            ops.fmha(randn(1, 300, 2, 3, d), 0.1)  # K/V streamed, ragged last tile
            ops.fmhca(randn(1, 65, 2, d), randn(1, 77, 2, 2, d), 0.1)
            ops.fmhca(randn(1, 130, 3, d), randn(1, 300, 3, 2, d), 0.1)
        for d in (40, 64, 80, 24):  # mma: the short-KV kernels take over from 65536 query rows
            ops.fmhca(randn(1, 8195, 8, d), randn(1, 77, 8, 2, d), 0.1)
        # wgmma: more work items than multiprocessors (persistent blocks, several items each): K/V kept
        # across items of a head, and K/V streamed across items
        ops.fmhca(randn(3, 4097, 7, 40), randn(3, 77, 7, 2, 40), 0.1)
        ops.fmha(randn(2, 1100, 8, 3, 64), 0.1)
    del os.environ[ATTENTION_PATH_ENV]
    for b, c, h, w, g in ((2, 320, 8, 8, 32), (1, 30, 5, 5, 3), (2, 960, 4, 4, 32)):
        for channels_last in (False, True):
            x = randn(b, h, w, c) if channels_last else randn(b, c, h, w)
            ops.group_norm(x, randn(c), randn(c), g, 1e-5, True, channels_last)
    for rows, n in ((5, 320), (3, 100), (2, 3000)):
        ops.layer_norm(randn(rows, n), randn(n), randn(n), 1e-5)
    for n in (1280, 13):
        ops.split_gelu(randn(3, 2 * n), randn(2 * n))
        ops.split_gelu(randn(3, 2 * n), None)
    for b, c, h, w in ((2, 320, 8, 8), (1, 65, 5, 13)):
        ops.seq2spatial(randn(b, h * w, c), randn(c), randn(b, c, h, w))
        ops.seq2spatial(randn(b, h * w, c), randn(c), randn(b, h * w, c), ops.LAYOUT_NHWC, h)
    for shape in ((3, 5, 64), (2, 3, 128), (3, 100), (2, 4104), (1, 3000)):  # register rows and block kernels
        ops.rms_norm(randn(*shape), randn(shape[-1]), 1e-6)
        b, c = (shape[0], shape[-1])
        ops.ada_layer_norm(randn(b, 5, c), randn(b, c), randn(b, c), 1e-6)
        ops.gelu_tanh(randn(*shape), randn(shape[-1]))
        ops.gelu_tanh(randn(*shape), None)
    torch.cuda.synchronize()
    print("memcheck workload done")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    sys.exit(main())
