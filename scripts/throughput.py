"""Offline images per second by batch size: see bench/throughput.py (console command sd-throughput)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import sd_throughput

    sys.exit(sd_throughput())
