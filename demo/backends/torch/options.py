"""The torch backend's own options (a pipeline spec's `torch`); light to import: a command parses its flags into them
before torch loads."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from core.errors import UsageError, field
from core.typed import check_field_types
from demo.backends import AUTO
from models.families import DEFAULT_FP8_SCALES, FP8, FP8_SCALES

COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
# torch.compile modes that capture CUDA graphs of their own (cudagraph trees).
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class TorchOptions:
    """The torch backend's own options (a pipeline spec's `torch`); None / "auto": the tuned defaults."""

    channels_last: bool | None = None
    compile: str = AUTO  # or one of COMPILE_MODES
    fp8_scales: str = AUTO  # precision fp8's (FP8_SCALES); auto: DEFAULT_FP8_SCALES

    def __post_init__(self):
        check_field_types(self)

    def check(self) -> None:
        """The options' own values: a UsageError naming the field."""
        if self.compile != AUTO and self.compile not in COMPILE_MODES:
            raise UsageError(f"unknown {field('compile')} mode '{self.compile}'; choose auto or one of "
                             f"{', '.join(COMPILE_MODES)}")
        if self.fp8_scales != AUTO and self.fp8_scales not in FP8_SCALES:
            raise UsageError(f"{field('fp8_scales')} must be auto or one of {', '.join(FP8_SCALES)}, got "
                             f"'{self.fp8_scales}'")

    def check_precision(self, precision: str) -> None:
        """A UsageError where the options ask for what `precision` (a spec's) does not run."""
        if self.fp8_scales != AUTO and precision != FP8:
            raise UsageError(f"{field('fp8_scales')} {self.fp8_scales} scales precision {FP8}'s operands; this "
                             f"spec's precision is {precision}")

    @property
    def fp8_scaling(self) -> str:
        """How precision fp8 scales its operands: fp8_scales, resolved."""
        return DEFAULT_FP8_SCALES if self.fp8_scales == AUTO else self.fp8_scales


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
    fp8_scales: str = DEFAULT_FP8_SCALES  # with fp8: how its operands are scaled (FP8_SCALES)

    def describe(self) -> str:
        parts = [f"plugins {','.join(self.plugins)}" if self.plugins else "no plugins"]
        parts += [name for name, on in (("channels-last", self.channels_last), ("CUDA graphs", self.cuda_graph)) if on]
        parts.append(f"compile {self.compile}" if self.compile != "none" else "eager")
        parts += [f"FP8 UNet ({self.fp8_scales} scales)"] if self.fp8 is not None else []
        return ", ".join(parts)

    def as_dict(self) -> dict:
        # a calibration is no setting; the scales are one where there is FP8
        fields = {name: value for name, value in asdict(self).items() if name not in ("fp8", "fp8_scales")}
        fp8 = {"fp8": True, "fp8_scales": self.fp8_scales} if self.fp8 is not None else {}
        return {**fields, "plugins": list(self.plugins), **fp8}
