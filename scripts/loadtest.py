"""Load-test sd-serve at one address: throughput, latency percentiles, errors, batch sizes; JSON and a chart, in
loadtest/ of the current directory unless --results-dir names another folder.

See bench/loadtest.py and docs/serving.md.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from bench.entry import loadtest

    sys.exit(loadtest())
