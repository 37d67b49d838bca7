"""What one pipeline call runs: one request's images, or several one-image requests' (sd-serve batches those)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from demo.request import Request


@dataclass(frozen=True)
class Batch:
    """Resolved requests that share a pipeline call (demo.request.batch_key): one request's images, all drawn from its
    seed as diffusers draws a batch; or several requests of one image each, each drawn from its own seed, so that each
    is the image its request makes alone."""

    requests: tuple[Request, ...]

    @classmethod
    def of(cls, requests: Request | Sequence[Request]) -> Batch:
        requests = (requests,) if isinstance(requests, Request) else tuple(requests)
        if len(requests) > 1 and any(request.images != 1 for request in requests):
            raise ValueError("a pipeline call takes one request of several images, or several of one image each")
        return cls(requests)

    @property
    def head(self) -> Request:
        """The first request: what all of them share (size, steps, guidance, scheduler, input image)."""
        return self.requests[0]

    @property
    def prompts(self) -> list[str]:
        return [prompt for request in self.requests for prompt in request.prompts]

    @property
    def negative_prompts(self) -> list[str] | None:
        """None: not given (an empty prompt, or zeros where an SDXL config says so)."""
        if self.head.negative_prompt is None:
            return None
        return [negative for request in self.requests for negative in request.negative_prompts]

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def strength(self) -> float:
        return 1.0 if self.head.strength is None else self.head.strength

    def generator(self) -> torch.Generator | list[torch.Generator]:
        """What draws the call's noise: a CPU generator of the request's seed, or of each request's (diffusers draws
        row i of the latents, and a stochastic scheduler's noise, from the i-th as a one-image run draws them from its
        one)."""
        if len(self.requests) == 1:
            return torch.Generator("cpu").manual_seed(self.head.seed)
        return [torch.Generator("cpu").manual_seed(request.seed) for request in self.requests]
