"""The torch backend's own options (a pipeline spec's `torch`); light to import: a command parses its flags into them
before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UsageError, field
from demo.backends import AUTO

COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
# torch.compile modes that capture CUDA graphs of their own (cudagraph trees).
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class TorchOptions:
    """The torch backend's own options (a pipeline spec's `torch`); None / "auto": the tuned defaults."""

    channels_last: bool | None = None
    compile: str = AUTO  # or one of COMPILE_MODES

    def check(self) -> None:
        """The options' own values: a UsageError naming the field."""
        if self.compile != AUTO and self.compile not in COMPILE_MODES:
            raise UsageError(f"unknown {field('compile')} mode '{self.compile}'; choose auto or one of "
                             f"{', '.join(COMPILE_MODES)}")
