"""The step cache's schedules: which denoiser calls of a run run whole, and which reuse what the last whole call
kept (docs/step-cache.md). The fixed schedule runs every Nth call whole (DeepCache's). The adaptive one decides call
by call from how much a cheap part of the denoiser's output moved (First Block Cache, after TeaCache):

Every call runs the cheap part: a transformer's first block, a UNet's shallow pass on the deep features kept from
the last whole call (models.unet_cache). Its output (the indicator) is compared with the indicator of the last whole
call: the relative mean absolute change, over the whole batch (both halves of classifier-free guidance, and every
image of a batched call, decide together). The call runs whole where that change exceeds the threshold, or where
`max_skips` calls in a row have been cached; otherwise the rest of the denoiser is skipped and its contribution reused
from the last whole call. Measuring against the last whole call, not the call before, accumulates the change since
then, as TeaCache's running sum of step-to-step changes does.

With `forecast` (the transformers' option), a cached call does not reuse the last whole call's contribution as it
is but the line through the last two whole calls' contributions, by call number, extended to this call: TaylorSeer's
first-order forecast (Liu et al. 2025) on First Block Cache's residual. Until two whole calls have run, the last one's.

A threshold of 0 is no cache: the pipelines then never split the denoiser (the same stages, the image bit for bit).
The decision reads one number on the host each cached-or-not call: the only wait the loop has (docs/step-cache.md
says what it costs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the spec reads this module, and a spec is checked before torch is imported
    import torch

DEFAULT_MAX_SKIPS = 3  # cached calls in a row at most: a long cached run drifts however small each change looks


def relative_change(now: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """mean |now - then| / mean |then| in float32, on the tensors' device (a 0-d tensor: no host sync)."""
    now, then = now.float(), then.float()
    return (now - then).abs().mean() / then.abs().mean()


@dataclass(frozen=True)
class StepCache:
    """A pipeline's step cache: `interval` N above 1 is the fixed schedule, `threshold` above 0 the adaptive one (a
    spec asks for one at most: demo.runtime.spec); neither, no cache."""

    interval: int = 1
    threshold: float = 0.0
    max_skips: int = DEFAULT_MAX_SKIPS
    forecast: bool = False  # the adaptive cache's cached calls extrapolate the last two whole calls' contributions

    @property
    def adaptive(self) -> bool:
        return self.threshold > 0

    @property
    def on(self) -> bool:
        """Whether any call may be cached (a fixed interval above 1, or a threshold)."""
        return self.interval > 1 or self.adaptive

    def schedule(self) -> FixedSchedule | AdaptiveSchedule:
        """A fresh schedule for one denoising loop."""
        if self.adaptive:
            return AdaptiveSchedule(self.threshold, self.max_skips, self.forecast)
        return FixedSchedule(self.interval)


NO_CACHE = StepCache()


class FixedSchedule:
    """Every interval-th call whole, the first included (the indicator is not read: None will do)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.calls = self.whole_calls = 0

    def whole(self, indicator: torch.Tensor | None = None) -> bool:
        self.calls += 1
        return (self.calls - 1) % self.interval == 0

    def ran_whole(self, indicator: torch.Tensor | None = None) -> None:
        self.whole_calls += 1


class AdaptiveSchedule:
    """One run's decisions (make one per denoising loop): `whole(indicator)` for each call in order, then
    `ran_whole(indicator)` after a call that ran whole; `keep(value)` after a whole call, `kept()` in a cached one:
    what the cached calls reuse of the whole ones."""

    def __init__(self, threshold: float, max_skips: int = DEFAULT_MAX_SKIPS, forecast: bool = False):
        self.threshold, self.max_skips, self.forecast = threshold, max_skips, forecast
        self.reference: torch.Tensor | None = None  # the indicator of the last whole call
        self.skipped_in_row = 0
        self.calls = self.whole_calls = 0
        self._kept: list[tuple[torch.Tensor, int]] = []  # the last whole calls' values and call numbers, newest last

    def whole(self, indicator: torch.Tensor | None) -> bool:
        """Whether this call runs whole: the first always (nothing kept yet), then where the indicator moved more
        than the threshold since the last whole call or the cap on cached calls in a row is reached."""
        self.calls += 1
        if self.reference is None or indicator is None or self.skipped_in_row >= self.max_skips:
            whole = True
        else:
            whole = relative_change(indicator, self.reference).item() > self.threshold
        if not whole:
            self.skipped_in_row += 1
        return whole

    def ran_whole(self, indicator: torch.Tensor) -> None:
        """Keep a whole call's indicator as the reference for the calls after it."""
        self.reference = indicator
        self.skipped_in_row = 0
        self.whole_calls += 1

    def keep(self, value: torch.Tensor) -> None:
        """Keep what this whole call made for the cached calls after it (the tail's residual). With the forecast the
        one before it is kept too, so both are copies: a stage replayed from a CUDA graph writes its next outputs
        into the same buffers."""
        if self.forecast:
            self._kept = [*self._kept[-1:], (value.clone(), self.calls)]
        else:
            self._kept = [(value, self.calls)]

    def kept(self) -> torch.Tensor:
        """What this cached call reuses: the last whole call's value, or with the forecast and two whole calls kept,
        the line through both (by call number) at this call."""
        last, at = self._kept[-1]
        if len(self._kept) < 2:
            return last
        before, at_before = self._kept[0]
        return last + (last - before) * ((self.calls - at) / (at - at_before))

