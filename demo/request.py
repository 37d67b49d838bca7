"""The one request model: what one generation asks for (Request), and every check of it against a model.

The CLI's flags, sd-serve's inputs and the Python API's keyword arguments all become a Request. A request is
resolved against the model (what it leaves out filled in: size, scheduler, guidance scale, seed, strength) and then
checked; the checks name the fields they refuse with core.errors.field, which each face shows by its own name for the
field.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from core.errors import UsageError, at_least, field
from demo.schedulers import check_steps, default_scheduler_name, make_scheduler, scheduler_named
from models.families import CLASSIFIER_FREE, EMBEDDED, IMAGE_TO_IMAGE, INPAINTING, MODES, NO_GUIDANCE, TEXT_TO_IMAGE

if TYPE_CHECKING:
    from PIL.Image import Image

    from models.source import ModelSource

# What a request does follows from the images it brings (Request.mode: TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINTING, of
# models.families): the pipeline and the stages it needs follow from that.
# How much of the schedule re-draws the input image unless the request says: diffusers' pipelines' defaults.
DEFAULT_STRENGTH = {IMAGE_TO_IMAGE: 0.8, INPAINTING: 1.0}
DEFAULT_PROMPT = "a photo of an astronaut riding a horse on mars"
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes


def random_seed() -> int:
    """A seed for a request given none (reported with the images, so they can be made again)."""
    return random.randrange(2**31)


def is_guided(guidance_scale: float | None) -> bool:
    """Classifier-free guidance runs above a scale of 1 (at 1 or below it would change nothing). None, the model's own
    scale (models.source.ModelSource.default_guidance_scale), guides: every model's is above 1."""
    return guidance_scale is None or guidance_scale > 1.0


def guidance_of(kind: str, guidance_scale: float | None) -> str:
    """How a request at `guidance_scale` is guided on a model of guidance `kind` (models.families GUIDANCE_KINDS):
    classifier-free guidance at a scale of 1 or below is none."""
    return NO_GUIDANCE if kind == CLASSIFIER_FREE and not is_guided(guidance_scale) else kind


@dataclass(frozen=True)
class Request:
    """One generation: `batch_size` images of `prompt` (of each prompt, where it is several: diffusers'
    num_images_per_prompt), from noise (text-to-image), from `image` (image-to-image), or repainting `image` where
    `mask` is white (inpainting). None leaves a value to the model (resolved)."""

    prompt: str | tuple[str, ...]
    # None: an empty prompt, or zero embeddings where an SDXL config says so; several: one per prompt
    negative_prompt: str | tuple[str, ...] | None = None
    batch_size: int = 1
    height: int | None = None  # None: the input image's own size, else the model's native size
    width: int | None = None
    denoising_steps: int = 50
    guidance_scale: float | None = None  # None: the model's own; <= 1: no classifier-free guidance
    scheduler: str | None = None  # None: the model's own (demo.schedulers.SCHEDULERS)
    seed: int | None = None  # None: a random one, reported
    image: Image | None = None  # image-to-image and inpainting: the input image (RGB)
    mask: Image | None = None  # inpainting: white is repainted, black kept
    strength: float | None = None  # the part of the schedule that re-draws the image (None: DEFAULT_STRENGTH)
    # ControlNet: one conditioning image per ControlNet of the pipeline (RGB), in their order; the part of the
    # schedule in which they steer (diffusers' control_guidance_start/end); guess mode (they see the prompt alone)
    control_images: tuple[Image, ...] | None = None
    control_guidance_start: float = 0.0
    control_guidance_end: float = 1.0
    guess_mode: bool = False
    # How the model guides it (models.families GUIDANCE_KINDS): filled in by `resolved` from the model, not given
    guidance: str | None = None

    @property
    def mode(self) -> str:
        return INPAINTING if self.mask is not None else IMAGE_TO_IMAGE if self.image is not None else TEXT_TO_IMAGE

    @property
    def guided(self) -> bool:
        """Whether it runs classifier-free guidance's two halves, the unconditional and the conditional (the batch
        doubled); before it is resolved, by its scale alone."""
        return guidance_of(self.guidance or CLASSIFIER_FREE, self.guidance_scale) == CLASSIFIER_FREE

    @property
    def prompts(self) -> list[str]:
        """The text of each image, in order: each prompt batch_size times."""
        prompts = (self.prompt,) if isinstance(self.prompt, str) else tuple(self.prompt)
        return [prompt for prompt in prompts for _ in range(self.batch_size)]

    @property
    def negative_prompts(self) -> list[str] | None:
        """Each image's negative prompt (None: not given)."""
        if self.negative_prompt is None:
            return None
        if isinstance(self.negative_prompt, str):
            return [self.negative_prompt] * len(self.prompts)
        return [negative for negative in self.negative_prompt for _ in range(self.batch_size)]

    @property
    def images(self) -> int:
        """How many images the request makes."""
        return len(self.prompts)

    def resolved(self, source: ModelSource, draw_seed: Callable[[], int] = random_seed) -> Request:
        """The request with what it leaves to the model filled in: the size (the input image's own, rounded down to a
        multiple of 8, where it brings one; else the model's native size), the model's own scheduler and guidance
        scale, how the model guides it, a seed from `draw_seed`, the mode's strength; a UsageError where the image's
        own size is one the model cannot take."""
        native = source.native_image_size
        given = self.height, self.width  # None: left to the image or the model (0 is given, and refused)
        height, width = (native if value is None else value for value in given)
        if self.image is not None and None in given:
            size = (self.image.height - self.image.height % 8, self.image.width - self.image.width % 8)
            low, high = source.image_size_range
            if any(value is None and not low <= own <= high for value, own in zip(given, size)):
                raise UsageError(f"{field('image')} is {self.image.width}x{self.image.height}; model '{source.name}' "
                                 f"takes {low}..{high} pixels a side: give {field('height')} and {field('width')} to "
                                 "resize it")
            height, width = (own if value is None else value for value, own in zip(given, size))
        strength, image = self.strength, self.image
        if image is not None:
            strength = DEFAULT_STRENGTH[self.mode] if strength is None else strength
            image = image if image.mode == "RGB" else image.convert("RGB")  # as diffusers' image processor takes it
        controls = self.control_images
        if controls is not None:  # diffusers' control image processor converts to RGB
            controls = tuple(control if control.mode == "RGB" else control.convert("RGB") for control in controls)
        scheduler = scheduler_named(self.scheduler) if self.scheduler else default_scheduler_name(source)
        guidance_scale = source.default_guidance_scale if self.guidance_scale is None else self.guidance_scale
        return replace(self, height=height, width=width, scheduler=scheduler, guidance_scale=guidance_scale,
                       seed=self.seed if self.seed is not None else draw_seed(), image=image, strength=strength,
                       control_images=controls, guidance=guidance_of(source.guidance, guidance_scale))

    def unused(self) -> list[str]:
        """What the request sets that its run does not use, each naming fields (core.errors.field)."""
        if self.negative_prompt is not None and self.guidance == EMBEDDED:
            return [f"{field('negative_prompt')} unused: the model embeds {field('guidance_scale')} (no unconditional "
                    "half)"]
        if self.negative_prompt is not None and not self.guided:
            return [f"{field('negative_prompt')} unused at {field('guidance_scale')} {self.guidance_scale}: there is "
                    "no classifier-free guidance at 1 or below"]
        return []

    def check_inputs(self) -> None:
        """What needs no model, before anything loads: the counts and scales in range, a scheduler we have, an image
        for a mask or a strength, a mask of the image's proportions (a one-line UsageError for the first bad one)."""
        at_least("batch_size", self.batch_size, 1)
        if not isinstance(self.prompt, str):
            if not self.prompt:
                raise UsageError(f"{field('prompt')} must be a text, or several, got none")
            if not (self.negative_prompt is None or isinstance(self.negative_prompt, str)
                    or len(self.negative_prompt) == len(self.prompt)):
                raise UsageError(f"{field('negative_prompt')} must be one, or one per prompt ({len(self.prompt)}), "
                                 f"got {len(self.negative_prompt)}")
        at_least("denoising_steps", self.denoising_steps, 1)
        if self.guidance_scale is not None and not (math.isfinite(self.guidance_scale) and self.guidance_scale >= 0):
            raise UsageError(f"{field('guidance_scale')} must be a finite number, 0 or more, got {self.guidance_scale}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"{field('seed')} must be 0..{MAX_SEED}, got {self.seed}")
        if self.scheduler is not None:
            scheduler_named(self.scheduler)
        start, end = self.control_guidance_start, self.control_guidance_end
        if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end <= 1):
            raise UsageError(f"{field('control_guidance_start')} and {field('control_guidance_end')} must be "
                             f"0 <= start < end <= 1, got {start} and {end}")
        if self.image is None:
            for name in ("mask", "strength"):
                if getattr(self, name) is not None:
                    raise UsageError(f"{field(name)} needs {field('image')} (the image to start from)")
            return
        if self.mask is not None:
            check_mask(self.image, self.mask)
        strength = DEFAULT_STRENGTH[self.mode] if self.strength is None else self.strength
        if not 0 < strength <= 1:
            raise UsageError(f"{field('strength')} must be more than 0 and at most 1, got {strength}")
        if int(self.denoising_steps * strength) < 1:  # the steps diffusers runs: int(steps x strength)
            raise UsageError(f"{field('strength')} {strength} leaves none of the {self.denoising_steps} denoising "
                             f"steps to run; raise {field('strength')} or {field('denoising_steps')}")

    def check(self, source: ModelSource) -> None:
        """A resolved request's values against their limits and the model: a one-line UsageError for the first bad
        one."""
        self.check_inputs()
        check_steps(make_scheduler(self.scheduler, source), self.scheduler, self.denoising_steps)
        check_image_size(source, self.height, self.width)
        check_mode(source, self.mode)


def check_image_size(source: ModelSource, height: int, width: int) -> None:
    low, high = source.image_size_range
    for name, value in (("height", height), ("width", width)):
        if value % 8:
            raise UsageError(f"{field(name)} must be a multiple of 8, got {value}")
        if not low <= value <= high:
            raise UsageError(f"{field(name)} {value} is outside model '{source.name}' range {low}..{high}")


def check_mode(source: ModelSource, mode: str) -> None:
    """A UsageError where the model cannot run `mode`: its family lacks the mode, or its UNet cannot (an inpainting
    UNet, taking the mask and masked image beside the latents, only inpaints; other UNets must take just the
    latents)."""
    if mode != TEXT_TO_IMAGE:
        source.family.require(mode, source.name, field("mask" if mode == INPAINTING else "image"))
    channels = source.denoiser_config["in_channels"]
    if source.inpainting and mode != INPAINTING:
        raise UsageError(f"model '{source.name}' is an inpainting model (its UNet takes {channels} channels: latents, "
                         f"mask, masked image): it only inpaints, with {field('image')} and {field('mask')}")
    if not source.inpainting and channels != source.latent_channels:
        raise UsageError(f"model '{source.name}': its UNet takes {channels} channels for {source.latent_channels} "
                         "latent ones, neither an ordinary nor an inpainting UNet")


def modes_of(source: ModelSource) -> tuple[str, ...]:
    """The modes the model's UNet can run (an inpainting UNet only inpaints; an ordinary one runs all three, inpainting
    by the latent blend), as check_mode decides; its UsageError where it runs none."""
    modes, error = [], None
    for mode in MODES:
        try:
            check_mode(source, mode)
        except UsageError as exc:
            error = exc
        else:
            modes.append(mode)
    if not modes:
        raise error
    return tuple(modes)


def check_mask(image: Image, mask: Image) -> None:
    """A UsageError where the mask has not the input image's proportions (it is resized with it)."""
    if abs(mask.width / mask.height - image.width / image.height) > 0.01 * image.width / image.height:
        raise UsageError(f"{field('mask')} is {mask.width}x{mask.height}, {field('image')} {image.width}x"
                         f"{image.height}: the mask must have the image's proportions (it is resized with it)")


def load_image(name: str, path: str, mode: str = "RGB") -> Image:
    """The image file `path` given for the field `name`, as diffusers' load_image gives it: turned upright by its EXIF
    orientation (a phone's portrait photo is stored sideways), in `mode` (RGB; a mask: L); beyond diffusers, 16-bit
    grayscale is scaled to 8 bits instead of clipped. A one-line UsageError where it is missing, not an image PIL
    reads, truncated, or more pixels than PIL decodes safely."""
    import warnings

    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():  # PIL only warns between its limit and twice it: refuse those too
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
            image.load()
        image = ImageOps.exif_transpose(image)
    except FileNotFoundError:
        raise UsageError(f"{field(name)} {path}: no such file") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UsageError(f"{field(name)} {path}: more than the {Image.MAX_IMAGE_PIXELS} pixels an image may have "
                         "here") from None
    except (OSError, ValueError, SyntaxError) as exc:  # a folder, not an image, truncated, a damaged header
        reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"{field(name)} {path}: cannot be read as an image ({reason})") from None
    if image.mode.startswith("I"):  # 16-bit grayscale (I;16, or I as PIL opens 16-bit PNGs)
        image = image.convert("I").point(lambda value: value * (1 / 257)).convert("L")
    return image.convert(mode)


def batch_key(request: Request) -> tuple:
    """Resolved requests with equal keys can run as one pipeline call: the same size, steps, scheduler and guidance,
    and negative prompts given to all or none (none: the model's empty or zero negative embeddings). A pipeline call
    takes one input image for the whole batch, so each image request runs alone."""
    if request.image is not None:
        return (id(request),)
    return (request.height, request.width, request.denoising_steps, request.scheduler, request.guidance_scale,
            request.negative_prompt is None, request.control_images is None, request.control_guidance_start,
            request.control_guidance_end, request.guess_mode)
