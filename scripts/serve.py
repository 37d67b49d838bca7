"""Serve text-to-image through Triton Inference Server (PyTriton): one pipeline per GPU, dynamic batching.

See demo/cli/serve.py (console command sd-serve), demo/serve/ and docs/serving.md.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from demo.cli.entry import sd_serve

    sys.exit(sd_serve())
