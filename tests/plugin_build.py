"""The CUDA plugin library built with cmake from this checkout, its build log (ptxas's register and spill report
included) beside it: a background job (tests/background.py) for test_plugins_cpu's built_library.

    python -m tests.plugin_build DIRECTORY
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def build(directory: Path) -> None:
    log = []
    for cmd in (["cmake", "-S", str(ROOT), "-B", str(directory)], ["cmake", "--build", str(directory), "-j", "2"]):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        log.append(result.stdout + result.stderr)
        if result.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    (directory / "build.log").write_text("\n".join(log))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
