"""The PNG charts: pipeline time per GPU and contender, stacked by stage (report-gpus, and the benchmark's
chart of its own rows); the ablation's configurations; our plugin kernels against TensorRT's. Each returns
the PNG's bytes (matplotlib's object API: no pyplot state, no backend to choose)."""

from __future__ import annotations

import io

BAR_HEIGHT = 0.6
STAGE_COLOURS = {"CLIP": "#4c72b0", "UNet": "#dd8452", "VAE": "#55a868", "rest of pipeline": "#c0c0c0"}


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _short_ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def gpu_chart(groups: dict[str, list]) -> bytes:
    """Stacked horizontal bars (CLIP, UNet, VAE, the rest) of pipeline ms; one panel per configuration.
    `groups`: bench.gpu_report.merge's rows under each configuration's title."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    heights = [len(rows) + 1.5 for rows in groups.values()]
    figure = Figure(figsize=(11, 0.42 * sum(heights) + 1.2), dpi=100, layout="constrained")
    axes = figure.subplots(len(groups), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (title, rows) in zip(axes, groups.items()):
        for y, r in enumerate(rows):
            style = {"hatch": "///", "alpha": 0.45, "edgecolor": "black"} if r.published else {"edgecolor": "white"}
            if r.stages_known:
                rest = max(r.pipeline_ms - r.clip_ms - r.unet_ms - r.vae_ms, 0.0)
                left = 0.0
                for colour, width in zip(STAGE_COLOURS.values(), (r.clip_ms, r.unet_ms, r.vae_ms, rest)):
                    ax.barh(y, width, BAR_HEIGHT, left=left, color=colour, linewidth=0.5, **style)
                    left += width
                note = f" {_short_ms(r.pipeline_ms)} ms, UNet {r.unet_ms / r.pipeline_ms:.1%}"
            else:
                ax.barh(y, r.pipeline_ms, BAR_HEIGHT, color="white", linewidth=0.8, **style)
                note = f" {_short_ms(r.pipeline_ms)} ms (stages not published)"
            ax.text(r.pipeline_ms, y, note, va="center", fontsize=8)
        ax.set_yticks(range(len(rows)),
                      [f"{r.device} · {r.label}" + (" (published)" if r.published else f" {r.precision}".rstrip())
                       for r in rows], fontsize=9)
        for tick, r in zip(ax.get_yticklabels(), rows):
            if r.published:
                tick.set_fontstyle("italic")
                tick.set_color("dimgray")
        ax.set_ylim(len(rows) - 0.4, -0.6)  # fastest on top, and a lone row keeps a bar's height
        ax.set_xlim(0, max(r.pipeline_ms for r in rows) * 1.3)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlabel("pipeline ms (CLIP + UNet + VAE + the rest)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=colour, label=name) for name, colour in STAGE_COLOURS.items()]
    if any(r.published for rows in groups.values() for r in rows):
        legend.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                            label="published: NVIDIA demoDiffusion, TensorRT 8.5 + plugins"))
    figure.legend(handles=legend, loc="outside lower center", ncols=len(legend), fontsize=8, frameon=False)
    return _png(figure)


def ablation_chart(rows: list[dict], title: str) -> bytes:
    """The ablation's configurations as stacked bars (CLIP, UNet x N, VAE) of their median latency."""
    from matplotlib.figure import Figure

    labels = [row["label"] for row in rows][::-1]
    figure = Figure(figsize=(9, 0.45 * len(rows) + 1.5), dpi=110, layout="tight")
    ax = figure.subplots()
    left = [0.0] * len(rows)
    for stage, color in (("clip", "#8c9fca"), ("unet", "#4c72b0"), ("vae", "#dd8452")):
        values = [row["latency_ms"][stage] for row in rows][::-1]
        ax.barh(labels, values, left=left, color=color, label=stage.upper() if stage != "unet" else "UNet x N")
        left = [a + b for a, b in zip(left, values)]
    for y, row in enumerate(rows[::-1]):
        ax.text(row["latency_ms"]["pipeline"], y, f" {row['latency_ms']['pipeline']:.1f} ms", va="center", fontsize=8)
    ax.set_xlabel("ms per image (median)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8)  # clear of the bars' labels
    ax.set_xlim(0, max(row["latency_ms"]["pipeline"] for row in rows) * 1.2)
    return _png(figure)


def kernel_chart(comparisons: list[dict], title: str) -> bytes:
    """Per plugin family, our layers' time per UNet call beside TensorRT's (bench.ablation.kernel_comparisons)."""
    from matplotlib.figure import Figure

    labels = [f"{c['family']}\n({c['ours']})" for c in comparisons]
    figure = Figure(figsize=(max(6.0, 1.6 * len(comparisons)), 4), dpi=110, layout="tight")
    ax = figure.subplots()
    places = range(len(comparisons))
    ax.bar([x - 0.2 for x in places], [c["ours_ms"] for c in comparisons], 0.4, label="ours", color="#4c72b0")
    ax.bar([x + 0.2 for x in places], [c["tensorrt_ms"] for c in comparisons], 0.4, label="TensorRT's",
           color="#999999")
    ax.set_xticks(list(places), labels, fontsize=8)
    ax.set_ylabel("ms per UNet call (all layers of the family)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _png(figure)


def throughput_chart(rows: list[dict], yardsticks: dict[str, tuple[float, str] | None] | None = None) -> bytes:
    """Images per second against batch size (bench.throughput's rows): a panel per workload, a line per label, and a
    workload's published yardstick (images/s, what it is) as a dashed line where `yardsticks` has one."""
    from matplotlib.figure import Figure

    workloads: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in rows:
        line = workloads.setdefault(row["workload"], {}).setdefault(row["label"], [])
        line.append((row["batch_size"], row["images_per_s"]))
    figure = Figure(figsize=(9, 4.5 * len(workloads)), dpi=100, layout="constrained")
    axes = figure.subplots(len(workloads), 1, squeeze=False)[:, 0]
    for ax, (title, lines) in zip(axes, workloads.items()):
        for index, (label, points) in enumerate(sorted(lines.items())):
            points.sort()
            ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=label)
            for batch, value in points:  # alternately above and below: lines close together keep their figures apart
                ax.annotate(f"{value:.2f}", (batch, value), textcoords="offset points",
                            xytext=(0, 6 if index % 2 == 0 else -12), fontsize=7, ha="center")
        yardstick = (yardsticks or {}).get(title)
        if yardstick:
            ax.axhline(yardstick[0], color="dimgray", linestyle="--", linewidth=1, label=f"{yardstick[1]}: "
                       f"{yardstick[0]:.2f}")
        batches = sorted({b for points in lines.values() for b, _ in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size (images per call)", fontsize=9)
        ax.set_ylabel("images / s", fontsize=9)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    return _png(figure)
