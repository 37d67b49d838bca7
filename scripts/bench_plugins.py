"""Every plugin op against the best PyTorch path on the same inputs (needs a GPU): see bench/kernels.py."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import bench_plugins

    sys.exit(bench_plugins())
