"""What a request at concurrency 1 costs on its way through the client, Triton and PyTriton alone: a model with
sd-serve's txt2img inputs and outputs whose inference function answers a 512x512 image after WAIT ms (at once, or
sleeping as a GPU's process is waited on), asked by sd-serve's client (demo/serve/client.py) over HTTP and gRPC.
Prints a table; writes triton_path.json and triton_path.png into the folder given. Needs the `serve` extra.
    python results/serve-gpus/triton_path_bench.py results/serve-gpus/triton-path-cpu-2026-11-26"""

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from demo.pipeline import TEXT_TO_IMAGE  # noqa: E402
from demo.serve.client import connect, generate  # noqa: E402
from demo.serve.schema import BATCH_SIZE, ERROR, IMAGE  # noqa: E402
from demo.serve.server import bind_model, import_pytriton, put_triton_libraries_first  # noqa: E402
from demo.serve.workers import SERVER_SWITCH_INTERVAL_S  # noqa: E402

WAITS_MS = (0, 20, 200)
REQUESTS, SKIPPED = 60, 10  # the first ones warm the connection up
HTTP_PORT = 8300


def serve(wait: dict):
    """Triton with the stand-in model on HTTP_PORT (gRPC the next port); `wait["ms"]` is read at each call."""
    triton_api = import_pytriton()
    put_triton_libraries_first()
    image = np.random.default_rng(0).integers(0, 256, (1, 512, 512, 3), dtype=np.uint8)

    def answer(requests):
        time.sleep(wait["ms"] / 1000)
        return [{IMAGE: image, BATCH_SIZE: np.array([[1]], np.int32), ERROR: np.array([[b""]], np.bytes_)}
                for _ in requests]

    config = triton_api.TritonConfig(http_address="127.0.0.1", grpc_address="127.0.0.1", metrics_address="127.0.0.1",
                                     http_port=HTTP_PORT, grpc_port=HTTP_PORT + 1, metrics_port=HTTP_PORT + 2)
    triton = triton_api.Triton(config=config, triton_lifecycle_policy=triton_api.TritonLifecyclePolicy(
        launch_triton_on_startup=False, local_model_store=True))
    bind_model(triton, TEXT_TO_IMAGE, [answer], max_batch_size=4, max_queue_delay_ms=0)
    triton.run()
    return triton


def overhead_ms(protocol: str, wait_ms: float) -> float:
    """Median ms a request took beyond the inference function's wait."""
    module, client = connect(f"127.0.0.1:{HTTP_PORT + (protocol == 'grpc')}", protocol)
    took = []
    for seed in range(REQUESTS):
        values = {"prompt": "a photo of an astronaut riding a horse on mars", "seed": seed, "denoising_steps": 30,
                  "height": 512, "width": 512}
        start = time.perf_counter()
        generate(module, client, values)
        took.append((time.perf_counter() - start) * 1000 - wait_ms)
    return statistics.median(took[SKIPPED:])


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)  # as in sd-serve's process
    wait = {"ms": 0}
    triton = serve(wait)
    rows = []
    try:
        for wait_ms in WAITS_MS:
            wait["ms"] = wait_ms
            for protocol in ("http", "grpc"):
                rows.append({"wait_ms": wait_ms, "protocol": protocol, "overhead_ms": overhead_ms(protocol, wait_ms)})
                print(f"wait {wait_ms:>3} ms, {protocol:<4}: {rows[-1]['overhead_ms']:.2f} ms beyond it", flush=True)
    finally:
        triton.stop()
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "requests": REQUESTS,
              "skipped": SKIPPED, "rows": rows}
    (out / "triton_path.json").write_text(json.dumps(result, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for shift, protocol in ((-0.2, "http"), (0.2, "grpc")):
        mine = [row for row in rows if row["protocol"] == protocol]
        ax.bar([i + shift for i in range(len(mine))], [row["overhead_ms"] for row in mine], 0.4, label=protocol)
    ax.set_xticks(range(len(WAITS_MS)), [f"answer after {ms} ms" for ms in WAITS_MS])
    ax.set_ylabel("ms beyond the answer (median)")
    ax.set_title(f"A request's way through Triton and PyTriton ({os.cpu_count()} CPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "triton_path.png", dpi=100)


if __name__ == "__main__":
    main()
