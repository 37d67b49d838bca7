"""Run a command stopped at a checkpoint of its builds (core.atomic.checkpoint_hooks), for the fault tests:

    python tests/paused.py clip.onnx:building scripts/build_engines.py ARGS...

The points: an artifact's `building` and `done` (core.artifacts), and `linked` for each file
core.atomic.write_new_set links into place. At `<artifact file name>:<point>` it says "[test] paused at ..." on
stderr and waits for a line on stdin; the test kills it there, or starts a rival process and then lets it go on.
"""

import runpy
import sys
from pathlib import Path


def main(target: str, script: str, *arguments: str) -> None:
    from core import atomic

    def pause(artifact: Path, point: str) -> None:
        if f"{artifact.name}:{point}" == target:
            print(f"[test] paused at {target}", file=sys.stderr, flush=True)
            sys.stdin.readline()

    atomic.checkpoint_hooks.append(pause)
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    main(*sys.argv[1:])
