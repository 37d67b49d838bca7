"""The one request model: what one generation asks for (Request), and every check of it against a model.

The CLI's flags, sd-serve's inputs and the Python API's keyword arguments all become a Request. A request is
resolved against the model (what it leaves out filled in: size, scheduler, guidance scale, seed, strength) and then
checked; the checks name the fields they refuse with core.errors.field, which each face shows by its own name for the
field.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Callable, Sequence

from core.errors import UsageError, at_least, field
from core.typed import check_field_types
from demo.schedulers import (
    SCHEDULER_OPTIONS,
    SCHEDULERS,
    check_option_values,
    check_options,
    check_scheduler_family,
    check_steps,
    check_timesteps_in_range,
    default_scheduler_name,
    default_steps,
    first_step,
    make_scheduler,
    scheduler_named,
)
from models.families import CLASSIFIER_FREE, EMBEDDED, IMAGE_TO_IMAGE, INPAINTING, MODES, NO_GUIDANCE, TEXT_TO_IMAGE
from models.recommended import SETTINGS, Recommended, first_saying

if TYPE_CHECKING:
    from PIL.Image import Image

    from models.source import ModelSource

# What a request does follows from the images it brings (Request.mode: TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINTING, of
# models.families): the pipeline and the stages it needs follow from that.
# How much of the schedule re-draws the input image unless the request says: diffusers' pipelines' defaults.
DEFAULT_STRENGTH = {IMAGE_TO_IMAGE: 0.8, INPAINTING: 1.0}
DEFAULT_PROMPT = "a photo of an astronaut riding a horse on mars"
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
# diffusers' pipelines' names for Request's fields, taken by the Python API beside ours (a diffusers user tries them
# first); a generator gives its seed (DIFFUSERS_GENERATOR)
DIFFUSERS_NAMES = {"num_inference_steps": "denoising_steps", "num_images_per_prompt": "batch_size",
                   "mask_image": "mask", "generator": "seed"}


# how ControlNets steer a request: nothing without them
CONTROL_FIELDS = ("control_guidance_start", "control_guidance_end", "guess_mode")


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
    # None leaves each of these three to what a LoRA, then the model, recommends (models.recommended), else to the
    # toolkit's defaults: the scheduler's step count (demo.schedulers.default_steps), the model's guidance scale and
    # its scheduler. A guidance scale of 1 or below: no classifier-free guidance.
    denoising_steps: int | None = None
    guidance_scale: float | None = None
    scheduler: str | None = None  # demo.schedulers.SCHEDULERS' names
    # The scheduler's options (demo.schedulers.TAKES says which each takes); None leaves each to the model's scheduler
    # config (spacing: leading, linspace or trailing; Karras sigmas) or to diffusers' pipelines (eta 0; the scheduler's
    # own timesteps). Explicit `timesteps`, from the noisiest down, set the step count (denoising_steps).
    timestep_spacing: str | None = None
    karras_sigmas: bool | None = None
    eta: float | None = None
    timesteps: tuple[int, ...] | None = None
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

    def __post_init__(self):
        """Each field as its type says (core.typed), the images taken from paths and numpy arrays too (as_image), one
        control image as a tuple of one: a UsageError naming the first field that is none of these, before any work."""
        for name, mode in (("image", "RGB"), ("mask", "L")):
            object.__setattr__(self, name, as_image(name, getattr(self, name), mode))
        controls = self.control_images
        if controls is not None:
            several = isinstance(controls, (tuple, list))
            object.__setattr__(self, "control_images", tuple(as_image("control_images", control, "RGB")
                                                             for control in (controls if several else (controls,))))
        from PIL.Image import Image  # the annotations' Image (here only for type checking above)

        check_field_types(self, {"Image": Image})

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

    def resolved(self, source: ModelSource, draw_seed: Callable[[], int] = random_seed,
                 recommended: Sequence[Recommended] = ()) -> Request:
        """The request with what it leaves to the model filled in: the size (the input image's own, rounded down to a
        multiple of the model's: source.image_size_multiple, where it brings one; else the model's native size), the
        steps, scheduler and guidance scale the first of `recommended` (LoRAs', in order) then the model recommends,
        else the scheduler's steps and the model's own scheduler and scale, how the model guides it, a seed from
        `draw_seed`, the mode's strength; a UsageError where the image's own size is one the model cannot take, or
        where it gives a guidance scale to a model guided by none (FLUX.1 [schnell])."""
        if self.guidance_scale is not None and source.guidance == NO_GUIDANCE:  # diffusers would ignore it unsaid
            raise UsageError(f"{field('guidance_scale')} {self.guidance_scale:g}: model '{source.name}' takes no "
                             f"guidance scale (its {source.family.denoiser} embeds none and the {source.family.label} "
                             "family runs no classifier-free guidance); leave it out")
        said = {name: first_saying((*recommended, source.recommended), name) for name in SETTINGS}
        native = source.native_image_size
        given = self.height, self.width  # None: left to the image or the model (0 is given, and refused)
        height, width = (native if value is None else value for value in given)
        if self.image is not None and None in given:
            multiple = source.image_size_multiple
            size = (self.image.height - self.image.height % multiple, self.image.width - self.image.width % multiple)
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
        if self.scheduler:
            scheduler = scheduler_named(self.scheduler)
        elif said["scheduler"]:
            scheduler = recommended_scheduler(said["scheduler"])
        else:
            scheduler = default_scheduler_name(source)
        values = {name: getattr(found, name) for name, found in said.items() if found}
        guidance_scale = next(scale for scale in (self.guidance_scale, values.get("guidance_scale"),
                                                  source.default_guidance_scale) if scale is not None)
        check_option_values(self)  # before explicit timesteps replace the step count
        if self.timesteps is not None:
            steps = len(self.timesteps)
        else:
            steps = next(count for count in (self.denoising_steps, values.get("denoising_steps"),
                                             default_steps(scheduler)) if count is not None)
        return replace(self, height=height, width=width, scheduler=scheduler, guidance_scale=guidance_scale,
                       denoising_steps=steps,
                       seed=self.seed if self.seed is not None else draw_seed(), image=image, strength=strength,
                       control_images=controls, guidance=guidance_of(source.guidance, guidance_scale))

    def make_scheduler(self, source: ModelSource):
        """The resolved request's scheduler for `source`, with its spacing and Karras sigmas."""
        return make_scheduler(self.scheduler, source, self.timestep_spacing, self.karras_sigmas)

    @property
    def scheduler_options(self) -> dict:
        """The scheduler options it sets (demo.schedulers.SCHEDULER_OPTIONS), as JSON takes them."""
        given = {option: getattr(self, option) for option in SCHEDULER_OPTIONS}
        return {option: list(value) if isinstance(value, tuple) else value for option, value in given.items()
                if value is not None}

    @property
    def scheduler_key(self) -> tuple:
        """What tells one request's scheduler object from another's (its steps, eta and timesteps are set per run)."""
        return self.scheduler, self.timestep_spacing, self.karras_sigmas

    def unused(self) -> list[str]:
        """What the request sets that its run does not use, each naming fields (core.errors.field)."""
        notes = []
        if self.negative_prompt is not None and self.guidance == EMBEDDED:
            notes.append(f"{field('negative_prompt')} unused: the model embeds {field('guidance_scale')} (no "
                         "unconditional half)")
        elif self.negative_prompt is not None and not self.guided:
            notes.append(f"{field('negative_prompt')} unused at {field('guidance_scale')} {self.guidance_scale}: "
                         "there is no classifier-free guidance at 1 or below")
        if self.control_images is None:  # no ControlNet steers the run (the pipeline has none: check_control_images)
            control = [name for name in CONTROL_FIELDS if getattr(self, name) != getattr(Request, name)]
            if control:
                notes.append(f"{', '.join(map(field, control))} unused without ControlNets")
        return notes

    def check_inputs(self) -> None:
        """What needs no model, before anything loads: the counts and scales in range, a scheduler we have, an image
        for a mask or a strength, a mask of the image's proportions (a one-line UsageError for the first bad one)."""
        at_least("batch_size", self.batch_size, 1)
        prompts = 1 if isinstance(self.prompt, str) else len(self.prompt)
        if not prompts:
            raise UsageError(f"{field('prompt')} must be a text, or several, got none")
        if isinstance(self.negative_prompt, tuple) and len(self.negative_prompt) != prompts:
            raise UsageError(f"{field('negative_prompt')} must be one, or one per prompt ({prompts}), got "
                             f"{len(self.negative_prompt)}")
        if self.denoising_steps is not None:
            at_least("denoising_steps", self.denoising_steps, 1)
        if self.guidance_scale is not None and not (math.isfinite(self.guidance_scale) and self.guidance_scale >= 0):
            raise UsageError(f"{field('guidance_scale')} must be a finite number, 0 or more, got {self.guidance_scale}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"{field('seed')} must be 0..{MAX_SEED}, got {self.seed}")
        if self.scheduler is not None:
            scheduler_named(self.scheduler)
        check_option_values(self)
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

    def check(self, source: ModelSource) -> None:
        """A resolved request's values against their limits and the model: a one-line UsageError for the first bad
        one."""
        self.check_inputs()
        check_scheduler_family(self.scheduler, source)
        check_options(self.scheduler, self)
        scheduler = self.make_scheduler(source)
        if self.timesteps is None:
            check_steps(scheduler, self.scheduler, self.denoising_steps)
        else:
            check_timesteps_in_range(scheduler, self.scheduler, self.timesteps)
        check_image_size(source, self.height, self.width)
        check_mode(source, self.mode)
        check_t5_length(source, self)
        strength = DEFAULT_STRENGTH.get(self.mode) if self.strength is None else self.strength
        steps = self.denoising_steps  # counted as the model's diffusers pipeline counts them (SD3's its own way)
        if self.image is not None and first_step(steps, strength, source.family.flow_matching) >= steps:
            raise UsageError(f"{field('strength')} {strength} leaves none of the {self.denoising_steps} denoising "
                             f"steps to run; raise {field('strength')} or {field('denoising_steps')}")


def check_t5_length(source: ModelSource, request: Request) -> None:
    """A UsageError where a text the model's T5 reads (the prompts; the negative ones under classifier-free guidance)
    is longer than its family's T5 length: diffusers' pipelines cut the rest with a warning, which loses the prompt's
    end unsaid in a server's log. CLIP's 77 tokens stay a warning (demo-diffusion's), as A1111 users expect."""
    tokenizer = source.t5_tokenizer
    if tokenizer is None:
        return
    limit = source.family.t5_length
    for name, texts in (("prompt", request.prompts),
                        ("negative_prompt", request.negative_prompts if request.guided else None)):
        for text in dict.fromkeys(texts or ()):
            count = len(tokenizer(text).input_ids)  # its end-of-text token among them, as the encoder reads it
            if count > limit:
                raise UsageError(f"{field(name)} is {count} T5 tokens; model '{source.name}' reads {limit}: shorten it "
                                 "(diffusers' pipeline would cut the rest)")


def check_image_size(source: ModelSource, height: int, width: int) -> None:
    low, high = source.image_size_range
    for name, value in (("height", height), ("width", width)):
        if value % source.image_size_multiple:
            raise UsageError(f"{field(name)} must be a multiple of {source.image_size_multiple_text}, got {value}")
        if not low <= value <= high:
            raise UsageError(f"{field(name)} {value} is outside model '{source.name}' range {low}..{high}")


def check_mode(source: ModelSource, mode: str) -> None:
    """A UsageError where the model cannot run `mode`: its family lacks the mode, or its denoiser cannot (an
    inpainting one, taking the mask and masked image beside the latents, only inpaints; others must take just the
    latents)."""
    if mode != TEXT_TO_IMAGE:
        source.family.require(mode, source.name, field("mask" if mode == INPAINTING else "image"))
    channels, denoiser = source.input_channels, source.family.denoiser
    if source.inpainting and mode != INPAINTING:
        raise UsageError(f"model '{source.name}' is an inpainting model (its {denoiser} takes {channels} channels: "
                         f"latents, mask, masked image): it only inpaints, with {field('image')} and {field('mask')}")
    if not source.inpainting and channels != source.latent_channels:
        raise UsageError(f"model '{source.name}': its {denoiser} takes {channels} channels for "
                         f"{source.latent_channels} latent ones, neither an ordinary nor an inpainting {denoiser}")


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


def recommended_scheduler(recommended: Recommended) -> str:
    """Our name of the scheduler `recommended` names (a UsageError naming who recommends it where it is none)."""
    try:
        return scheduler_named(recommended.scheduler)
    except UsageError:
        raise UsageError(f"{recommended.by} recommends scheduler '{recommended.scheduler}', which this "
                         f"toolkit does not offer; choose one with {field('scheduler')} "
                         f"({', '.join(SCHEDULERS)})") from None


def recommendation_note(given: Request, resolved: Request, recommendations: Sequence[Recommended]) -> str | None:
    """What `resolved` took from `recommendations` (the first that says each, as Request.resolved takes them) where
    `given` left it out, naming the fields and who recommends each; None where it took nothing."""
    by: dict[str, list[str]] = {}
    for name in SETTINGS:
        if getattr(given, name) is not None or (name == "denoising_steps" and given.timesteps is not None):
            continue
        said = first_saying(recommendations, name)
        if said is None:
            continue
        value = recommended_scheduler(said) if name == "scheduler" else getattr(said, name)
        if getattr(resolved, name) == value:  # not where the spec set it first
            by.setdefault(said.by, []).append(f"{field(name)} {getattr(resolved, name)}")
    return "; ".join(f"{', '.join(taken)}: as {who} recommends" for who, taken in by.items()) or None


def request_fields(given: dict) -> dict:
    """A Python API call's keyword arguments as Request's fields: diffusers' names (DIFFUSERS_NAMES) taken for ours, a
    torch.Generator for its seed; a UsageError for a name neither knows, or a field given by both names."""
    accepted = [item.name for item in fields(Request) if item.name != "guidance"]
    unknown = sorted(name for name in given if name not in accepted and name not in DIFFUSERS_NAMES)
    if unknown:
        raise UsageError(f"unknown field(s) {', '.join(unknown)}; a call takes {', '.join(accepted)} (or diffusers' "
                         f"{', '.join(DIFFUSERS_NAMES)})")
    taken = {}
    for name, value in given.items():
        ours = DIFFUSERS_NAMES.get(name, name)
        if ours in taken:
            raise UsageError(f"{field(ours)} given twice (also as {name}): give one")
        taken[ours] = generator_seed(value) if name == "generator" else value
    return taken


def generator_seed(generator) -> int:
    """The seed a torch.Generator was made with (diffusers' `generator`): the noise is drawn from it on the CPU, as
    from `seed`, so the image is diffusers' with torch.Generator("cpu").manual_seed(seed)."""
    if not callable(getattr(generator, "initial_seed", None)):
        raise UsageError(f"generator must be one torch.Generator (its seed is used), got {type(generator).__name__}")
    return generator.initial_seed()


def as_image(name: str, value, mode: str) -> Image | None:
    """An image field's value as a PIL image: one given (kept as it is: resolved converts it), a path (load_image, in
    `mode`), or a numpy array as diffusers' image processor takes it (8-bit, or floats in [0, 1]; H x W, H x W x 1, 3
    or 4, or one of a batch of one). A UsageError naming the field for anything else, or an image without pixels."""
    if value is None:
        return None
    from PIL import Image

    if isinstance(value, (str, os.PathLike)):
        value = load_image(name, os.fspath(value), mode)
    elif not isinstance(value, Image.Image) and hasattr(value, "__array_interface__"):
        value = array_image(name, value)
    if not isinstance(value, Image.Image):
        raise UsageError(f"{field(name)} must be a PIL image, a path to one or a numpy array, got "
                         f"{type(value).__name__}")
    if not (value.width and value.height):
        raise UsageError(f"{field(name)} is {value.width}x{value.height}: an image needs pixels")
    return value


def array_image(name: str, array) -> Image:
    """A numpy array as a PIL image, as diffusers' image processor reads one; a UsageError naming the field where it
    is not an image."""
    import numpy as np
    from PIL import Image

    array = np.asarray(array)
    if array.ndim == 4 and array.shape[0] == 1:  # a batch of one
        array = array[0]
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[..., 0]
    shaped = array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))
    if np.issubdtype(array.dtype, np.floating) and shaped and array.size and np.isfinite(array).all() \
            and 0 <= array.min() <= array.max() <= 1:
        array = (array * 255).round().astype(np.uint8)  # as diffusers' numpy_to_pil rounds
    if array.dtype != np.uint8 or not shaped:
        raise UsageError(f"{field(name)} as a numpy array must be 8-bit, or floats in [0, 1], of H x W, H x W x 1, 3 "
                         f"or 4 values; got {array.dtype} of shape {tuple(array.shape)}")
    return Image.fromarray(array)


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
    return (request.height, request.width, request.denoising_steps, request.scheduler_key, request.eta,
            request.timesteps, request.guidance_scale,
            request.negative_prompt is None, request.control_images is None, request.control_guidance_start,
            request.control_guidance_end, request.guess_mode)
