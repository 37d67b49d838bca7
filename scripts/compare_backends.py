"""Compare a TensorRT backend with the torch backend on one GPU.

See demo/cli/compare_backends.py (console command compare-backends).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from demo.cli.entry import compare_backends

    sys.exit(compare_backends())
