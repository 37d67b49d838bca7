"""One launch each of the SD attention kernels, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:attention --section SpeedOfLight \
        --section WarpStateStats --section Occupancy python scripts/profile_attention.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from plugins import torch_ops as ops  # noqa: E402

for batch, seq, heads, head_dim in ((2, 4096, 8, 40), (2, 4096, 5, 64)):
    qkv = torch.randn(batch, seq, heads, 3, head_dim, device="cuda").half()
    ops.fmha(qkv, head_dim**-0.5)
torch.cuda.synchronize()
