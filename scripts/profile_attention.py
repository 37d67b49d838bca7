"""One launch of our attention kernel and of PyTorch's SDPA (cuDNN) at each target shape of
scripts/bench_plugins.py (B = 2, H = 8), for Nsight Compute:

    ncu --clock-control none --kernel-name regex:"attention|sdpa|flash" --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
        python scripts/profile_attention.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from plugins import torch_ops as ops  # noqa: E402

BATCH, HEADS = 2, 8
SELF = ((40, 4096), (80, 1024), (160, 256), (64, 16384))  # (head size, sequence)
CROSS = ((40, 4096, 77),)  # (head size, query sequence, text tokens)

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
