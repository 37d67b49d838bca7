"""Load-test sd-serve at one address: throughput, latency percentiles, errors, batch sizes; JSON and a chart.

See bench/loadtest.py and docs/serving.md.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from bench.loadtest import main

    sys.exit(main())
