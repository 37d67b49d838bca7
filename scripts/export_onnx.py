"""Export and optimize a model's stages to ONNX through the artifact cache.

See demo/cli/export_onnx.py (console command export-onnx).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from demo.cli.entry import export_onnx

    sys.exit(export_onnx())
