"""How long a batch of images takes to reach sd-serve's process from a device's process (demo/serve/workers.py), with
0, 1 and 2 other threads busy in the receiving process (as PyTriton's and the other GPUs' are): by the pipe alone at
Python's default switch interval (sd-serve before), by _send's shared memory, and by both with the server's switch
interval (sd-serve now). Prints a table, writes transfer.json and transfer.png into the folder given.
    python results/serve-gpus/transfer_bench.py results/serve-gpus/transfer-cpu-2026-11-26"""

import json
import multiprocessing
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from demo.serve.workers import SERVER_SWITCH_INTERVAL_S, _receive_value, _send  # noqa: E402

BATCH = (4, 512, 512, 3)
ROUND_TRIPS = 20


def reply(connection, shared: bool) -> None:
    """The device's side: a batch of images for every request, until None."""
    images = np.random.default_rng(0).integers(0, 256, BATCH, dtype=np.uint8)
    while (_receive_value(connection) if shared else connection.recv()) is not None:
        _send(connection, images) if shared else connection.send(images)


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def measure(shared: bool, busy: int, switch_interval: float) -> float:
    """Median ms from asking to holding the batch."""
    sys.setswitchinterval(switch_interval)
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    process = spawn.Process(target=reply, args=(theirs, shared))
    process.start()
    stop = threading.Event()
    spinners = [threading.Thread(target=spin, args=(stop,)) for _ in range(busy)]
    for thread in spinners:
        thread.start()
    times = []
    for _ in range(ROUND_TRIPS + 2):  # the first two warm up
        start = time.perf_counter()
        if shared:
            _send(ours, "batch")
            images = _receive_value(ours)
        else:
            ours.send("batch")
            images = ours.recv()
        times.append((time.perf_counter() - start) * 1000)
        assert images.shape == BATCH
    stop.set()
    for thread in spinners:
        thread.join()
    _send(ours, None) if shared else ours.send(None)
    process.join()
    return statistics.median(times[2:])


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    default = sys.getswitchinterval()
    ways = {"pipe": (False, default), "shared memory": (True, default),
            f"shared memory, switch {SERVER_SWITCH_INTERVAL_S * 1000:g} ms": (True, SERVER_SWITCH_INTERVAL_S)}
    rows = [{"busy_threads": busy, **{way: measure(shared, busy, interval) for way, (shared, interval) in ways.items()}}
            for busy in (0, 1, 2)]
    lines = [f"A batch of {BATCH[0]} images of {BATCH[1]}x{BATCH[2]} ({np.prod(BATCH) / 2**20:.0f} MiB), median of "
             f"{ROUND_TRIPS} round trips, {platform.node()} ({multiprocessing.cpu_count()} CPUs):", "",
             f"| busy threads | {' | '.join(f'{way}: ms' for way in ways)} |", f"| ---: |{' ---: |' * len(ways)}"]
    lines += [f"| {row['busy_threads']} | {' | '.join(f'{row[way]:.1f}' for way in ways)} |" for row in rows]
    print("\n".join(lines))
    (out / "transfer.md").write_text("\n".join(lines) + "\n")
    (out / "transfer.json").write_text(json.dumps({"batch": BATCH, "round_trips": ROUND_TRIPS, "cpus":
                                                   multiprocessing.cpu_count(), "default_switch_interval_s": default,
                                                   "ms": rows}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    x, width = np.arange(len(rows)), 0.8 / len(ways)
    for index, way in enumerate(ways):
        axes.bar(x + (index - (len(ways) - 1) / 2) * width, [row[way] for row in rows], width, label=way)
    axes.set_xticks(x, [f"{row['busy_threads']} busy" for row in rows])
    axes.set_ylabel("ms per batch of four 512x512")
    axes.set_title("Images from a device's process to sd-serve's")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "transfer.png", dpi=100)


if __name__ == "__main__":
    main()
