"""The torch backend's own options (a pipeline spec's `torch`); light to import: a command parses its flags into them
before torch loads."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from core.errors import UsageError, field
from core.typed import check_field_types
from demo.backends import AUTO

COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
# torch.compile modes that capture CUDA graphs of their own (cudagraph trees).
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class TorchOptions:
    """The torch backend's own options (a pipeline spec's `torch`); None / "auto": the tuned defaults."""

    channels_last: bool | None = None
    compile: str = AUTO  # or one of COMPILE_MODES

    def __post_init__(self):
        check_field_types(self)

    def check(self) -> None:
        """The options' own values: a UsageError naming the field."""
        if self.compile != AUTO and self.compile not in COMPILE_MODES:
            raise UsageError(f"unknown {field('compile')} mode '{self.compile}'; choose auto or one of "
                             f"{', '.join(COMPILE_MODES)}")


@dataclass(frozen=True)
class TorchSettings:
    """What the torch backend runs with: its options resolved against the tuned defaults (torch/settings.py)."""

    plugins: tuple[str, ...] = ()  # plugins.contract.PLUGIN_KEYS, sorted
    channels_last: bool = False
    cuda_graph: bool = False
    compile: str = "none"
    # precision fp8: the calibration the UNet's FP8 activation scales come from (models.quantize.Int8Request: what
    # makes it, and `calibrate`, which reads or records it); None: no FP8
    fp8: object = None

    def describe(self) -> str:
        parts = [f"plugins {','.join(self.plugins)}" if self.plugins else "no plugins"]
        parts += [name for name, on in (("channels-last", self.channels_last), ("CUDA graphs", self.cuda_graph)) if on]
        parts.append(f"compile {self.compile}" if self.compile != "none" else "eager")
        parts += ["FP8 UNet"] if self.fp8 is not None else []
        return ", ".join(parts)

    def as_dict(self) -> dict:
        fields = {name: value for name, value in asdict(self).items() if name != "fp8"}  # a calibration is no setting
        return {**fields, "plugins": list(self.plugins), **({"fp8": True} if self.fp8 is not None else {})}
