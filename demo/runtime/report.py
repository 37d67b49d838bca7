"""The latency report of a run: per-stage milliseconds (demo.pipelines.timer.StageTimer measures them) beside what
makes the image again and what ran it, as a table and as JSON."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field

import torch

from demo.backends.base import Backend
from demo.pipelines.sdxl import REFINER_CLIP, REFINER_UNET
from models.families import FP8, FP8_BASE


@dataclass
class LatencyReport:
    model: str
    backend: str
    backend_reason: str
    device: str
    precision: str
    scheduler: str
    steps: int
    unet_calls: int  # the denoiser's calls (a UNet's, SD3's transformer's)
    guidance_scale: float
    seed: int
    batch_size: int
    height: int
    width: int
    latent_shape: list[int]
    latency_ms: dict[str, float]
    plugins: list[str] = field(default_factory=list)  # our plugins: inside the engines, or substituted (torch)
    options: list[str] = field(default_factory=list)  # e.g. channels-last, CUDA graphs, compile <mode>
    options_reason: str = ""  # where the torch backend's settings came from
    # with the negative prompt, seed, scheduler, steps and guidance: what makes the image again (several: one each)
    prompt: str | list[str] = ""
    negative_prompt: str | list[str] | None = None  # None: not given (demo.request.Request)
    input_image: str | None = None  # image-to-image and inpainting: the files given, and the strength
    mask_image: str | None = None
    strength: float | None = None
    # the scheduler options the request set (demo.schedulers.SCHEDULER_OPTIONS: spacing, Karras sigmas, eta,
    # timesteps); those it left out are the model's scheduler config's
    scheduler_options: dict = field(default_factory=dict)
    high_noise_frac: float | None = None  # with an SDXL refiner: the part of the schedule the base denoised
    refiner_unet_calls: int | None = None  # with a refiner: its part of unet_calls (latency_ms splits the same way)
    cache_interval: int = 1  # the step cache: every Nth UNet call ran whole, the others the shallow pass (1: none)
    cache_branch: int | None = None  # its branch (None: no cache)
    cache_threshold: float = 0.0  # the adaptive step cache's threshold (0: none), and its cap on cached calls in a row
    cache_max_skips: int | None = None
    cache_forecast: bool = False  # the adaptive cache's forecast of the kept residual
    cache_whole_calls: int | None = None  # under either cache: how many denoiser calls ran whole, as counted in the run
    loras: list[dict] = field(default_factory=list)  # the LoRA files fused in: path and scale each
    lora_refit_ms: float | None = None  # engines: how long refitting them for the LoRAs took (None: no refit)
    images: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    denoiser: str = "UNet"  # what the table calls the denoiser (its stage's label: SD3's "Transformer")

    @property
    def throughput(self) -> float:
        return self.batch_size / (self.latency_ms["pipeline"] / 1e3)

    def table(self) -> str:
        ms = self.latency_ms
        refiner = {REFINER_CLIP: ms.get(REFINER_CLIP, 0.0), REFINER_UNET: ms.get(REFINER_UNET, 0.0)}
        rows = [("CLIP", ms["clip"] - refiner[REFINER_CLIP])]
        if REFINER_CLIP in ms:
            rows.append(("Refiner CLIP", refiner[REFINER_CLIP]))
        if "vae_encoder" in ms:  # image-to-image and inpainting
            rows.append(("VAE-Enc", ms["vae_encoder"]))
        rows.append((f"{self.denoiser} x {self.unet_calls - (self.refiner_unet_calls or 0)}",
                     ms["unet"] - refiner[REFINER_UNET]))
        if REFINER_UNET in ms:
            rows.append((f"Refiner x {self.refiner_unet_calls}", refiner[REFINER_UNET]))
        rows.append(("VAE-Dec", ms["vae"]))
        width = max(15, *(len(name) for name, _ in rows))  # wider only for a name that needs it
        line = f"|{'-' * (width + 2)}|--------------|"
        out = [line, f"| {'Module':^{width}} |   Latency    |", line]
        out += [f"| {name:^{width}} | {ms:9.2f} ms |" for name, ms in rows]
        out += [line, f"| {'Pipeline':^{width}} | {self.latency_ms['pipeline']:9.2f} ms |", line]
        out.append(f"Throughput: {self.throughput:.2f} image/s")
        ran = " ".join(filter(None, (self.backend, self.versions.get(self.backend))))
        plugins = f", plugins {','.join(self.plugins)}" if self.plugins else ""
        options = "".join(f", {option}" for option in self.options)
        if self.cache_threshold > 0:
            forecast = ", forecast" if self.cache_forecast else ""
            options += (f", adaptive step cache (threshold {self.cache_threshold:g}, at most {self.cache_max_skips} "
                        f"cached in a row{forecast}): {self.cache_whole_calls} of {self.unet_calls} calls whole")
        elif self.cache_branch is not None:
            options += (f", step cache every {self.cache_interval} (branch {self.cache_branch}): "
                        f"{self.cache_whole_calls} of {self.unet_calls} UNet calls whole")
        out.append(f"Backend: {ran} on {self.device}, {self.precision}{plugins}{options}")
        return "\n".join(out)

    def to_json(self) -> str:
        data = asdict(self)
        data["throughput_images_per_s"] = self.throughput
        return json.dumps(data, indent=2)


def library_versions(backend: Backend | None = None) -> dict[str, str]:
    """Versions of what ran, the backend's library among them where it has its own (TensorRT's)."""
    import diffusers
    import transformers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        versions["cuda"] = str(torch.version.cuda)
    if backend is not None and backend.version():
        versions[backend.name] = backend.version()
    return versions


# A spec's precisions (demo.runtime.spec.PRECISIONS but auto) and the dtypes they run in
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def precision_name(dtype: torch.dtype) -> str:
    return next(name for name, known in DTYPES.items() if known == dtype)


def precision_dtype(precision: str) -> torch.dtype:
    """What a pipeline of `precision` (a spec's, not auto) runs in: fp8's stages in FP8_BASE, the UNet's GEMMs aside."""
    return DTYPES[FP8_BASE if precision == FP8 else precision]


def run_precision(precision: str, dtype: torch.dtype) -> str:
    """The precision a run of a spec's `precision` in `dtype` reports: fp8 as asked, else the dtype's name."""
    return FP8 if precision == FP8 else precision_name(dtype)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"
