"""What a backend is to the rest of the toolkit: the stage interface the pipelines run, what the stages must be able to
run (Workload), and the Backend object with its capabilities. A pipeline never knows which backend runs its stages;
the runtime asks the backend, never its name."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import torch

from core.errors import UsageError
from models.base import StageModel

if TYPE_CHECKING:
    from demo.request import Request
    from models.families import Family
    from models.lora import LoraFile
    from models.source import ModelSource

Log = Callable[[str], None]


class LoraApplier(abc.ABC):
    """LoRA files applied to a backend's stages, in place of those applied before."""

    @abc.abstractmethod
    def set(self, files: list[tuple[LoraFile, float]]) -> float | None:
        """Apply `files` ((file, scale) each, added up; []: the base weights, bit for bit). Returns how long changing
        built stages took, in ms (None: nothing was rebuilt or refitted)."""


class Stage(abc.ABC):
    """A pipeline stage: named input tensors to named output tensors (its model's names), on some backend."""

    def __init__(self, model: StageModel):
        self.model = model
        self.name = model.name

    def prepare(self, batch: int, height: int, width: int) -> None:
        """Get ready for calls at this stage batch and image size (engines size their buffers here)."""

    @abc.abstractmethod
    def __call__(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the stage on inputs named as in model.input_names; outputs are named as in output_names."""

    def call(self, *inputs: torch.Tensor):
        """The stage's output (a tuple in model.output_names order where it has several) for inputs given in
        model.input_names order."""
        if len(inputs) != len(self.model.input_names):
            raise TypeError(f"{self.name} takes {', '.join(self.model.input_names)}; got {len(inputs)} input(s)")
        outputs = self(dict(zip(self.model.input_names, inputs)))
        values = tuple(outputs[name] for name in self.model.output_names)
        return values if len(values) > 1 else values[0]

    @classmethod
    def lora_applier(cls, stages: list[Stage]) -> LoraApplier:
        """What applies LoRA files to `stages` (stages of this kind whose models LoRA files change)."""
        raise UsageError(f"{cls.__name__} stages take no LoRA files")

    def close(self) -> None:
        """Release what the stage holds (device memory, streams, graphs); idempotent."""


@dataclass(frozen=True)
class Capabilities:
    artifacts: bool  # builds its stages ahead into files cached by what made them (ONNX, engines: build-engines)
    refit: bool  # takes LoRA files by refitting built stages in place (else by fusing them into its modules)
    cuda_graphs: bool  # replays its stages from CUDA graphs
    layer_timings: bool  # times its stages layer by layer (sd-benchmark's profile of the UNet)
    cpu: bool  # runs stages on a CPU


@dataclass(frozen=True)
class Workload:
    """What the stages must run: calls of up to `max_batch_size` images (None: `batch_size`) at `height` x `width`,
    tuned for `batch_size`, under classifier-free guidance or not."""

    batch_size: int
    height: int
    width: int
    guided: bool = True
    max_batch_size: int | None = None


@dataclass(frozen=True)
class Description:
    """What a backend's settings are, as reports list them."""

    plugins: tuple[str, ...]  # our plugins: in the engines, or substituted into the modules
    options: tuple[str, ...]  # e.g. "channels-last", "CUDA graphs", "compile default", "INT8 UNet"


class Backend(abc.ABC):
    """One way of running stages, with what it can do (capabilities), its own options (a frozen dataclass,
    `options_type`), and the settings it derives from them for a model and a workload."""

    name: str
    capabilities: Capabilities
    options_type: type
    # What a model's family must declare (models.families' Family.features) for this backend to run it (None: any
    # family runs on it): TensorRT's, that the family's engines are built (ENGINES).
    family_feature: str | None = None

    @abc.abstractmethod
    def why_cannot_run(self, cc: tuple[int, int] | None) -> str | None:
        """Why stages of this backend cannot run on a GPU of compute capability `cc` (None: no GPU); None: they can."""

    def why_cannot_build(self) -> str | None:
        """Why its stages cannot be built ahead here (its library missing); None: they can, or it builds nothing."""
        return None

    def version(self) -> str | None:
        """The version of the library behind it, for reports (None: torch's own, reported anyway)."""
        return None

    def why_serial(self, settings: Iterable[object]) -> str | None:
        """Why stages of these settings (a plan's, one per stage) cannot run at once on separate CUDA streams
        (demo.pipelines.stream's overlap); None: they can. A backend says they can, and when: serial until it does."""
        return f"{self.name} does not say its stages may run at once"

    def why_no_fp8(self) -> str | None:
        """Why it cannot run a UNet's GEMMs in FP8 (precision fp8); None: it can, where the GPU has FP8."""
        return f"{self.name} has no FP8 path"

    @abc.abstractmethod
    def default_dtype(self, device: torch.device, family: Family) -> torch.dtype:
        """The precision a model of `family` runs in on `device` unless a spec says otherwise."""

    @abc.abstractmethod
    def settings(self, source: ModelSource, options, plugins: str, use_cuda_graph: bool | None, workload: Workload,
                 device: torch.device, dtype: torch.dtype, record_activations=None,
                 fp8: bool = False) -> tuple[object, str]:
        """Checked settings for `options` (an options_type) and the flags both backends take, for the model and the
        workload, and where they came from (a UsageError for what cannot run); `record_activations` calibrates INT8
        where the options ask for it, and the UNet's FP8 layers with `fp8` (precision fp8, on a backend whose
        why_no_fp8 is None)."""

    def prepare(self, models: list[StageModel], settings_of: Callable[[StageModel], object], device: torch.device,
                dtype: torch.dtype, log: Log, progress: Log) -> dict[str, dict]:
        """Build or find each model's artifacts ahead of a run, with what that took per stage ({}: nothing to build)."""
        return {}

    @abc.abstractmethod
    def create_stages(self, models: list[StageModel], settings_of: Callable[[StageModel], object],
                      device: torch.device, dtype: torch.dtype, log: Log, progress: Log) -> dict[str, Stage]:
        """The models' stages, each with its settings (`settings_of(model)`), artifacts built or found first."""

    def check_loras(self, options) -> None:
        """A UsageError where stages made with `options` cannot take LoRA files."""

    def check_request(self, settings, source: ModelSource, request: Request) -> None:
        """A UsageError where stages made with `settings` cannot run a resolved request the model can."""

    @abc.abstractmethod
    def describe(self, settings) -> Description:
        """The settings as reports list them."""

    def stats(self, stages: Mapping[str, Stage], settings_of: Callable[[StageModel], object]) -> dict:
        """What getting `stages` ready took and holds, for benchmark rows ({}: nothing to say)."""
        return {}
