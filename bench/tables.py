"""Markdown tables of the benchmark's and the ablation's measurements (report-gpus makes its own, of merged rows)."""

from __future__ import annotations

from bench.common import ALL, KINDS, ms, workload_title
from bench.contenders import EAGER
from bench.runner import PROFILED_UNET_CALLS
from demo.backends.tensorrt.runtime import TENSORRT_KINDS

# NVIDIA demoDiffusion 8.5 (TensorRT 8.5.2, A100, SD 1.5 UNet x 50, 512x512), ms, for the ablation's cumulative rows.
PUBLISHED_A100_UNET = {"none": 1282.32, "+fMHA/fMHCA": 1047.26, "+LayerNorm": 979.72, "+GroupNorm": 874.51,
                       "+SplitGeLU": 856.47, "+Seq2Spatial": 805.97}


def _s(value) -> str:
    return "—" if value is None else f"{value:.1f}"


def _gib(value) -> str:
    return "—" if value is None else f"{value / 2**30:.2f}"


def benchmark_table(results: dict) -> str:
    """The benchmark's results file as markdown: a table per workload, fastest first, then skips and failures."""
    parts = [f"Benchmark on {results['gpu']} ({results['versions'].get('torch', '?')}; "
             f"{results.get('tensorrt') or 'no TensorRT'}): {results['scheduler']}, guidance "
             f"{results['guidance_scale']}, seed {results['seed']}, medians of {results['runs']} runs after "
             f"{results['warmup_runs']} warm-up run(s); ms. PSNR and max Δ (0-255) against {EAGER}'s image; ready s: "
             "compiling (compile s), capturing (capture s) and engine builds (build s) before any run; peak: "
             "torch.cuda.max_memory_allocated; in use: device memory held at the end, engines' own included; "
             "floor: the denoiser's FLOPs per step (the UNet's or transformer's, any ControlNet's) at the GPU's dense "
             "fp16 peak (bench/floor.py)."]
    workloads = {}
    for row in results.get("rows", []):  # by workload: a model with ControlNets is a workload of its own
        title = row.get("workload") or workload_title(row["model"], row["height"], row["width"], row["batch_size"],
                                                      row["steps"])
        workloads.setdefault(title, []).append(row)
    for title, rows in workloads.items():
        eager = next((r for r in rows if r["label"] == EAGER), None)
        lines = [f"**{title}**", "",
                 "| contender | CLIP | UNet / step | floor / step | VAE | pipeline | vs eager | compile s | capture s "
                 "| build s | peak GiB | in use GiB | PSNR dB | max Δ |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in sorted(rows, key=lambda r: r["latency_ms"]["pipeline"]):
            latency = row["latency_ms"]
            speedup = f"{eager['latency_ms']['pipeline'] / latency['pipeline']:.2f}x" if eager else "—"
            psnr, difference = row.get("psnr_vs_eager_db"), row.get("max_pixel_diff_vs_eager")
            psnr_text = "identical" if difference == 0 else "—" if psnr is None else f"{psnr:.1f}"
            lines.append(f"| {row['label']} | {ms(latency['clip'])} | {ms(row['unet_ms_per_call'])} "
                         f"| {ms(row.get('floor_ms_per_step'))} | {ms(latency['vae'])} | {ms(latency['pipeline'])} "
                         f"| {speedup} | {_s(row.get('compile_s'))} "
                         f"| {_s(row.get('capture_s'))} | {_s(row.get('build_s'))} "
                         f"| {_gib(row.get('peak_allocated_bytes'))} | {_gib(row.get('device_used_bytes'))} "
                         f"| {psnr_text} | {'—' if difference is None else difference} |")
        parts.append("\n".join(lines))
        compared = reference_table(rows)
        if compared:
            parts.append(compared)
        if any("unet_ms_by_kind" in row for row in rows):
            parts.append(layer_kind_table(rows, "contender"))
    for kind in KINDS[1:]:
        for entry in results.get(kind, []):
            parts.append(f"{entry['label']} ({entry['workload']}) {kind}: {entry['reason']}")
    parts.append("Contenders: " + "; ".join(f"{row['label']}: {row['what']}" for row in
                                            {r["label"]: r for r in results.get("rows", [])}.values()))
    return "\n\n".join(parts) + "\n"


def reference_table(rows: list[dict]) -> str:
    """The rows measured against another contender of the same workload (INT8 engines against their fp16 ones,
    diffusers' compiled pipeline against its eager one): time and engine-size ratios, the image, and the UNet's output
    on the same inputs."""
    by_label = {row["label"]: row for row in rows}
    lines = ["| contender | against | UNet / step | pipeline | engines | PSNR dB | max Δ | UNet max abs error "
             "| UNet rel. error | int8 layers in the engine / quantized |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        other = by_label.get(row.get("reference"))
        if other is None:
            continue
        error = row.get("unet_error_vs_reference")
        size = (f"{row['engine_bytes'] / other['engine_bytes']:.2f}x" if row.get("engine_bytes")
                and other.get("engine_bytes") else "—")
        psnr, difference = row.get("psnr_vs_reference_db"), row.get("max_pixel_diff_vs_reference")
        step = row["unet_ms_per_call"] / other["unet_ms_per_call"]
        lines.append(f"| {row['label']} | {other['label']} | {step:.2f}x "
                     f"| {row['latency_ms']['pipeline'] / other['latency_ms']['pipeline']:.2f}x | {size} "
                     f"| {'identical' if difference == 0 else _s(psnr)} | {'—' if difference is None else difference} "
                     f"| {'—' if error is None else format(error['max_abs'], '.4f')} "
                     f"| {'—' if error is None else format(error['rel_l2'], '.4f')} "
                     f"| {row.get('unet_int8_layers', '—')} / {row.get('unet_quantized_layers') or '—'} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def ablation_table(rows: list[dict], gpu: str, trt_version: str) -> str:
    """Latency per configuration against none, plugin layers found in the engines against the passes' count,
    images against none's, and NVIDIA's published A100 UNet figures beside the cumulative rows."""
    lines = [f"Plugin ablation on {gpu}, TensorRT {trt_version}: sd1.5-arch engines, medians (ms); "
             "A100 column: NVIDIA's published demoDiffusion 8.5 UNet x 50 (TensorRT 8.5.2).", "",
             "| configuration | CLIP | UNet x N | VAE | pipeline | vs none | plugin layers (engine = passes) "
             "| PSNR vs none | A100 UNet x 50 (published) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    base = rows[0]["latency_ms"]["pipeline"] if rows and rows[0]["label"] == "none" else None
    for row in rows:
        latency = row["latency_ms"]
        counts = sum(sum(stage["engine"].values()) for stage in row["plugin_layers"].values())
        match = all(stage["match"] for stage in row["plugin_layers"].values())
        ratio = f"{base / latency['pipeline']:.3f}x" if base else "—"
        psnr_text = "—" if row["label"] == "none" or row["psnr_vs_none"] is None else f"{row['psnr_vs_none']:.1f} dB"
        published = PUBLISHED_A100_UNET.get(row["label"])
        lines.append(f"| {row['label']} | {latency['clip']:.2f} | {latency['unet']:.2f} | {latency['vae']:.2f} "
                     f"| {latency['pipeline']:.2f} | {ratio} | {counts} ({'yes' if match else 'NO'}) | {psnr_text} "
                     f"| {published if published else '—'} |")
    return "\n".join(lines) + "\n"


def layer_kind_table(rows: list[dict], first_column: str) -> str:
    """The UNet engine's time per call by layer kind, a row per measured engine set (rows with "unet_ms_by_kind")."""
    kinds = [*ALL, *TENSORRT_KINDS]
    lines = [f"UNet time per call by layer kind (ms; TensorRT's per-layer profiler, mean of {PROFILED_UNET_CALLS} "
             "calls on the last step's inputs; the profiler's events between layers add to the total):", "",
             f"| {first_column} | {' | '.join(kinds)} | total |", f"| --- |{' ---: |' * (len(kinds) + 1)}"]
    for row in rows:
        if "unet_ms_by_kind" in row:
            by_kind = row["unet_ms_by_kind"]
            cells = [f"{by_kind[kind]:.3f}" if kind in by_kind else "—" for kind in kinds]
            lines.append(f"| {row['label']} | {' | '.join(cells)} | {sum(by_kind.values()):.3f} |")
    return "\n".join(lines)


def kernel_table(rows: list[dict], comparisons: list[dict]) -> str:
    """The UNet's time per call by layer kind in every configuration, then each plugin family of ours
    against TensorRT's own in the peer configurations (bench.ablation.kernel_comparisons), family by family."""
    lines = [layer_kind_table(rows, "configuration")]
    if comparisons:
        lines += ["", "Ours against TensorRT 8.6's own plugins, family by family (ms per UNet call):", "",
                  "| family | ours | TensorRT's | TensorRT's / ours | configurations |",
                  "| --- | ---: | ---: | ---: | --- |"]
        lines += [f"| {c['family']} | {c['ours_ms']:.3f} | {c['tensorrt_ms']:.3f} | "
                  f"{c['tensorrt_ms'] / c['ours_ms']:.2f}x | {c['ours']} / {c['tensorrt']} |" for c in comparisons]
    return "\n".join(lines) + "\n"
