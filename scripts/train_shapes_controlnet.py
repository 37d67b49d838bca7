"""Train `shapes-controlnet` on the shipped `shapes` model, on the CPU.

See models/shapes/train_controlnet.py: python scripts/train_shapes_controlnet.py --output DIR
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from models.shapes.train_controlnet import main

    sys.exit(main())
