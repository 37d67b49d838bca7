"""The throughput path on CUDA (skipped without it): the overlapped stream (demo.pipelines.stream: text encoders, loop
and decode on three CUDA streams) gives exactly each batch's images alone and those of the serial stream, for tiny
(with and without CUDA graphs: eager stages allocate on every lane) and tiny-xl (two text encoders and the added
conditions on the text lane), a smaller last batch's graphs captured mid-stream, each stage with one graph per batch
size; and sd-throughput's rows, overlapped and serial, on tiny."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from bench import throughput
from bench.common import slug
from demo import PipelineSpec, load_pipeline
from demo.backends.torch.options import TorchOptions
from demo.runtime.report import device_name

pytestmark = pytest.mark.gpu

PROMPTS = ("a red circle", "a blue square on the left", "a green triangle", "a small yellow circle", "a white square")


def spec(model: str, cuda_graph: bool) -> PipelineSpec:
    return PipelineSpec(model=model, backend="torch", precision="fp16", plugins="none", use_cuda_graph=cuda_graph,
                        torch=TorchOptions(channels_last=False, compile="none"))


@pytest.mark.parametrize("model, cuda_graph, size", [("tiny", True, 128), ("tiny", False, 128), ("tiny-xl", True, 64)])
def test_the_overlapped_stream_gives_each_batch_its_images_alone(model, cuda_graph, size):
    with load_pipeline(spec(model, cuda_graph)) as pipe:
        head = pipe.request(PROMPTS[0], seed=7, denoising_steps=4, batch_size=4, height=size, width=size,
                            scheduler="EulerA")  # stochastic: the generator's draws must be each batch's own
        # the last call smaller: its graphs are captured mid-stream, while the lanes have work queued
        calls = [[replace(head, prompt=prompt, seed=7 + index, batch_size=4 if index + 1 < len(PROMPTS) else 2)]
                 for index, prompt in enumerate(PROMPTS)]
        alone = [pipe.run(call, pixels=True) for call in calls]
        for _ in range(2):  # the second time the host runs further ahead of the device (everything warm)
            overlapped = pipe.run_stream(calls, overlap=True)
            for index, (pixels, expected) in enumerate(zip(overlapped, alone)):
                assert np.array_equal(pixels, expected), f"batch {index}: {np.abs(pixels.astype(int) - expected).max()}"
        for pixels, expected in zip(pipe.run_stream(calls, overlap=False), alone):
            np.testing.assert_array_equal(pixels, expected)
        assert not np.array_equal(alone[0], alone[1])
        if cuda_graph:  # a graph per stage and batch size, captured once (the VAE encoder: text-to-image runs none)
            ran = {name: len(stage._graphs) for name, stage in pipe.stages.items() if name != "vae_encoder"}
            assert ran == dict.fromkeys(ran, 2)


def test_sd_throughput_measures_both_modes(tmp_path):
    results = tmp_path / "results"
    status = throughput.main(["--model", "tiny", "--denoising-steps", "4", "--batch-sizes", "1,4", "--batches", "3",
                              "--compile", "none", "--plugins", "none", "--use-cuda-graph", "--results-dir",
                              str(results)])
    assert status == 0
    data = json.loads((results / f"throughput-{slug(device_name(torch.device('cuda')))}.json").read_text())
    modes = sorted((row["batch_size"], row["overlap"]) for row in data["rows"])
    assert modes == [(1, False), (1, True), (4, False), (4, True)]
    for row in data["rows"]:
        assert row["images_per_s"] > 0 and row["peak_allocated_bytes"] > 0 and row["capture_s"] is not None
    assert "x |" in (results / (f"throughput-{slug(device_name(torch.device('cuda')))}.md")).read_text()  # vs serial
