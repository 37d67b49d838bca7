"""Train the built-in `scenes` model on one GPU.

See models/scenes/train.py: python scripts/train_scenes.py --output DIR
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from models.scenes.train import main

    sys.exit(main())
