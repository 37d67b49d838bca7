"""A stream of batches through one family pipeline, for throughput: the next batch's text encoding overlapped with
the current batch's denoising loop, and a batch's VAE decode with the next batch's loop.

Each batch runs the family's own steps (encode_prompt, timesteps, prepare_latents, denoise, decode: what
Text2ImagePipeline.__call__ runs), in three lanes: the text encoders, the denoising loop and the decode. On a GPU with
`overlap` each lane is a CUDA stream: the loop on the current stream, the text encoders and the decode on streams of
their own, ordered by events (a batch's loop waits for its text states; its decode for its loop's last step), and each
tensor handed from one lane to another is recorded on the lane that reads it, so that the allocator does not reuse its
memory while that lane may still read it. Every stage runs in one lane only (a CUDA graph's static buffers are never
written by two streams), and the scheduler, the one state the batches share, only in the loop's lane, one batch after
the other. So the images are those of each batch run alone; only the order of independent work on the device
changes. The host never waits for a decode before it queues the next loop: each batch's pixels are copied into pinned
memory on the decode lane and read once its event has passed. Without `overlap`, or on a CPU, all lanes are the
current stream and the batches run one after the other, each as a pipeline call runs it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from demo.pipelines.batch import Batch
from demo.pipelines.images import pixel_tensor, warn_not_finite
from demo.pipelines.timer import StageTimer

if TYPE_CHECKING:
    from demo.pipelines.text_to_image import Text2ImagePipeline


@dataclass
class _Decoded:
    """A batch's pixels on their way to the host: pinned buffers and the event after their copy (None on a CPU)."""

    pixels: torch.Tensor
    finite: torch.Tensor
    done: torch.cuda.Event | None


class BatchStream:
    """Runs batches (demo.pipelines.batch.Batch) through `family`'s steps, overlapped on a GPU where `overlap` says
    (the module's docstring), and gives each batch's 8-bit pixels [B, H, W, 3], as Text2ImagePipeline's call with
    `pixels` gives them."""

    def __init__(self, family: Text2ImagePipeline, device: torch.device, overlap: bool = True):
        self.family, self.device = family, device
        self.overlap = overlap and device.type == "cuda"
        self.text_lane = self.decode_lane = None  # the current stream's
        if self.overlap:
            self.text_lane, self.decode_lane = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def _lane(self, lane) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(lane) if self.overlap else contextlib.nullcontext()

    def _event(self) -> torch.cuda.Event | None:
        if not self.overlap:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _hand_over(self, tensors, done: torch.cuda.Event | None, to_lane) -> None:
        """`to_lane` waits for `done` (recorded where `tensors` were made) and the tensors' memory is kept until what
        it queues on them has run."""
        if not self.overlap:
            return
        to_lane.wait_event(done)
        for tensor in tensors:
            tensor.record_stream(to_lane)

    def run(self, batches: Sequence[Batch], timers: Sequence[StageTimer] | None = None,
            done: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """Each batch's pixels, in order; `timers` (one per batch, or None) time each batch's "clip", "unet" and "vae"
        regions, each on its lane (with `overlap` a region's time includes what runs beside it on the device);
        `done` hears of each batch's index once its pixels are on the host."""
        if not batches:
            return []
        timers = list(timers) if timers is not None else [StageTimer(self.device) for _ in batches]
        if len(timers) != len(batches):
            raise ValueError(f"{len(batches)} batches, {len(timers)} timers")
        main = torch.cuda.current_stream(self.device) if self.overlap else None
        if self.overlap:  # whatever the caller queued comes first
            self.decode_lane.wait_stream(main)
        encoded = [self._encode(batches[0], timers[0])]
        decoded: list[_Decoded] = []
        pixels: list[np.ndarray] = []
        for index, (batch, timer) in enumerate(zip(batches, timers)):
            if index + 1 < len(batches):  # queued before this batch's loop, so it runs beside it
                encoded.append(self._encode(batches[index + 1], timers[index + 1]))
            conditioning, ready = encoded[index]
            self._hand_over(conditioning, ready, main)
            latents = self._denoise(batch, conditioning, timer)
            encoded[index] = None  # the loop's lane holds what it still reads
            self._hand_over((latents,), self._event(), self.decode_lane)
            decoded.append(self._decode(batch, latents, timer))
            if index > 0:  # the previous batch's pixels, whose decode ran beside this batch's loop
                pixels.append(self._collect(decoded[index - 1], index - 1, done))
        pixels.append(self._collect(decoded[-1], len(batches) - 1, done))
        return pixels

    def _encode(self, batch: Batch, timer: StageTimer) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
        """The batch's text states, on the text lane. The family prepares for the batch first, on the loop's stream,
        as a call does (graphs for new shapes, a ControlNet pipeline's scales); the text lane waits for what that
        queued, which puts this encoding after the previous batch's loop and beside the current one."""
        self.family.prepare(batch)
        if self.overlap:
            self.text_lane.wait_stream(torch.cuda.current_stream(self.device))
        with self._lane(self.text_lane):
            with timer.measure("clip"):
                conditioning = self.family.encode_prompt(batch)
            return conditioning, self._event()

    def _denoise(self, batch: Batch, conditioning: tuple[torch.Tensor, ...], timer: StageTimer) -> torch.Tensor:
        family, head = self.family, batch.head
        generator = batch.generator()
        timesteps = family.timesteps(head.denoising_steps, batch.strength, head.timesteps, (head.height, head.width))
        with timer.measure("vae_encoder") if family.encodes_image else contextlib.nullcontext():
            latents = family.prepare_latents(batch, generator, timesteps)
        with timer.measure("unet"):
            return family.denoise(batch, latents, conditioning, generator, timesteps)

    def _decode(self, batch: Batch, latents: torch.Tensor, timer: StageTimer) -> _Decoded:
        with self._lane(self.decode_lane):
            with timer.measure("vae"):
                images = self.family.decode(latents)
            pixels, finite = pixel_tensor(images), torch.isfinite(images).all()
            if not self.overlap:
                return _Decoded(pixels.cpu(), finite.cpu(), None)
            host = torch.empty(pixels.shape, dtype=pixels.dtype, pin_memory=True)
            host_finite = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(pixels, non_blocking=True)
            host_finite.copy_(finite, non_blocking=True)
            return _Decoded(host, host_finite, self._event())

    def _collect(self, decoded: _Decoded, index: int, done: Callable[[int], None] | None) -> np.ndarray:
        if decoded.done is not None:
            decoded.done.synchronize()
        if not bool(decoded.finite):  # e.g. fp16 overflow: said rather than saved as black images
            warn_not_finite(self.family.dtype, stacklevel=4)
        if done is not None:
            done(index)
        return decoded.pixels.numpy()
