"""Per-stage wall time: CUDA events on a GPU, a monotonic clock on a CPU."""

from __future__ import annotations

import contextlib
import time

import torch


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
