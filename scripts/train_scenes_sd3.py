"""Train the built-in `scenes-sd3` model (SD3's family on the scenes world) on one GPU.

See models/scenes_sd3/train.py: python scripts/train_scenes_sd3.py --output DIR
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from models.scenes_sd3.train import main

    sys.exit(main())
