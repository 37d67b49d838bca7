"""One launch of our attention kernel and of PyTorch's SDPA (cuDNN) at each target shape of
bench/kernels.py (B = 2, H = 8), for Nsight Compute:

    ncu --clock-control none --kernel-name regex:"attention|sdpa|flash" --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \\
        python scripts/profile_attention.py
"""

import argparse
import sys
from pathlib import Path

BATCH, HEADS = 2, 8
SELF = ((40, 4096), (80, 1024), (160, 256), (64, 16384))  # (head size, sequence)
CROSS = ((40, 4096, 77),)  # (head size, query sequence, text tokens)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Needs a CUDA GPU and our plugin library.").parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from plugins import torch_ops as ops

    if not ops.available():
        print(f"plugins unavailable: {ops.status()}", file=sys.stderr)
        return 1
    for head_dim, seq in SELF:
        qkv = torch.randn(BATCH, seq, HEADS, 3, head_dim, device="cuda").half()
        ops.fmha(qkv, head_dim**-0.5)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v)
    for head_dim, seq, text in CROSS:
        q = torch.randn(BATCH, seq, HEADS, head_dim, device="cuda").half()
        kv = torch.randn(BATCH, text, HEADS, 2, head_dim, device="cuda").half()
        ops.fmhca(q, kv, head_dim**-0.5)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q.transpose(1, 2), *(t.transpose(1, 2) for t in kv.unbind(3)))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    sys.exit(main())
