"""Per-stage wall time: CUDA events on a GPU, a monotonic clock on a CPU."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, TypeVar

import torch

Result = TypeVar("Result")


class StageTimer:
    """Accumulates wall time per named region; regions may repeat (summed) and nest."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = {}

    @contextlib.contextmanager
    def measure(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._spans.setdefault(name, []).append((start, end))

    def milliseconds(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {n: sum(s.elapsed_time(e) for s, e in spans) for n, spans in self._spans.items()}
        return {n: sum(e - s for s, e in spans) * 1e3 for n, spans in self._spans.items()}


def timed_runs(run: Callable[[StageTimer | None], Result], device: torch.device, warmup_runs: int, runs: int,
               say: Callable[[str], None] = lambda _: None) -> tuple[Result, list[dict[str, float]]]:
    """`warmup_runs` untimed calls of `run` (given no timer), then `runs` timed ones (each given a fresh StageTimer):
    the last call's result and each timed call's region milliseconds, for benchmarks to take medians of. `say` hears
    of each call."""
    for index in range(warmup_runs):
        say(f"warm-up run {index + 1}/{warmup_runs}")
        run(None)
    timings, result = [], None
    for index in range(runs):
        timer = StageTimer(device)
        result = run(timer)
        timings.append(timer.milliseconds())
        say(f"run {index + 1}/{runs}: pipeline {timings[-1]['pipeline']:.2f} ms, UNet {timings[-1]['unet']:.2f} ms")
    return result, timings
