"""Train the built-in `shapes` model and its outline LoRA on one GPU.

See models/shapes/train.py: python scripts/train_shapes.py --output DIR
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from models.shapes.train import main

    sys.exit(main())
