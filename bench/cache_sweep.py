"""The step cache's curve (sd-quality --cache-sweep): for the uncached run and each interval:branch, the yardstick's
exact match and how much of the picture changed against the uncached run (with scenes: SSIM and object-mask IoU
against its images, with 95% intervals), beside its speed relative to it (timed after warm-up); as JSON, a markdown
table and a chart of exact match against speedup."""

from __future__ import annotations

import datetime
import io

from demo.request import TEXT_TO_IMAGE

SWEEP_VERSION = 2  # 2: speed timed after warm-up (its first call apart); with scenes, fidelity
LABEL_OFFSETS = (5, -11, 15)  # points above a point's marker (negative: below)
FIDELITY_COLUMNS = {"ssim": "SSIM vs uncached", "mask_iou": "mask IoU vs uncached"}


def sweep_summary(reports: list[dict], command: str) -> dict:
    """One row per sd-quality report (the uncached run first): the cache's settings, per kind of case the exact
    match, the share of readings changed against the uncached run, images per second and the speedup over it."""
    uncached = reports[0]
    rows = []
    for report in reports:
        settings = report["settings"]
        changed = (report.get("reference") or {}).get("changed", {}).get("share", {})
        fidelity = (report.get("reference") or {}).get("fidelity")
        rows.append({
            "cache_interval": settings.get("cache_interval", 1),
            "cache_branch": settings.get("cache_branch"),
            "exact_match": {mode: figures["exact_match"] for mode, figures in report["summary"].items()},
            "changed_vs_uncached": changed.get("any", 0.0),
            "images_per_s": report["images_per_s"],
            "first_call_s": report["speed"]["first_call_s"],
            "speedup": report["images_per_s"] / uncached["images_per_s"],
            **({"fidelity": {metric: fidelity["summary"][metric]["value"] for metric in FIDELITY_COLUMNS}}
               if fidelity else {}),
        })
    settings = uncached["settings"]
    return {"tool": "sd-quality --cache-sweep", "version": SWEEP_VERSION, "command": command,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": uncached["model"],
            "set_version": uncached["set_version"], "device": settings["device"], "backend": settings["backend"],
            "precision": settings["precision"], "steps": settings["steps"], "scheduler": settings["scheduler"],
            "guidance_scale": settings["guidance_scale"], "options": settings["options"],
            "versions": uncached["versions"], "rows": rows}


def _label(row: dict) -> str:
    return "uncached" if row["cache_branch"] is None else f"N={row['cache_interval']}, K={row['cache_branch']}"


def sweep_table(summary: dict) -> str:
    from bench.fidelity import interval_text

    modes = list(summary["rows"][0]["exact_match"])
    fidelity = any("fidelity" in row for row in summary["rows"])
    head = ["step cache", *(f"exact match, {mode}" for mode in modes), "readings changed vs uncached",
            *(FIDELITY_COLUMNS.values() if fidelity else ()), "images/s", "first call s", "speedup"]
    lines = [f"sd-quality --cache-sweep: {summary['model']} (case set v{summary['set_version']}) on "
             f"{summary['backend']} ({summary['precision']}, {summary['device']}), {summary['scheduler']}, "
             f"{summary['steps']} steps, guidance {summary['guidance_scale']}, {summary['date'][:10]}", "",
             "| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for row in summary["rows"]:
        cells = [_label(row), *(f"{100 * row['exact_match'][mode]:.1f}%" for mode in modes),
                 f"{100 * row['changed_vs_uncached']:.1f}%",
                 *((interval_text(row.get("fidelity", {}).get(metric)) for metric in FIDELITY_COLUMNS) if fidelity
                   else ()),
                 f"{row['images_per_s']:.2f}", f"{row['first_call_s']:.1f}",
                 f"{row['speedup']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sweep_chart(summary: dict) -> bytes:
    """Text-to-image exact match against speedup, a point per row, each labelled."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    ax = figure.subplots()
    rows = [row for row in summary["rows"] if TEXT_TO_IMAGE in row["exact_match"]]
    # labels take turns at three heights along the speed axis: neighbours often share an exact match
    offset = {id(row): LABEL_OFFSETS[index % len(LABEL_OFFSETS)]
              for index, row in enumerate(sorted(rows, key=lambda row: row["speedup"]))}
    for branch in sorted({row["cache_branch"] for row in rows}, key=lambda b: -1 if b is None else b):
        chosen = sorted((row for row in rows if row["cache_branch"] == branch), key=lambda row: row["speedup"])
        ax.plot([row["speedup"] for row in chosen], [100 * row["exact_match"][TEXT_TO_IMAGE] for row in chosen],
                marker="o", label="uncached" if branch is None else f"branch {branch}")
        for row in chosen:
            ax.annotate(_label(row), (row["speedup"], 100 * row["exact_match"][TEXT_TO_IMAGE]), fontsize=7,
                        textcoords="offset points", xytext=(4, offset[id(row)]))
    ax.set_xlabel(f"speedup over the uncached run (images/s, {summary['model']})")
    ax.set_ylabel("text-to-image exact match (%)")
    ax.set_title(f"step cache: {summary['model']} on {summary['backend']} {summary['precision']}, "
                 f"{summary['device']}, {summary['steps']} steps", fontsize=9)
    ax.margins(x=0.12, y=0.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
