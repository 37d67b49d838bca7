"""Merge per-stage latency reports taken on several GPUs into one markdown table and one chart.

    python scripts/report_gpus.py h100/ a10/tiny-seed0.json results/benchmark.json \\
        --out-md gpus.md --out-png gpus.png --out-json gpus.json

Each input is a JSON file, or a directory whose *.json files are read (there, JSON files that are no
latency report, such as plugin benchmarks, are skipped with a note). A file holds either

- a demo_diffusion report (the JSON written beside the images), or
- rows: {"rows": [{"device": "NVIDIA H200", "label": "diffusers + compile", "model": "sd1.5-arch",
  "height": 512, "width": 512, "batch_size": 1, "steps": 50,
  "latency_ms": {"clip": 1.9, "unet": 370.2, "vae": 5.8, "pipeline": 380.4}}, ...]}
  with optional "precision", "unet_calls" (default: steps), "source" (default: the file's path) and
  "published" (default: false). "backend" may stand in for "label". A stage time of null is unknown;
  pipeline must be known.

--out-json writes the merged rows in that rows shape, so merges can be merged again (rows that
differ only in their source are shown once). Rows are compared only within one workload: the same
model, image size, batch size and steps; each workload gets its own table and chart panel, fastest
first. The TensorRT 8.5 + plugins figures NVIDIA published for demoDiffusion are added as reference
rows unless --no-published. The table is always printed; --out-md, --out-png and --out-json also
write it, the chart and the merged rows (atomically, and only once every input has been read).
"""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.atomic import atomic_write_bytes  # noqa: E402
from core.errors import UsageError  # noqa: E402

PROG = "report_gpus"
STAGES = ("clip", "unet", "vae", "pipeline")
PUBLISHED_SOURCE = "published"
PUBLISHED_NOTE = ("† Published by NVIDIA for demoDiffusion with TensorRT 8.5 and its plugins (fp16, 512x512, "
                  "batch 1, 50 steps, UNet x 50; an SD 1.x model, taken here as the sd1.5-arch architecture); "
                  "not measured here. — : not published.")


@dataclass(frozen=True)
class Row:
    device: str
    label: str
    precision: str
    model: str
    height: int
    width: int
    batch_size: int
    steps: int
    unet_calls: int
    clip_ms: float | None
    unet_ms: float | None
    vae_ms: float | None
    pipeline_ms: float
    source: str
    published: bool = False

    @property
    def workload(self) -> tuple:
        return self.model, self.height, self.width, self.batch_size, self.steps

    @property
    def stages_known(self) -> bool:
        return None not in (self.clip_ms, self.unet_ms, self.vae_ms)

    def identity(self) -> tuple:
        """Everything but the source: the same measurement read from two files is one row."""
        return tuple(value for name, value in asdict(self).items() if name != "source")

    def as_json(self) -> dict:
        data = {name: value for name, value in asdict(self).items() if not name.endswith("_ms")}
        data["latency_ms"] = {stage: getattr(self, f"{stage}_ms") for stage in STAGES}
        return data


def _published(device: str, clip, unet, vae, pipeline) -> Row:
    return Row(device, "TensorRT 8.5 + plugins", "fp16", "sd1.5-arch", 512, 512, 1, 50, 50, clip, unet, vae,
               pipeline, PUBLISHED_SOURCE, published=True)


PUBLISHED_ROWS = (
    _published("L40", 2.42, 973.56, 23.98, 999.98),
    _published("A10", 5.14, 1892.14, 40.18, 1937.50),
    _published("A30", 4.97, 1368.08, 30.34, 1403.43),
    _published("T4", 9.70, 4536.41, 104.94, 4651.09),
    _published("A100", None, None, None, 815.18),
)


class NotAReport(UsageError):
    """Valid JSON that is neither a demo_diffusion report nor rows (skipped inside directories)."""


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def _count(record: dict, key: str, where: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _latency(record: dict, where: str) -> dict[str, float | None]:
    latency = record.get("latency_ms")
    if not isinstance(latency, dict):
        raise UsageError(f"{where}: 'latency_ms' must be an object with {', '.join(STAGES)}")
    missing = [stage for stage in STAGES if stage not in latency]
    if missing:
        raise UsageError(f"{where}: 'latency_ms' lacks {', '.join(missing)}")
    for stage in STAGES:
        value = latency[stage]
        if value is None and stage != "pipeline":
            continue
        number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not number or value < 0 or (stage == "pipeline" and value == 0):
            raise UsageError(f"{where}: latency_ms.{stage} must be a number of milliseconds, got {value!r}")
    return {stage: latency[stage] for stage in STAGES}


def _row(record: dict, where: str, label: str, precision: str, unet_calls: int, source: str,
         published: bool) -> Row:
    latency = _latency(record, where)
    return Row(_text(record, "device", where), label, precision, _text(record, "model", where),
               _count(record, "height", where), _count(record, "width", where), _count(record, "batch_size", where),
               _count(record, "steps", where), unet_calls, latency["clip"], latency["unet"], latency["vae"],
               latency["pipeline"], source, published)


def _demo_report_row(report: dict, shown: str) -> Row:
    return _row(report, shown, _text(report, "backend", shown), _text(report, "precision", shown),
                _count(report, "unet_calls", shown), shown, published=False)


def _table_row(record, where: str, shown: str) -> Row:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a row must be an object, got {type(record).__name__}")
    label_key = "backend" if "label" not in record and "backend" in record else "label"
    precision = record.get("precision", "")
    if not isinstance(precision, str):
        raise UsageError(f"{where}: 'precision' must be a string, got {precision!r}")
    unet_calls = _count(record, "unet_calls", where) if "unet_calls" in record else _count(record, "steps", where)
    published = record.get("published", False)
    if not isinstance(published, bool):
        raise UsageError(f"{where}: 'published' must be true or false, got {published!r}")
    source = _text(record, "source", where) if "source" in record else shown
    return _row(record, where, _text(record, label_key, where), precision, unet_calls, source, published)


def read_report(path: Path, shown: str) -> list[Row]:
    """The rows of one report file; `shown` is its path as the user gave it, for messages and sources."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"{shown}: cannot read: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{shown}: not JSON ({exc})") from exc
    if isinstance(data, dict) and "rows" in data:
        if not isinstance(data["rows"], list) or not data["rows"]:
            raise UsageError(f"{shown}: 'rows' must be a non-empty list")
        return [_table_row(record, f"{shown}: row {i}", shown) for i, record in enumerate(data["rows"], 1)]
    if isinstance(data, dict) and "latency_ms" in data:
        return [_demo_report_row(data, shown)]
    raise NotAReport(f"{shown}: not a latency report (neither a demo_diffusion report nor {{\"rows\": [...]}})")


def read_inputs(inputs: list[str]) -> list[Row]:
    rows: list[Row] = []
    seen_files: set[Path] = set()
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            files = sorted(path.glob("*.json"))
            found = 0
            for file in files:
                if file.resolve() in seen_files:
                    continue
                seen_files.add(file.resolve())
                try:
                    found_rows = read_report(file, str(file))
                except NotAReport as exc:
                    print(f"{PROG}: skipped {exc}", file=sys.stderr)
                    continue
                rows += found_rows
                found += 1
            if not found:
                raise UsageError(f"{given}: no latency report among its {len(files)} *.json file(s)")
        elif path.is_file():
            if path.resolve() not in seen_files:
                seen_files.add(path.resolve())
                rows += read_report(path, given)
        else:
            raise UsageError(f"{given}: no such file or directory")
    return rows


def merge(rows: list[Row], with_published: bool) -> dict[tuple, list[Row]]:
    """Rows by workload (sorted), each workload fastest first; duplicates shown once."""
    unique: dict[tuple, Row] = {}
    for row in [*rows, *(PUBLISHED_ROWS if with_published else ())]:
        unique.setdefault(row.identity(), row)
    by_workload: dict[tuple, list[Row]] = {}
    for row in unique.values():
        by_workload.setdefault(row.workload, []).append(row)
    return {workload: sorted(group, key=lambda r: (r.pipeline_ms, r.device, r.label))
            for workload, group in sorted(by_workload.items())}


def workload_title(workload: tuple) -> str:
    model, height, width, batch_size, steps = workload
    return f"{model}, {width}x{height}, batch {batch_size}, {steps} steps"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def markdown(groups: dict[tuple, list[Row]]) -> str:
    header = ("| GPU | Backend | Precision | CLIP ms | UNet ms | UNet calls | ms / UNet call | VAE ms | Pipeline ms "
              "| Source |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    parts = []
    for workload, rows in groups.items():
        lines = [f"**{workload_title(workload)}**", "", header]
        for r in rows:
            per_call = None if r.unet_ms is None else r.unet_ms / r.unet_calls
            source = f"{PUBLISHED_SOURCE} †" if r.published else r.source
            lines.append(f"| {r.device} | {r.label} | {r.precision or '—'} | {_ms(r.clip_ms)} | {_ms(r.unet_ms)} "
                         f"| {r.unet_calls} | {_ms(per_call)} | {_ms(r.vae_ms)} | {_ms(r.pipeline_ms)} | {source} |")
        parts.append("\n".join(lines))
    if any(r.published for rows in groups.values() for r in rows):
        parts.append(PUBLISHED_NOTE)
    return "\n\n".join(parts) + "\n"


BAR_HEIGHT = 0.6
STAGE_COLOURS = {"CLIP": "#4c72b0", "UNet": "#dd8452", "VAE": "#55a868", "rest of pipeline": "#c0c0c0"}


def _short_ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def chart_png(groups: dict[tuple, list[Row]]) -> bytes:
    """Stacked horizontal bars (CLIP, UNet, VAE, the rest) of pipeline ms; one panel per workload."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    heights = [len(rows) + 1.5 for rows in groups.values()]
    figure = Figure(figsize=(11, 0.42 * sum(heights) + 1.2), dpi=100, layout="constrained")
    axes = figure.subplots(len(groups), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (workload, rows) in zip(axes, groups.items()):
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
        ax.set_title(workload_title(workload), fontsize=10, loc="left")
        ax.set_xlabel("pipeline ms (CLIP + UNet + VAE + the rest)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=colour, label=name) for name, colour in STAGE_COLOURS.items()]
    if any(r.published for rows in groups.values() for r in rows):
        legend.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                            label="published: NVIDIA demoDiffusion, TensorRT 8.5 + plugins"))
    figure.legend(handles=legend, loc="outside lower center", ncols=len(legend), fontsize=8, frameon=False)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _write(path: str, data: bytes) -> None:
    try:
        atomic_write_bytes(Path(path), data)
    except OSError as exc:
        raise UsageError(f"{path}: cannot write: {exc.strerror or exc}") from exc


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import Parser, run_command

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="report JSON files or directories of them")
    p.add_argument("--out-md", help="write the markdown table here")
    p.add_argument("--out-png", help="write the chart here")
    p.add_argument("--out-json", help="write the merged rows here (the rows shape, readable as input)")
    p.add_argument("--no-published", action="store_true",
                   help="leave out NVIDIA's published TensorRT 8.5 reference rows")
    return run_command(PROG, lambda: report(p.parse_args(argv)))


def report(args) -> int:
    groups = merge(read_inputs(args.inputs), with_published=not args.no_published)
    table = markdown(groups)
    # Everything is rendered before anything is written: bad input leaves no output file.
    outputs = []
    if args.out_md:
        outputs.append((args.out_md, table.encode()))
    if args.out_json:
        rows = [r.as_json() for group in groups.values() for r in group]
        outputs.append((args.out_json, (json.dumps({"rows": rows}, indent=1) + "\n").encode()))
    if args.out_png:
        outputs.append((args.out_png, chart_png(groups)))
    for path, data in outputs:
        _write(path, data)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
