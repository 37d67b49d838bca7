"""Build TensorRT engines: export -> optimize -> build, for all stages or a chosen subset.

See demo/cli/build_engines.py (console command build-engines).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from demo.cli.entry import build_engines

    sys.exit(build_engines())
