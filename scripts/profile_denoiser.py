"""Where the denoiser's GPU time goes (a UNet's or a transformer's), kernel by kernel: see bench/profile_denoiser.py."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import profile_denoiser

    sys.exit(profile_denoiser())
