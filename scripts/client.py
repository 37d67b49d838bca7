"""Ask sd-serve for an image (tritonclient, HTTP or gRPC) and write it as a PNG.

See demo/cli/client.py and docs/serving.md.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from demo.cli.entry import client

    sys.exit(client())
