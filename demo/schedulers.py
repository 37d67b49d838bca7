"""The schedulers a request may name: diffusers' own implementations, configured from the model's scheduler config,
and the options each one takes (a request's timestep spacing, Karras sigmas, eta and explicit timesteps)."""

from __future__ import annotations

import math

from core.errors import UsageError, field

# Our name -> diffusers' scheduler class name.
SCHEDULERS = {
    "DDIM": "DDIMScheduler",
    "PNDM": "PNDMScheduler",
    "Euler": "EulerDiscreteScheduler",
    "EulerA": "EulerAncestralDiscreteScheduler",
    "DPM++2M": "DPMSolverMultistepScheduler",
    "LMSD": "LMSDiscreteScheduler",
    "UniPC": "UniPCMultistepScheduler",
    "LCM": "LCMScheduler",
    "TCD": "TCDScheduler",
    "FlowMatchEuler": "FlowMatchEulerDiscreteScheduler",
}
# Those that step a flow (rectified flow: SD3's, Flux's), not noise or v: each runs the models of a family that
# predicts a flow (models.families Family.flow_matching), and those alone.
FLOW_MATCHING = ("FlowMatchEuler",)
# A request's scheduler options (demo.request.Request's fields of these names): None leaves each to the model's own
# scheduler config (a timestep spacing, Karras sigmas) or to diffusers' pipelines' default (eta 0, the scheduler's own
# timesteps for the steps asked).
TIMESTEP_SPACING, KARRAS_SIGMAS, ETA, TIMESTEPS = "timestep_spacing", "karras_sigmas", "eta", "timesteps"
SCHEDULER_OPTIONS = (TIMESTEP_SPACING, KARRAS_SIGMAS, ETA, TIMESTEPS)
TIMESTEP_SPACINGS = ("leading", "linspace", "trailing")
# The options each scheduler takes, as diffusers' implementations read them: the spacing and Karras sigmas from its
# config (LCM and TCD space their own from original_inference_steps), eta in its step, explicit timesteps in
# set_timesteps(timesteps=...).
TAKES = {
    "DDIM": (TIMESTEP_SPACING, ETA),
    "PNDM": (TIMESTEP_SPACING,),
    "Euler": (TIMESTEP_SPACING, KARRAS_SIGMAS, TIMESTEPS),
    "EulerA": (TIMESTEP_SPACING,),
    "DPM++2M": (TIMESTEP_SPACING, KARRAS_SIGMAS, TIMESTEPS),
    "LMSD": (TIMESTEP_SPACING, KARRAS_SIGMAS),
    "UniPC": (TIMESTEP_SPACING, KARRAS_SIGMAS),
    "LCM": (TIMESTEPS,),
    "TCD": (ETA, TIMESTEPS),
    "FlowMatchEuler": (),  # diffusers' SD3 pipelines set its steps alone, its shift from the model's config
}
TAKER_OF = {option: tuple(name for name, takes in TAKES.items() if option in takes) for option in SCHEDULER_OPTIONS}
# The steps a request that gives none runs, where neither the model nor a LoRA recommends a count: the few-step
# schedulers' usual count (LCM's and TCD's papers and model cards: 4), else diffusers' pipelines' default.
DEFAULT_STEPS = 50
FEW_STEPS = {"LCM": 4, "TCD": 4}


def default_steps(name: str) -> int:
    """The step count of scheduler `name` (ours) for a request that gives none and has none recommended."""
    return FEW_STEPS.get(name, DEFAULT_STEPS)


def default_scheduler_name(source) -> str:
    """The name of the scheduler the model's config names (a UsageError where it is none of ours)."""
    class_name = source.config("scheduler").get("_class_name")
    for name, cls in SCHEDULERS.items():
        if cls == class_name:
            return name
    raise UsageError(
        f"model '{source.name}' uses scheduler {class_name}, which this toolkit does not offer; "
        f"choose one with {field('scheduler')} ({', '.join(SCHEDULERS)})"
    )


def scheduler_named(given: str) -> str:
    """Our name of the scheduler `given` names, in any case, by our name or diffusers' class name (a UsageError where
    it names none)."""
    folded = str(given).casefold()
    for name, class_name in SCHEDULERS.items():
        if folded in (name.casefold(), class_name.casefold()):
            return name
    raise UsageError(f"{field('scheduler')} '{given}' is unknown; choose one of {', '.join(SCHEDULERS)} (or "
                     "diffusers' class name)")


def make_scheduler(name: str, source, timestep_spacing: str | None = None, karras_sigmas: bool | None = None):
    """diffusers' scheduler `name` (as scheduler_named takes it), configured from the model's scheduler config, with
    a request's timestep spacing and Karras sigmas in place of the config's where given."""
    import diffusers

    return getattr(diffusers, SCHEDULERS[scheduler_named(name)]).from_config(
        source.config("scheduler"), **config_overrides(timestep_spacing, karras_sigmas))


def config_overrides(timestep_spacing: str | None, karras_sigmas: bool | None) -> dict:
    """A request's spacing and Karras sigmas as diffusers' scheduler config names them (those given)."""
    return {key: value for key, value in (("timestep_spacing", timestep_spacing),
                                          ("use_karras_sigmas", karras_sigmas)) if value is not None}


def dynamic_shift(scheduler, image_tokens: int | None = None) -> dict:
    """set_timesteps' `mu` where the scheduler's config shifts its sigmas by the image's size (use_dynamic_shifting:
    Flux's), as diffusers' pipelines compute it (calculate_shift: linear in the image's tokens between the config's
    base and max sequence lengths) for an image of `image_tokens` tokens (None: the base length's, for a check of the
    steps alone, whose count the shift does not change); {} where it does not."""
    config = scheduler.config
    if not config.get("use_dynamic_shifting"):
        return {}
    base, most = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    low, high = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (high - low) / (most - base)
    offset = low - slope * base  # in calculate_shift's order: the same float
    return {"mu": (base if image_tokens is None else image_tokens) * slope + offset}


def _distinct_timesteps(scheduler, steps: int) -> int:
    """How many different timesteps the scheduler runs for `steps` (0 where it refuses them)."""
    try:
        scheduler.set_timesteps(steps, **dynamic_shift(scheduler))
    except ValueError:  # e.g. DDIM above its training timesteps
        return 0
    return len(set(scheduler.timesteps.tolist()))


def check_steps(scheduler, name: str, steps: int, steps_field: str = "denoising_steps") -> None:
    """A UsageError where the scheduler cannot run `steps` distinct steps: above its limit diffusers' schedulers
    refuse, repeat the last timestep (PNDM, Euler) or collapse to one (DPM++2M, UniPC). A count above the training
    timesteps is refused outright (no more steps than the model was trained with add anything), before a schedule
    that long is built. The error names `steps_field`, the field that gave the count."""
    training = scheduler.config.num_train_timesteps
    if steps <= training and _distinct_timesteps(scheduler, steps) >= steps:
        return
    low, high = 1, min(steps, training + 1) - 1  # the most steps it runs distinctly, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if _distinct_timesteps(scheduler, middle) >= middle else (low, middle - 1)
    raise UsageError(f"{field(steps_field)} {steps} is more than scheduler {name} can take for this model: at "
                     f"most {low} (it has {scheduler.config.num_train_timesteps} training timesteps)")


def first_step(steps: int, strength: float, flow: bool = False) -> int:
    """Of `steps`, the first a run at `strength` denoises (it runs those from there on), as diffusers' image-to-image
    pipelines count it: their UNet ones the whole steps the strength leaves, int(steps x strength) (5 steps at 0.7 run
    3); their flow-matching ones (`flow`: a family's Family.flow_matching, SD3's) that count unrounded, the first step
    rounded down (5 at 0.7 run 4)."""
    if flow:
        return int(max(steps - min(steps * strength, steps), 0))
    return steps - min(int(steps * strength), steps)


def check_option_values(request) -> None:
    """A request's scheduler options in range, whatever the scheduler (a one-line UsageError for the first bad one):
    a spacing we know, eta in [0, 1], explicit timesteps from the noisiest down, none repeated, none negative, and
    no other step count beside them."""
    if request.timestep_spacing is not None and request.timestep_spacing not in TIMESTEP_SPACINGS:
        raise UsageError(f"{field(TIMESTEP_SPACING)} must be one of {', '.join(TIMESTEP_SPACINGS)}, got "
                         f"'{request.timestep_spacing}'")
    eta = request.eta
    if eta is not None and not (math.isfinite(eta) and 0 <= eta <= 1):
        raise UsageError(f"{field(ETA)} must be 0..1, got {eta}")
    timesteps = request.timesteps
    if timesteps is None:
        return
    if not timesteps:
        raise UsageError(f"{field(TIMESTEPS)} must name one timestep at least, got none")
    if any(later >= earlier for earlier, later in zip(timesteps, timesteps[1:])) or timesteps[-1] < 0:
        raise UsageError(f"{field(TIMESTEPS)} must run from the noisiest down, each below the one before and none "
                         f"below 0 (e.g. 999,749,499,249), got {','.join(map(str, timesteps))}")
    if request.denoising_steps not in (None, len(timesteps)):
        raise UsageError(f"{field('denoising_steps')} {request.denoising_steps} and {field(TIMESTEPS)} "
                         f"({len(timesteps)} of them) disagree: the timesteps set the step count, give one")


def check_scheduler_family(name: str, source) -> None:
    """A UsageError where scheduler `name` (ours) cannot step the model's denoiser: a flow-matching scheduler for a
    model that predicts noise or v, or the reverse."""
    family = source.family
    if (name in FLOW_MATCHING) != family.flow_matching:
        fits = [other for other in SCHEDULERS if (other in FLOW_MATCHING) == family.flow_matching]
        predicts = "a flow (rectified flow)" if family.flow_matching else "noise or v"
        raise UsageError(f"{field('scheduler')} {name}: model '{source.name}' is of the {family.label} family, whose "
                         f"denoiser predicts {predicts}, which {name} does not step; choose {', '.join(fits)}")


def check_options(name: str, request) -> None:
    """A UsageError naming the first option the request sets that scheduler `name` (ours) does not take."""
    for option in SCHEDULER_OPTIONS:
        if getattr(request, option) is not None and option not in TAKES[name]:
            takes = ", ".join(map(field, TAKES[name])) or "none of them"
            raise UsageError(f"{field(option)}: scheduler {name} does not take it (of its options it takes {takes})")


def check_timesteps_in_range(scheduler, name: str, timesteps: tuple[int, ...]) -> None:
    """A UsageError where scheduler `name` cannot run these explicit timesteps: one at or above its training
    timesteps, or a setting of the model's config that diffusers refuses beside them (Karras sigmas)."""
    training = scheduler.config.num_train_timesteps
    if timesteps[0] >= training:
        raise UsageError(f"{field(TIMESTEPS)} {timesteps[0]} is out of range: scheduler {name} has {training} "
                         f"training timesteps (0..{training - 1})")
    try:
        scheduler.set_timesteps(timesteps=list(timesteps))
    except ValueError as exc:
        raise UsageError(f"{field(TIMESTEPS)}: scheduler {name} refuses them for this model: "
                         f"{str(exc).strip().splitlines()[0]}") from None
