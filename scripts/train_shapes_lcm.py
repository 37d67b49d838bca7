"""Distil `shapes-lcm`, the LCM-LoRA of the built-in `shapes` model (4 steps, no guidance), on one GPU.

See models/shapes/train_lcm.py: python scripts/train_shapes_lcm.py --output DIR/lcm.safetensors
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from models.shapes.train_lcm import main

    sys.exit(main())
