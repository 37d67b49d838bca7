"""Requests as pipeline calls: those that may share one (demo.request.batch_key) run as one batch, each image drawn from
its own request's seed, so that it is the image the CLI makes for that request alone; a batch that fails is run again
one request at a time, so that a request that cannot run (out of memory, say) fails alone."""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from demo.pipelines.timer import StageTimer
from demo.request import Request, batch_key
from demo.serve.schema import RequestRejected


@dataclass
class Generated:
    """A pipeline call's images, and its time as the CLI measures it ("Pipeline" in its table): what the call took
    less the hand-off around it (the request's way to the device's process and the images' way back)."""

    images: np.ndarray
    pipeline_milliseconds: float


class ServedPipeline:
    """A device's loaded pipeline (demo.runtime.loaded.Pipeline, a family pipeline per served mode over one set of
    stages), called with batches of resolved one-image requests of one batch_key, one call at a time (its DeviceWorker's
    process runs them in turn: the modes share the stages' engine buffers and graphs)."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def __call__(self, requests: Sequence[Request]) -> Generated:
        """8-bit images [B, H, W, 3], one per request, in order, each drawn from its own request's seed; and the
        pipeline's own time, as the CLI reports it."""
        timer = StageTimer(self.pipeline.device)
        images = self.pipeline.run(requests, timer, pixels=True)
        return Generated(images, timer.milliseconds()["pipeline"])


@dataclass
class Outcome:
    """What became of one request."""

    request: Request | None  # None: rejected before it could run
    image: np.ndarray | None = None
    error: str | None = None
    call: int | None = None  # which of run_requests' pipeline calls made its image (0, 1, ...)
    batch_size: int = 0  # the requests that call ran
    milliseconds: float = 0.0  # that call's, as the server waited for it
    pipeline_milliseconds: float = 0.0  # of those, the pipeline's own (Generated)


def failure_line(exc: BaseException) -> str:
    """An exception from inside the pipeline as one line."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    torch = sys.modules.get("torch")  # its error only where it is loaded (the device's process)
    if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)):
        return f"out of memory ({first}); try a smaller height and width"
    return f"{type(exc).__name__}: {first}"


def run_requests(parsed: Sequence[Request | RequestRejected], generate: Callable[[list[Request]], Generated],
                 on_failure: Callable[[BaseException], None] = lambda _: None) -> list[Outcome]:
    """Each parsed request's outcome: the rejected ones fail with their reason, the rest run in batches of one
    batch_key (in the order their first request came), a failing batch again one request at a time. `on_failure`
    hears of each exception from `generate`."""
    outcomes = [Outcome(None, error=str(item)) if isinstance(item, RequestRejected) else Outcome(item)
                for item in parsed]
    groups: dict[tuple, list[int]] = {}
    for index, outcome in enumerate(outcomes):
        if outcome.error is None:
            groups.setdefault(batch_key(outcome.request), []).append(index)

    calls = itertools.count()

    def run(indices: list[int]) -> bool:
        start = time.perf_counter()
        try:
            generated = generate([outcomes[i].request for i in indices])
        except Exception as exc:  # noqa: BLE001 -- a request's failure is its answer; the server goes on
            on_failure(exc)
            if len(indices) == 1:
                outcomes[indices[0]].error = failure_line(exc)
            return False
        milliseconds, call = (time.perf_counter() - start) * 1000, next(calls)
        for index, image in zip(indices, generated.images):
            outcome = outcomes[index]
            outcome.image, outcome.call, outcome.batch_size = image, call, len(indices)
            outcome.milliseconds, outcome.pipeline_milliseconds = milliseconds, generated.pipeline_milliseconds
        return True

    for indices in groups.values():
        if not run(indices) and len(indices) > 1:
            for index in indices:
                run([index])
    return outcomes
