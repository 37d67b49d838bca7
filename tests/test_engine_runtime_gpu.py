"""The engine runtime's stream and CUDA-graph plumbing on a real GPU, with torch work standing in
for TensorRT's execute_async_v3 (no TensorRT flavour can execute engines on the GPUs we have)."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on any, Hopper included)")
@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_stream_executor_orders_work_and_replays_graphs(use_cuda_graph):
    from demo.engine import StreamExecutor

    source = torch.empty(1 << 22, device="cuda")
    target = torch.full_like(source, float("nan"))

    def enqueue(stream):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.mul(source, 2, out=target)

    executor = StreamExecutor(enqueue, use_cuda_graph)
    for step in range(4):
        source.copy_(torch.randn_like(source))  # queued on torch's stream before the executor runs
        executor()
        result = target * 1  # queued on torch's stream after it: must see the finished output
        torch.testing.assert_close(result, source * 2)
    assert (executor.graph is not None) == use_cuda_graph
