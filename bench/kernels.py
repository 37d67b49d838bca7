"""Benchmark every plugin op against the best PyTorch path on the same inputs, in one run.

    python scripts/bench_plugins.py [--json bench_plugins.json] [--quick] [--ops fmha,...] [--attention-only]

Shapes: SD 1.5 / 2.1 / XL at 512^2 and 1024^2, batch 2; the transformer ops (rms_norm, ada_layer_norm,
gelu_tanh) at SD3.5 Medium's and Flux's shapes at 1024^2 (4096 image tokens), batch 2, against eager and
torch.compile'd PyTorch. Each candidate is captured in a CUDA graph (several calls, cycling through enough
input sets to defeat L2 reuse) and timed with CUDA events over graph replays; the median replay is
reported per call. Ceilings measured in the same run: a large device-to-device copy (bytes read +
written), a large fp16 matmul, and an fp16 matmul with K = 64 (the shape of an attention product).

Attention runs on each of our paths the GPU has, forced through the environment (ATTENTION_PATH_ENV): on
compute capability 9.0 "ours" is the wgmma/TMA kernel and "ours_mma" the mma.sync one beside it; elsewhere
"ours" is mma.
The peers are PyTorch's SDPA backends (flash, cuDNN, memory-efficient). Rows with a target (issue 10:
B = 2, H = 8 at D = 40 / S = 4096, D = 80 / S = 1024, D = 160 / S = 256, D = 64 / S = 16384, and
cross-attention over 77 tokens at every SD shape) say whether ours reached it against the best peer.
--attention-only runs just the attention rows.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from demo.cli.command import run_command
from demo.cli.flags import Parser, add_flags, flag, parse_flags, summary
from plugins import torch_ops as ops
from plugins.contract import ATTENTION_PATH_ENV

L2_DEFEAT_BYTES = 256 * 2**20


def time_graph(make_call: Callable[[int], Callable[[], object]], sets: int, replays: int = 30) -> float:
    """Median microseconds per call. make_call(i) returns a call on input set i."""
    calls = [make_call(i % sets) for i in range(max(sets, 8))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:  # warm-up: compilation, workspace allocation, autotuning
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    n = 2**30 // 2
    src, dst = torch.randn(n, device="cuda").half(), torch.empty(n, device="cuda", dtype=torch.half)
    copy_us = time_graph(lambda i: lambda: dst.copy_(src), 1, replays=20)
    a, b = torch.randn(8192, 8192, device="cuda").half(), torch.randn(8192, 8192, device="cuda").half()
    mm_us = time_graph(lambda i: lambda: a @ b, 1, replays=10)
    a64, b64 = torch.randn(16, 4096, 64, device="cuda").half(), torch.randn(16, 64, 4096, device="cuda").half()
    mm64_us = time_graph(lambda i: lambda: torch.bmm(a64, b64), 1, replays=10)
    return {"copy_GBps": 2 * n * 2 / copy_us / 1e3, "matmul_fp16_TFLOPs": 2 * 8192**3 / mm_us / 1e6,
            "matmul_fp16_k64_TFLOPs": 2 * 16 * 4096 * 4096 * 64 / mm64_us / 1e6}


@dataclass
class Case:
    op: str
    label: str
    make_inputs: Callable[[], tuple]
    ours: Callable[..., object]
    peers: dict[str, Callable[..., object]]
    flops: float = 0.0  # per call
    bytes: float = 0.0  # minimal bytes moved per call (each input read once, output written once)
    target: float | None = None  # ratio (best peer / ours) asked for
    results: dict[str, float] = field(default_factory=dict)


ATTENTION_OPS = ("fmha", "fmhca")
CROSS_TARGET = 1.5  # cross-attention over 77 tokens, every SD shape
# (head size, sequence length) -> target ratio, for B = 2, H = 8 self-attention
SELF_TARGETS = {(40, 4096): 1.3, (80, 1024): 1.2, (160, 256): 1.2, (64, 16384): 1.1}


def randn(*shape):
    return torch.randn(*shape, device="cuda").half()


def _sdpa_peers(split: Callable) -> dict[str, Callable]:
    peers = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(*inputs, backend=backend):
            q, k, v = split(*inputs)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        peers[name] = call
    return peers


def fmha_case(label: str, b: int, s: int, h: int, d: int, target: float | None = None) -> Case:
    return Case(
        "fmha", label, lambda: (randn(b, s, h, 3, d),),
        lambda qkv: ops.fmha(qkv, 1 / math.sqrt(qkv.shape[-1])),
        _sdpa_peers(lambda qkv: tuple(qkv[:, :, :, i].transpose(1, 2) for i in range(3))),
        flops=4 * b * h * s * s * d, bytes=2 * (b * s * h * 4 * d), target=target)


def attention_cases(model: str, res: int, channels: tuple[int, ...], heads_of: Callable[[int], int]) -> list[Case]:
    cases = []
    for level, c in enumerate(channels):
        s = (res // 8 // 2**level) ** 2
        h = heads_of(c)
        d = c // h
        b = 2
        target = SELF_TARGETS.get((d, s)) if h == 8 else None
        cases.append(fmha_case(f"{model} {res}^2 S={s} H={h} D={d}", b, s, h, d, target))
        cases.append(Case(
            "fmhca", f"{model} {res}^2 Sq={s} Skv=77 H={h} D={d}",
            lambda b=b, s=s, h=h, d=d: (randn(b, s, h, d), randn(b, 77, h, 2, d)),
            lambda q, kv: ops.fmhca(q, kv, 1 / math.sqrt(q.shape[-1])),
            _sdpa_peers(lambda q, kv: (q.transpose(1, 2), kv[:, :, :, 0].transpose(1, 2),
                                       kv[:, :, :, 1].transpose(1, 2))),
            flops=4 * b * h * s * 77 * d, bytes=2 * (2 * b * s * h * d + b * 77 * h * 2 * d), target=CROSS_TARGET))
    return cases


def target_cases(present: list[Case]) -> list[Case]:
    """The issue's self-attention targets (B = 2, H = 8) that the SD shapes above do not already cover."""
    have = {(c.op, c.label.split(" ", 2)[-1]) for c in present}
    cases = []
    for (d, s), target in SELF_TARGETS.items():
        if ("fmha", f"S={s} H=8 D={d}") not in have:
            cases.append(fmha_case(f"target S={s} H=8 D={d}", 2, s, 8, d, target))
    return cases


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def group_norm_silu_case(title: str, b: int, c: int, side: int, eps: float) -> Case:
    """GroupNorm (32 groups) + SiLU on [b, c, side, side], ours against eager and compiled PyTorch."""
    def eager(x, g, be):
        return F.silu(F.group_norm(x, 32, g, be, eps))

    return Case("group_norm_silu", title, lambda: (randn(b, c, side, side), randn(c), randn(c)),
                lambda x, g, be: ops.group_norm(x, g, be, 32, eps, True, False),
                {"eager": eager, "compiled": _compiled(eager)}, bytes=4 * b * c * side * side)


def norm_cases(model: str, res: int, channels: tuple[int, ...]) -> list[Case]:
    cases = []
    for level, c in enumerate(channels):
        side = res // 8 // 2**level
        b, s = 2, side * side
        numel = b * c * s
        cases.append(group_norm_silu_case(f"{model} UNet {res}^2 C={c} {side}x{side}", b, c, side, 1e-5))
        def ln(x, g, be):
            return F.layer_norm(x, (x.shape[-1],), g, be, 1e-5)

        cases.append(Case(
            "layer_norm", f"{model} {res}^2 S={s} C={c}", lambda b=b, s=s, c=c: (randn(b, s, c), randn(c), randn(c)),
            lambda x, g, be: ops.layer_norm(x, g, be, 1e-5), {"eager": ln, "compiled": _compiled(ln)},
            bytes=4 * numel))

        def geglu(x):
            a, gate = x.chunk(2, dim=-1)
            return a * F.gelu(gate)
        cases.append(Case(
            "split_gelu", f"{model} {res}^2 S={s} N={4 * c}", lambda b=b, s=s, c=c: (randn(b, s, 8 * c),),
            lambda x: ops.split_gelu(x, None), {"eager": geglu, "compiled": _compiled(geglu)},
            bytes=2 * (b * s * 8 * c + b * s * 4 * c)))

        def s2s(x, bias, res_):
            return (x + bias).permute(0, 2, 1).reshape(res_.shape) + res_
        cases.append(Case(
            "seq2spatial", f"{model} {res}^2 S={s} C={c}",
            lambda b=b, s=s, c=c, side=side: (randn(b, s, c), randn(c), randn(b, c, side, side)),
            lambda x, bias, res_: ops.seq2spatial(x, bias, res_),
            {"eager": s2s, "compiled": _compiled(s2s)}, bytes=6 * numel))
    return cases


def vae_cases(res: int) -> list[Case]:
    cases = []
    for c, side in ((512, res // 8), (512, res // 4), (512, res // 2), (256, res // 2), (256, res), (128, res)):
        cases.append(group_norm_silu_case(f"VAE {res}^2 C={c} {side}x{side}", 2, c, side, 1e-6))
    return cases


def transformer_cases(model: str, context: int, heads: int, head_dim: int) -> list[Case]:
    """The joint attention over text and image tokens, the Q/K RMSNorm over every head, the AdaLN modulation of the
    image and the text stream, and the feed-forward's GeLU (4x wide, after the Linear's bias) of an SD3/Flux
    transformer at 1024^2 (4096 image tokens), batch 2."""
    b, image, width, eps = 2, 4096, heads * head_dim, 1e-6
    tokens = image + context
    cases = [fmha_case(f"{model} joint S={tokens} H={heads} D={head_dim}", b, tokens, heads, head_dim)]

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def ada(x, scale, shift):
        return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]

    def gelu(x, bias):
        return F.gelu(x + bias, approximate="tanh")

    numel = b * tokens * width
    cases.append(Case("rms_norm", f"{model} S={tokens} H={heads} D={head_dim}",
                      lambda: (randn(b, tokens, heads, head_dim), randn(head_dim)),
                      lambda x, w: ops.rms_norm(x, w, eps), {"eager": rms, "compiled": _compiled(rms)},
                      bytes=4 * numel))
    for stream, s in (("image", image), ("text", context)):
        cases.append(Case("ada_layer_norm", f"{model} {stream} S={s} C={width}",
                          lambda s=s: (randn(b, s, width), randn(b, width), randn(b, width)),
                          lambda x, scale, shift: ops.ada_layer_norm(x, scale, shift, eps),
                          {"eager": ada, "compiled": _compiled(ada)}, bytes=4 * b * s * width))
    cases.append(Case("gelu_tanh", f"{model} S={tokens} N={4 * width}",
                      lambda: (randn(b, tokens, 4 * width), randn(4 * width)), ops.gelu_tanh,
                      {"eager": gelu, "compiled": _compiled(gelu)}, bytes=4 * numel * 4))
    return cases


def all_cases(quick: bool, attention_only: bool = False) -> list[Case]:
    resolutions = (512,) if quick else (512, 1024)
    cases = []
    for res in resolutions:
        cases += attention_cases("SD1.5", res, (320, 640, 1280), lambda c: 8)
        cases += attention_cases("SD2.1", res, (320, 640, 1280), lambda c: c // 64)
        cases += attention_cases("SDXL", res, (640, 1280), lambda c: c // 64)
        if not attention_only:
            cases += norm_cases("SD1.5", res, (320, 640, 1280))
            cases += vae_cases(res)
    if not attention_only:
        cases += transformer_cases("SD3.5-Medium", 333, 24, 64) + transformer_cases("Flux", 512, 24, 128)
    return cases + target_cases(cases)


def attention_paths() -> dict[str, str]:
    """Candidate name -> ATTENTION_PATH_ENV value: both of our paths on compute capability 9.0."""
    if torch.cuda.get_device_capability() == (9, 0):
        return {"ours": "wgmma", "ours_mma": "mma"}
    return {"ours": "mma"}


def _on_path(fn: Callable, path: str) -> Callable:
    def call(*inputs):
        os.environ[ATTENTION_PATH_ENV] = path  # read by the library at every call, so also at capture
        return fn(*inputs)
    return call


def run_case(case: Case) -> None:
    probe = case.make_inputs()
    per_set = sum(t.numel() * t.element_size() for t in probe)
    sets = max(1, min(16, math.ceil(L2_DEFEAT_BYTES / per_set)))
    inputs = [probe] + [case.make_inputs() for _ in range(sets - 1)]
    ours = ({name: _on_path(case.ours, path) for name, path in attention_paths().items()}
            if case.op in ATTENTION_OPS else {"ours": case.ours})
    try:
        for name, fn in {**ours, **case.peers}.items():
            try:
                case.results[name] = time_graph(lambda i, fn=fn: (lambda: fn(*inputs[i])), sets)
            except Exception as exc:  # a backend that does not support the shape is skipped, and said so
                case.results[name] = float("nan")
                print(f"  {case.op} {case.label}: {name} unavailable ({type(exc).__name__}: {str(exc)[:80]})",
                      file=sys.stderr)
    finally:
        os.environ.pop(ATTENTION_PATH_ENV, None)


@dataclass(frozen=True)
class KernelFlags:
    json: str = flag("write the rows here (default: %(default)s)", "bench_plugins.json", metavar="FILE")
    quick: bool = flag("512^2 shapes only", False)
    ops: str | None = flag("comma-separated subset of ops to run (default: all)")
    attention_only: bool = flag("only fmha / fmhca (SD shapes and the target rows), both of our paths where the GPU "
                                "has them", False)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="bench_plugins", description=summary(__doc__))
    add_flags(parser, KernelFlags)
    return run_command("bench_plugins", lambda: bench(parse_flags(parser, argv)[KernelFlags]))


def bench(args: KernelFlags) -> int:
    if not ops.available():
        print(f"plugins unavailable: {ops.status()}", file=sys.stderr)
        return 1
    torch._dynamo.config.cache_size_limit = 256
    device = torch.cuda.get_device_name()
    ceiling = ceilings()
    print(f"# {device}: copy {ceiling['copy_GBps']:.0f} GB/s, fp16 matmul {ceiling['matmul_fp16_TFLOPs']:.0f} TFLOP/s "
          f"(K = 64: {ceiling['matmul_fp16_k64_TFLOPs']:.0f}); attention paths: {attention_paths()}")
    cases = all_cases(args.quick, args.attention_only)
    if args.ops:
        cases = [c for c in cases if c.op in args.ops.split(",")]
    rows = []
    header = (f"{'op':<16} {'shape':<38} {'ours us':>9} {'mma us':>8} {'best torch':>22} {'ratio':>6} {'target':>8} "
              f"{'achieved':>16}")
    print(header)
    print("-" * len(header))
    met = missed = 0
    for case in cases:
        run_case(case)
        peers = {k: v for k, v in case.results.items() if not k.startswith("ours") and not math.isnan(v)}
        best = min(peers, key=peers.get) if peers else "none"
        ours = case.results["ours"]
        ratio = peers[best] / ours if peers else float("nan")
        mma = f"{case.results['ours_mma']:8.1f}" if "ours_mma" in case.results else f"{'-':>8}"
        if case.target is None or math.isnan(ratio):
            verdict = "-"
        else:
            verdict = f"{case.target:.1f}x " + ("ok" if ratio >= case.target else "no")
            met, missed = (met + 1, missed) if ratio >= case.target else (met, missed + 1)
        if case.flops:
            tflops = case.flops / ours / 1e6
            achieved = f"{tflops:.0f} TFLOP/s {100 * tflops / ceiling['matmul_fp16_TFLOPs']:.0f}%"
        else:
            gbps = case.bytes / ours / 1e3
            achieved = f"{gbps:.0f} GB/s {100 * gbps / ceiling['copy_GBps']:.0f}%"
        best_text = best + " " + format(peers[best], ".1f") if peers else "none"
        print(f"{case.op:<16} {case.label:<38} {ours:9.1f} {mma} {best_text:>22} {ratio:6.2f} {verdict:>8} "
              f"{achieved:>16}")
        rows.append({"op": case.op, "shape": case.label, "us": case.results, "best_torch": best, "ratio": ratio,
                     "target": case.target, "flops": case.flops, "bytes": case.bytes})
    if met or missed:
        print(f"# targets: {met} met, {missed} missed (ours = {attention_paths()['ours']})")
    Path(args.json).write_text(json.dumps({"device": device, "ceilings": ceiling, "torch": torch.__version__,
                                           "attention_paths": attention_paths(), "results": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0

