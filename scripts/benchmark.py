"""Benchmark every contender on one GPU: see bench/benchmark.py (console command sd-benchmark)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import sd_benchmark

    sys.exit(sd_benchmark())
