"""Running a command: every way it can end is one line and an exit status (usage errors 2, run failures 1, SIGINT and
SIGTERM 130 and 143), and the fields a message names are shown as the command's flags."""

from __future__ import annotations

import sys
from typing import Callable, Mapping

from core.errors import RunFailure, UsageError
from core.interrupts import Interrupted, stop_on_signals

# The fields whose flag is not --<field> (the request's images, the spec's LoRA files and ControlNets).
FLAG_NAMES = {"image": "--input-image", "mask": "--mask-image", "loras": "--lora", "prompt": "PROMPT",
              "controlnets": "--controlnet", "control_images": "--control-image"}


def flag_name(field: str, names: Mapping[str, str] = FLAG_NAMES) -> str:
    """The flag that sets `field`, as a message names it."""
    return names.get(field) or FLAG_NAMES.get(field) or "--" + field.replace("_", "-")


def run_command(prog: str, body: Callable[[], int], names: Mapping[str, str] = FLAG_NAMES) -> int:
    """Run a command-line entry point: usage errors exit 2; run failures (an engine build, an artifact missing where
    nothing may build it, a full disk, memory) 1; SIGINT / SIGTERM stop it at the next safe point with 130 / 143;
    each one line, fields named by `names` (else FLAG_NAMES, else --<field>)."""
    try:
        with stop_on_signals():
            return body()
    except (Interrupted, KeyboardInterrupt) as exc:
        print(f"{prog}: interrupted", file=sys.stderr)
        return exc.exit_status if isinstance(exc, Interrupted) else 130
    except (UsageError, RunFailure) as exc:
        print(f"{prog}: {exc.heading}: {exc.render(lambda field: flag_name(field, names))}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        what = (str(exc).strip().splitlines() or ["no detail"])[0][:200]
        print(f"{prog}: error: out of memory ({what}); try a smaller --batch-size, --height or --width",
              file=sys.stderr)
        return 1


def out_of_memory(exc: BaseException) -> bool:
    """The host's memory, or the device's (torch's error, where torch is loaded at all)."""
    torch = sys.modules.get("torch")
    return isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError))
