"""How well a model draws what its prompts name: see bench/quality.py (console command sd-quality)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import sd_quality

    sys.exit(sd_quality())
