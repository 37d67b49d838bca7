"""Where the UNet's GPU time goes, kernel family by family: see bench/profile_unet.py."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import profile_unet

    sys.exit(profile_unet())
