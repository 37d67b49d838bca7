"""sd-loadgen: MLPerf's LoadGen drives sd-serve's txt2img model in the Offline or Server scenario, starting sd-serve
with the flags it does not take itself, or against --url; LoadGen's logs and a summary in loadgen/ unless
--results-dir names another folder.

See bench/loadgen.py and docs/serving.md ("MLPerf's LoadGen").
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the checkout's root, when not installed
    from bench.entry import sd_loadgen

    sys.exit(sd_loadgen())
