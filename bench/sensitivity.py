"""sd-quality --sensitivity: what the `scenes` yardstick sees of each path, as a table and a chart.

Each row renders the case set one way and is compared, image by image, with an fp32 reference (torch, eager, no
plugins, at --max-batch-size); the noise floor is the same fp32 path at half that batch (two exact runs). The fp16
row (torch, eager, no plugins) is tested against that floor; every other row runs in fp16 and is tested against the
fp16 row, the exact path of its own precision: a fast path is flagged when it loses more than fp16 itself does, by
more than a metric's margin (bench.fidelity). Rows:

    fp16                 the exact path in fp16
    cache:N[:K]          the step cache, every Nth UNet call whole, branch K (default 0)
    threshold:T[:K]      the adaptive step cache at threshold T, branch K (default 0)
    forecast:T           the adaptive step cache at threshold T with its forecast (SD3, Flux: --cache-forecast)
    vae:P                the VAE in precision P (fp32, bf16, fp16), the rest in fp16
    fp8[:S]              precision fp8: the UNet's GEMMs in FP8 e4m3 (models.fp8), scaled S (static, dynamic,
                         row; default: the default's), the rest in fp16
    compile              torch.compile (mode default)
    cuda-graphs          the torch backend's CUDA graphs
    plugins              the torch backend with our kernels (all plugins)
    engines              TensorRT engines with the plugins (auto)
    engines-no-plugins   TensorRT engines without them

With DEMO_DIFFUSION_PLANTED_FAULTS=1 in the environment (a test-only switch: docs/quality.md), rows planted:NAME
also run the fp16 path with one planted fault (demo.backends.torch.planted): what the yardstick must flag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import os

from core.errors import UsageError

SENSITIVITY_VERSION = 1
PLANTING = "DEMO_DIFFUSION_PLANTED_FAULTS"  # the test-only switch that lets rows plant faults
FIXED_ROWS = ("fp16", "fp8", "compile", "cuda-graphs", "plugins", "engines", "engines-no-plugins")
BASELINE_ROW = "fp16"


@contextlib.contextmanager
def planting(fault: str | None):
    """The torch backend loads with `fault` planted (None: nothing changes)."""
    if fault is None:
        yield
        return
    from demo.backends.torch.planted import PLANTED_FAULT_ENV as SWITCH

    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = fault
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before


def planted_faults() -> tuple[str, ...]:
    from demo.backends.torch.planted import FAULTS

    return tuple(FAULTS)


def parse_rows(text: str) -> list[str]:
    """--sensitivity's rows, checked (a UsageError for anything else), the fp16 row first whether listed or not."""
    rows = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item.startswith("cache:"):
            numbers = item.split(":")[1:]
            if not (1 <= len(numbers) <= 2 and all(n.isdigit() for n in numbers) and int(numbers[0]) >= 2):
                raise UsageError(f"--sensitivity: a cache row is cache:N or cache:N:K (N 2 or more), got '{item}'")
            item = f"cache:{int(numbers[0])}:{int(numbers[1]) if len(numbers) == 2 else 0}"
        elif item.startswith(("threshold:", "forecast:")):
            item = threshold_row(item)
        elif item.startswith("fp8:"):
            from models.families import FP8_SCALES

            if item.split(":", 1)[1] not in FP8_SCALES:
                raise UsageError(f"--sensitivity: an FP8 row is fp8 or fp8:S, S one of {', '.join(FP8_SCALES)}, got "
                                 f"'{item}'")
        elif item.startswith("vae:"):
            from models.source import VAE_PRECISIONS

            if item.split(":", 1)[1] not in VAE_PRECISIONS:
                raise UsageError(f"--sensitivity: a VAE row is vae:P, P one of {', '.join(VAE_PRECISIONS)}, got "
                                 f"'{item}'")
        elif item.startswith("planted:"):
            if os.environ.get(PLANTING) != "1":
                raise UsageError(f"--sensitivity: '{item}' plants a fault, for testing the yardstick only: set "
                                 f"{PLANTING}=1 to run it")
            if item.split(":", 1)[1] not in planted_faults():
                raise UsageError(f"--sensitivity: no planted fault '{item.split(':', 1)[1]}'; there are "
                                 f"{', '.join(planted_faults())}")
        elif item not in FIXED_ROWS:
            raise UsageError(f"--sensitivity: unknown row '{item}'; rows are {', '.join(FIXED_ROWS)}, cache:N[:K], "
                             "threshold:T[:K], forecast:T, fp8:S, vae:P and (test-only) planted:NAME")
        if item in rows:
            raise UsageError(f"--sensitivity: row '{item}' given twice")
        rows.append(item)
    if not rows:
        raise UsageError("--sensitivity names no row")
    return [BASELINE_ROW, *(row for row in rows if row != BASELINE_ROW)]


def threshold_row(item: str) -> str:
    """A threshold:T[:K] row, checked (T a finite number above 0, K a branch), as threshold:T:K; a forecast:T row
    (no branch: the transformers') as forecast:T."""
    kind, *parts = item.split(":")
    try:
        threshold = float(parts[0]) if parts else float("nan")
    except ValueError:
        threshold = float("nan")
    most = 2 if kind == "threshold" else 1
    if not (1 <= len(parts) <= most and 0 < threshold < float("inf") and all(n.isdigit() for n in parts[1:])):
        shapes = "threshold:T or threshold:T:K" if kind == "threshold" else "forecast:T"
        raise UsageError(f"--sensitivity: an adaptive cache row is {shapes} (T above 0), got '{item}'")
    if kind == "forecast":
        return f"forecast:{threshold:g}"
    return f"threshold:{threshold:g}:{int(parts[1]) if len(parts) == 2 else 0}"


def row_spec(exact, row: str):
    """The spec a row renders with: `exact` (the fp32 reference's) in fp16, changed as the row says; and the
    planted fault it runs with (None: none)."""
    from demo.backends.torch.options import TorchOptions

    spec = dataclasses.replace(exact, precision="fp16")
    fault = None
    if row.startswith("cache:"):
        _, interval, branch = row.split(":")
        spec = dataclasses.replace(spec, cache_interval=int(interval), cache_branch=int(branch))
    elif row.startswith("threshold:"):
        _, threshold, branch = row.split(":")
        spec = dataclasses.replace(spec, cache_threshold=float(threshold), cache_branch=int(branch))
    elif row.startswith("forecast:"):
        spec = dataclasses.replace(spec, cache_threshold=float(row.split(":")[1]), cache_forecast=True)
    elif row.startswith("planted:"):
        fault = row.split(":", 1)[1]
    elif row.startswith("vae:"):
        spec = dataclasses.replace(spec, vae_precision=row.split(":", 1)[1])
    elif row == "fp8" or row.startswith("fp8:"):
        scales = row.split(":", 1)[1] if ":" in row else spec.torch.fp8_scales
        spec = dataclasses.replace(spec, precision="fp8", torch=dataclasses.replace(spec.torch, fp8_scales=scales))
    elif row == "compile":
        spec = dataclasses.replace(spec, torch=TorchOptions(channels_last=False, compile="default"))
    elif row == "cuda-graphs":
        spec = dataclasses.replace(spec, use_cuda_graph=True)
    elif row == "plugins":
        spec = dataclasses.replace(spec, plugins="all")
    elif row in ("engines", "engines-no-plugins"):
        spec = dataclasses.replace(spec, backend="tensorrt", plugins="auto" if row == "engines" else "none",
                                   use_cuda_graph=None, torch=TorchOptions())
    return spec, fault


def exact_spec(spec):
    """The reference's path: torch, fp32, eager, no plugins, no CUDA graphs, no cache."""
    from demo.backends import TORCH
    from demo.backends.torch.options import TorchOptions

    return dataclasses.replace(spec, backend=TORCH, precision="fp32", plugins="none", use_cuda_graph=False,
                               torch=TorchOptions(channels_last=False, compile="none"), cache_interval=1,
                               cache_threshold=0.0, cache_forecast=False)


def sensitivity_summary(reference: dict, floor: tuple[dict, str], rows: list[tuple[str, dict, str]],
                        failed: list[dict], command: str) -> dict:
    """One entry per row (its name, its report's path, fidelity summary, exact match, speed), the floor's the same
    way; the rows that could not run, with why; what the reference is."""
    def row_entry(name: str, report: dict, path: str, baseline: str) -> dict:
        return {"row": name, "report": path, "baseline": baseline,
                "settings": {k: report["settings"][k] for k in ("backend", "precision", "plugins", "options",
                                                               "cache_interval", "cache_branch")},
                "cache_threshold": report["settings"].get("cache_threshold", 0.0),
                "exact_match": report["summary"]["text-to-image"]["exact_match"],
                "images_per_s": report["images_per_s"], "fidelity": report["reference"]["fidelity"]["summary"]}

    settings = reference["settings"]
    return {"tool": "sd-quality --sensitivity", "version": SENSITIVITY_VERSION, "command": command,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": reference["model"],
            "yardstick": reference["yardstick"], "set_version": reference["set_version"],
            "cases": len(reference["cases"]), "device": settings["device"], "steps": settings["steps"],
            "scheduler": settings["scheduler"], "guidance_scale": settings["guidance_scale"],
            "versions": reference["versions"],
            "reference": {"batch": reference["settings"]["max_batch_size"],
                          "exact_match": reference["summary"]["text-to-image"]["exact_match"],
                          "accuracy": reference["summary"]["text-to-image"]["accuracy"]},
            "floor": row_entry(f"floor: fp32 at batch {floor[0]['settings']['max_batch_size']}", *floor, "—"),
            "rows": [row_entry(name, report, path, "floor" if name == BASELINE_ROW else BASELINE_ROW)
                     for name, report, path in rows],
            "cache_curve": cache_curve(rows),
            "failed": failed}


CURVE_METRICS = ("ssim", "mask_iou")


def cache_curve(rows: list[tuple[str, dict, str]]) -> list[dict]:
    """Each step of the step cache's curve (consecutive intervals of one branch): the paired bootstrap interval of
    how much more the longer interval loses, per case, against the reference (SSIM and mask IoU losses); `beyond`:
    the interval lies wholly above zero, so the longer interval is worse on these cases, not by chance."""
    from bench.fidelity import loss, paired_excess

    cached = sorted(((int(name.split(":")[2]), int(name.split(":")[1]), report) for name, report, _ in rows
                     if name.startswith("cache:")), key=lambda item: item[:2])
    steps = []
    for (branch, shorter, before), (same_branch, longer, after) in zip(cached, cached[1:]):
        if branch != same_branch:
            continue
        earlier = {case["id"]: case["fidelity"] for case in before["cases"]}
        cases = [case for case in after["cases"] if case["id"] in earlier]
        figures = {metric: paired_excess([loss(metric, case["fidelity"][metric]) for case in cases],
                                         [loss(metric, earlier[case["id"]][metric]) for case in cases], margin=0.0)
                   for metric in CURVE_METRICS}
        steps.append({"branch": branch, "from": shorter, "to": longer,
                      **{metric: {key: figures[metric][key] for key in ("mean", "low", "high", "n")}
                         for metric in CURVE_METRICS},
                      "beyond": {metric: figures[metric]["flagged"] for metric in CURVE_METRICS}})
    return steps


TABLE_METRICS = (("ssim", "SSIM", 4), ("mask_iou", "mask IoU", 4), ("colour_distance", "colour distance", 2),
                 ("frequency_error", "pattern freq. error", 4), ("centroid_shift", "centroid shift px", 2))


def sensitivity_table(summary: dict) -> str:
    from bench.fidelity import interval_text

    head = ["path", "against", *(label for _, label, _ in TABLE_METRICS), "exact match", "flagged (by)",
            "images/s"]
    lines = [f"sd-quality --sensitivity: {summary['model']} ({summary['yardstick']} case set "
             f"v{summary['set_version']}, {summary['cases']} images) on {summary['device']}, "
             f"{summary['scheduler']}, {summary['steps']} steps, "
             f"guidance {summary['guidance_scale']}, {summary['date'][:10]}; each figure a mean against the fp32 "
             f"reference (batch {summary['reference']['batch']}, exact match "
             f"{100 * summary['reference']['exact_match']:.1f}%) with its bootstrap 95% interval", "",
             "| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * len(TABLE_METRICS) + " ---: | --- | ---: |"]
    for entry in [summary["floor"], *summary["rows"]]:
        fidelity = entry["fidelity"]
        flagged = fidelity.get("flagged")
        verdict = "—" if flagged is None else ("**yes** (" + ", ".join(fidelity["flagged_by"]) + ")" if flagged
                                              else "no")
        cells = [entry["row"], entry["baseline"],
                 *(interval_text(fidelity[metric]["value"], digits) for metric, _, digits in TABLE_METRICS),
                 f"{100 * entry['exact_match']:.1f}%", verdict, f"{entry['images_per_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"| {entry['row']} | cannot run here: {entry['reason']} |" + " |" * (len(head) - 2)
              for entry in summary["failed"]]
    if summary["cache_curve"]:
        lines += ["", "| the step cache's curve, each step paired case by case | more SSIM loss [95%] | more mask IoU "
                  "loss [95%] | worse beyond chance |", "| --- | ---: | ---: | --- |"]
        for step in summary["cache_curve"]:
            worse = [metric for metric in CURVE_METRICS if step["beyond"][metric]]
            lines.append(f"| N={step['from']} to N={step['to']} (branch {step['branch']}) | "
                         f"{interval_text(step['ssim'])} | {interval_text(step['mask_iou'])} | "
                         f"{', '.join(worse) if worse else 'no'} |")
    return "\n".join(lines) + "\n"


def sensitivity_chart(summary: dict) -> bytes:
    """Each row's SSIM loss (1 - SSIM) against the reference with its interval, flagged rows in red."""
    from matplotlib.figure import Figure

    entries = [summary["floor"], *summary["rows"]]
    figure = Figure(figsize=(8, 0.4 * len(entries) + 1.6), dpi=100, layout="constrained")
    ax = figure.subplots()
    for y, entry in enumerate(entries):
        ssim = entry["fidelity"]["ssim"]["value"]
        if ssim["mean"] is None:
            continue
        loss, low, high = 1 - ssim["mean"], 1 - ssim["high"], 1 - ssim["low"]
        colour = "#c44e52" if entry["fidelity"].get("flagged") else "#4c72b0"
        ax.errorbar([max(loss, 1e-6)], [y], xerr=[[loss - low], [high - loss]], fmt="o", color=colour, capsize=3)
    ax.set_yticks(range(len(entries)), [entry["row"] for entry in entries], fontsize=8)
    ax.set_ylim(len(entries) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.set_xlabel("1 - SSIM against the fp32 reference (mean, 95% interval; red: flagged)")
    ax.set_title(f"scenes sensitivity: {summary['model']} on {summary['device']}, {summary['steps']} steps",
                 fontsize=9)
    ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
