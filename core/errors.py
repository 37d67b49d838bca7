"""Errors the commands print as one line: what the user can fix in the command line (exit 2), and what the run
could not do (exit 1).

A message may name the field it is about with `field("denoising_steps")`: each face shows that field by its own name
for it (the CLI its flag, --denoising-steps; sd-serve its input, steps; the Python API the field itself)."""

from __future__ import annotations

import math
import re
from typing import Callable

_FIELD = "\x1f"  # around a field's name inside a message; no message text has it otherwise


def field(name: str) -> str:
    """`name`, a request's or pipeline spec's field, as a message names it (UsageError.render)."""
    return f"{_FIELD}{name}{_FIELD}"


def render_fields(text: str, name: Callable[[str], str] = str) -> str:
    """`text` with each field it names (field()) shown as `name(field)` says."""
    return re.sub(f"{_FIELD}(\\w+){_FIELD}", lambda found: name(found.group(1)), text)


class ToolkitError(Exception):
    """An error the commands print as one line, `<prog>: <heading>: <message>`, whose message may name fields."""

    heading = "error"

    def render(self, name: Callable[[str], str] = str) -> str:
        """The message with each field it names as `name(field)` says."""
        return render_fields(str(self.args[0]) if self.args else "", name)

    def __str__(self) -> str:
        return self.render()


class UsageError(ToolkitError):
    """A bad flag, file, model or request: exit status 2."""


class RunFailure(ToolkitError):
    """The run could not finish (the disk filled up, the device ran out of memory, an engine that does not fit): exit
    status 1."""


def at_least(name: str, value: int | float, low: int | float) -> None:
    """A UsageError about the field `name` unless `value` >= `low`."""
    if value < low:
        raise UsageError(f"{field(name)} must be {'0 or more' if low == 0 else f'at least {low}'}, got {value}")


def is_finite_number(value) -> bool:
    """An int or float (not a bool, which Python counts as an int), neither infinite nor NaN: what a number read from
    JSON or safetensors metadata must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
