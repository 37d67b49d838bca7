"""Our GroupNorm (+SiLU) kernels at the SD 1.5 UNet's 61 GroupNorm shapes (512x512, batch 2 with guidance), NCHW and
NHWC, for each plugin library given: what a UNet call spends in GroupNorm with each layout and library. Needs a GPU.

    python3 results/group-norm-nhwc/bench_layouts.py OUT_DIR LABEL=LIBRARY.so [LABEL=LIBRARY.so ...]

Each library is called through its C ABI (sdp_group_norm), so an older build of the kernel file alone can stand
beside the current library. Writes OUT_DIR/group-norm-layouts.json, .md and .png; prints the table.
"""

import ctypes
import json
import sys
from pathlib import Path

import torch

# (channels, height * width): how many of the UNet's GroupNorms have that shape (32 groups each), counted with forward
# hooks on diffusers' UNet2DConditionModel built from models/builtin.py's sd1.5-arch config on the meta device.
UNET_SHAPES = {(320, 1024): 1, (320, 4096): 13, (640, 256): 1, (640, 1024): 11, (640, 4096): 2, (960, 1024): 1,
               (960, 4096): 1, (1280, 64): 12, (1280, 256): 11, (1280, 1024): 1, (1920, 256): 1, (1920, 1024): 1,
               (2560, 64): 3, (2560, 256): 2}
BATCH, GROUPS, EPS, CALLS = 2, 32, 1e-5, 200
LAYOUTS = {"NCHW": 0, "NHWC": 1}  # sdplugins.h's SDP_LAYOUT_*


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.sdp_group_norm_workspace_size.argtypes = [ctypes.c_int] * 5
    lib.sdp_group_norm_workspace_size.restype = ctypes.c_size_t
    lib.sdp_group_norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_size_t] + [ctypes.c_int] * 4 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.sdp_group_norm.restype = ctypes.c_int
    return lib


def time_shape(lib, channels: int, hw: int, layout: int) -> float:
    """Mean ms per call over CALLS calls on one stream; the output of the last checked against float32."""
    x = torch.randn(BATCH, channels, hw, device="cuda", dtype=torch.float16) * 2 + 0.5
    x = x if layout == 0 else x.transpose(1, 2).contiguous()
    gamma = torch.randn(channels, device="cuda", dtype=torch.float16)
    beta = torch.randn(channels, device="cuda", dtype=torch.float16)
    y = torch.full_like(x, float("nan"))
    size = lib.sdp_group_norm_workspace_size(BATCH, channels, hw, GROUPS, layout)
    workspace = torch.empty(max(size, 1), device="cuda", dtype=torch.uint8)
    def call(stream):
        status = lib.sdp_group_norm(x.data_ptr(), gamma.data_ptr(), beta.data_ptr(), y.data_ptr(),
                                    workspace.data_ptr(), size, BATCH, channels, hw, GROUPS, EPS, layout, 1, stream)
        assert status == 0, f"sdp_group_norm failed ({status}) at C={channels} HW={hw}"

    call(torch.cuda.current_stream().cuda_stream)
    graph = torch.cuda.CUDAGraph()  # the calls replayed from a graph: kernel time, not Python's launch overhead
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call(torch.cuda.current_stream().cuda_stream)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    reference = torch.nn.functional.silu(torch.nn.functional.group_norm(
        (x if layout == 0 else x.transpose(1, 2)).float(), GROUPS, gamma.float(), beta.float(), EPS))
    got = (y if layout == 0 else y.transpose(1, 2)).float()
    error = ((got - reference).norm() / reference.norm()).item()
    assert error < 1e-3, f"C={channels} HW={hw} layout {layout}: relative error {error}"
    return start.elapsed_time(end) / CALLS


def chart(totals: dict, title: str) -> bytes:
    import io

    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 0.5 * len(totals) + 1.2), layout="constrained")
    axes = figure.add_subplot()
    labels = list(totals)
    axes.barh(labels, [totals[label] for label in labels], color="#dd8452")
    for row, label in enumerate(labels):
        axes.text(totals[label], row, f" {totals[label]:.3f}", va="center")
    axes.set_xlim(0, 1.15 * max(totals.values()))
    axes.invert_yaxis()
    axes.set_xlabel("ms per UNet call in GroupNorm (61 layers)")
    axes.set_title(title, fontsize=9)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not all("=" in arg for arg in argv[1:]):
        print("usage: " + __doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    libraries = {label: load(path) for label, path in (arg.split("=", 1) for arg in argv[1:])}
    rows, totals = [], {}
    for (channels, hw), count in UNET_SHAPES.items():
        row = {"channels": channels, "hw": hw, "count": count}
        for label, lib in libraries.items():
            for layout_name, layout in LAYOUTS.items():
                ms = time_shape(lib, channels, hw, layout)
                row[f"{label} {layout_name}"] = ms
                totals[f"{label} {layout_name}"] = totals.get(f"{label} {layout_name}", 0.0) + ms * count
        rows.append(row)
    gpu = torch.cuda.get_device_name()
    columns = list(totals)
    lines = [f"GroupNorm+SiLU per call (ms, mean of {CALLS} back-to-back calls replayed from a CUDA graph, inputs "
             f"L2-warm), SD 1.5 UNet shapes at 512x512, batch {BATCH}, {GROUPS} groups, on {gpu}", "",
             "| C | H*W | layers | " + " | ".join(columns) + " |", "| ---: | ---: | ---: |" + " ---: |" * len(columns)]
    for row in rows:
        lines.append(f"| {row['channels']} | {row['hw']} | {row['count']} | "
                     + " | ".join(f"{row[c]:.4f}" for c in columns) + " |")
    lines.append("| per UNet call | | 61 | " + " | ".join(f"**{totals[c]:.3f}**" for c in columns) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    (out / "group-norm-layouts.md").write_text(table)
    (out / "group-norm-layouts.json").write_text(json.dumps(
        {"gpu": gpu, "torch": torch.__version__, "batch": BATCH, "groups": GROUPS, "calls": CALLS,
         "libraries": dict(arg.split("=", 1) for arg in argv[1:]), "rows": rows, "per_unet_call_ms": totals},
        indent=1))
    (out / "group-norm-layouts.png").write_bytes(chart(totals, f"Our GroupNorm+SiLU, SD 1.5 UNet shapes — {gpu}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
