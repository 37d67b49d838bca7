"""How TensorRT names a refittable engine's weights, against the provenance of the optimized ONNX it was built from:
every LoRA-targetable initializer must be refittable by its name. On a GPU, e.g. the H200 box with TensorRT 8.6:

    python scripts/refit_names.py engine/unet.engine onnx/unet.opt.onnx --plugin-convention sdplugins --dry-refit

Exit status 0 when they all are (and, with --dry-refit, a refit with the ONNX's own values succeeds), else 1.
See demo/refit.py (refit_names).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from demo.refit import refit_names_main

    sys.exit(refit_names_main())
