"""The schedulers a request may name: diffusers' own implementations, configured from the model's scheduler config."""

from __future__ import annotations

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
}


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


def make_scheduler(name: str, source):
    """diffusers' scheduler `name` (as scheduler_named takes it), configured from the model's scheduler config."""
    import diffusers

    return getattr(diffusers, SCHEDULERS[scheduler_named(name)]).from_config(source.config("scheduler"))


def _distinct_timesteps(scheduler, steps: int) -> int:
    """How many different timesteps the scheduler runs for `steps` (0 where it refuses them)."""
    try:
        scheduler.set_timesteps(steps)
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
