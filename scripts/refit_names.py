"""How TensorRT names a refittable engine's weights: see demo/cli/refit_names.py.

    python scripts/refit_names.py engine/unet.engine onnx/unet.opt.onnx --plugin-convention sdplugins --dry-refit
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from demo.cli.entry import refit_names

    sys.exit(refit_names())
