"""demo_diffusion: text-to-image with a per-stage latency report; see demo/cli/generate.py (console command
demo-diffusion).

    python demo/demo_diffusion.py "a photo of an astronaut riding a horse" --model tiny
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, not demo/, when not installed
    from demo.cli.entry import demo_diffusion

    sys.exit(demo_diffusion())
