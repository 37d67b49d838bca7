"""Plugin ablation on one GPU: see bench/ablation.py (console command sd-ablation)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import sd_ablation

    sys.exit(sd_ablation())
