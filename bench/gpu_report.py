"""Merge per-stage latency reports taken on several GPUs into one markdown table and one chart.

    report-gpus h100/ a10/tiny-seed0.json results/benchmark-nvidia-h200.json \\
        --out-md gpus.md --out-png gpus.png --out-json gpus.json

Each input is a JSON file, or a directory whose *.json files are read. JSON files that are no latency
report, such as the ablation's or the plugin benchmarks', are skipped, one line each on stderr, in a
directory and among several files (`report-gpus results/*.json` reads what `report-gpus results/` does);
named alone, such a file is an error. A file holds either

- a demo-diffusion report (the JSON written beside the images), or
- rows: {"rows": [{"device": "NVIDIA H200", "label": "diffusers + compile", "model": "sd1.5-arch",
  "height": 512, "width": 512, "batch_size": 1, "steps": 50, "scheduler": "DDIM",
  "latency_ms": {"clip": 1.9, "unet": 370.2, "vae": 5.8, "pipeline": 380.4}}, ...]}
  with optional "precision", "scheduler" (default: the file's own "scheduler", as sd-benchmark writes
  it; else not recorded), "unet_calls" (default: steps), "source" (default: the file's path) and
  "published" (default: false). "backend" may stand in for "label". A stage time of null is unknown;
  pipeline must be known.

--out-json writes the merged rows in that rows shape, so merges can be merged again (rows that
differ only in their source are shown once, and a row whose scheduler was not recorded is dropped
where the same measurement comes with its scheduler). Rows are compared only within one
configuration: the same model, scheduler, image size, batch size and steps; each gets its own table
and chart panel, fastest first. The TensorRT 8.5 + plugins figures NVIDIA published for demoDiffusion
are reference rows, shown beside measured rows of their configuration only, unless --no-published.
The table is always printed; --out-md, --out-png and --out-json also write it, the chart and the
merged rows (atomically, and only once every input has been read).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.charts import gpu_chart
from bench.common import STAGES, ms, steered_model, workload_title
from core.atomic import atomic_write_bytes
from core.errors import UsageError, is_finite_number
from demo.cli.command import run_command
from demo.cli.flags import Parser, add_flags, flag, parse_flags, summary

PROG = "report-gpus"
PUBLISHED_SOURCE = "published"
PUBLISHED_SCHEDULER = "LMSD"  # the default of NVIDIA's TensorRT 8.5 demo-diffusion.py, which the figures came from
PUBLISHED_NOTE = ("† Published by NVIDIA for demoDiffusion with TensorRT 8.5 and its plugins (fp16, 512x512, "
                  f"batch 1, 50 steps of {PUBLISHED_SCHEDULER}, that demo's default scheduler, UNet x 50; an SD 1.x "
                  "model, taken here as the sd1.5-arch architecture); not measured here. — : not published.")
NOT_RECORDED = "scheduler not recorded"
# What makes a row of a rows file a latency measurement (an ablation's rows, say, name no device).
LATENCY_ROW_KEYS = frozenset({"device", "latency_ms"})


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
    scheduler: str | None  # None: not recorded
    unet_calls: int
    clip_ms: float | None
    unet_ms: float | None
    vae_ms: float | None
    pipeline_ms: float
    source: str
    published: bool = False

    @property
    def configuration(self) -> tuple:
        """What a table and a chart panel hold rows of: rows are compared only with those of the same workload run by
        the same scheduler."""
        return self.model, self.scheduler or NOT_RECORDED, self.height, self.width, self.batch_size, self.steps

    @property
    def title(self) -> str:
        """Its configuration's table and chart panel title: the workload (bench.common.workload_title) and the
        scheduler after the model."""
        return workload_title(f"{self.model}, {self.scheduler or NOT_RECORDED}", self.height, self.width,
                              self.batch_size, self.steps)

    @property
    def stages_known(self) -> bool:
        return None not in (self.clip_ms, self.unet_ms, self.vae_ms)

    def measurement(self) -> tuple:
        """Everything but the source and the scheduler: a row read without its scheduler is the same measurement as
        one read with it where all of this matches."""
        return tuple(value for name, value in asdict(self).items() if name not in ("source", "scheduler"))

    def identity(self) -> tuple:
        """Everything but the source: the same measurement read from two files is one row."""
        return self.scheduler, self.measurement()

    def as_json(self) -> dict:
        data = {name: value for name, value in asdict(self).items() if not name.endswith("_ms")}
        data["latency_ms"] = {stage: getattr(self, f"{stage}_ms") for stage in STAGES}
        return data


def _published(device: str, clip, unet, vae, pipeline) -> Row:
    return Row(device, "TensorRT 8.5 + plugins", "fp16", "sd1.5-arch", 512, 512, 1, 50, PUBLISHED_SCHEDULER, 50, clip,
               unet, vae, pipeline, PUBLISHED_SOURCE, published=True)


PUBLISHED_ROWS = (
    _published("L40", 2.42, 973.56, 23.98, 999.98),
    _published("A10", 5.14, 1892.14, 40.18, 1937.50),
    _published("A30", 4.97, 1368.08, 30.34, 1403.43),
    _published("T4", 9.70, 4536.41, 104.94, 4651.09),
    _published("A100", None, None, None, 815.18),
)


class NotAReport(UsageError):
    """Valid JSON that is neither a demo-diffusion report nor latency rows (skipped inside directories)."""


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


def _scheduler(record: dict, where: str, default: str | None) -> str | None:
    """The record's scheduler, else `default` (None: not recorded)."""
    return default if record.get("scheduler") is None else _text(record, "scheduler", where)


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
        if not is_finite_number(value) or value < 0 or (stage == "pipeline" and value == 0):
            raise UsageError(f"{where}: latency_ms.{stage} must be a number of milliseconds, got {value!r}")
    return {stage: latency[stage] for stage in STAGES}


def _controlnets(record: dict, where: str) -> list[tuple[str, float]]:
    """A benchmark row's ControlNets (name, scale): a steered pipeline is another workload than the plain one."""
    steering = record.get("controlnets", [])
    if not isinstance(steering, list) or not all(isinstance(item, dict) and isinstance(item.get("name"), str) and
                                                  is_finite_number(item.get("scale")) for item in steering):
        raise UsageError(f"{where}: 'controlnets' must be a list of objects with a name and a scale, got "
                         f"{steering!r}")
    return [(item["name"], item["scale"]) for item in steering]


def _row(record: dict, where: str, label: str, precision: str, scheduler: str | None, unet_calls: int, source: str,
         published: bool) -> Row:
    latency = _latency(record, where)
    model = steered_model(_text(record, "model", where), _controlnets(record, where))
    return Row(_text(record, "device", where), label, precision, model,
               _count(record, "height", where), _count(record, "width", where), _count(record, "batch_size", where),
               _count(record, "steps", where), scheduler, unet_calls, latency["clip"], latency["unet"], latency["vae"],
               latency["pipeline"], source, published)


def _demo_report_row(report: dict, shown: str) -> Row:
    return _row(report, shown, _text(report, "backend", shown), _text(report, "precision", shown),
                _scheduler(report, shown, None), _count(report, "unet_calls", shown), shown, published=False)


def _table_row(record, where: str, shown: str, file_scheduler: str | None) -> Row:
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
    return _row(record, where, _text(record, label_key, where), precision, _scheduler(record, where, file_scheduler),
                unet_calls, source, published)


def read_report(path: Path, shown: str) -> list[Row]:
    """The rows of one report file; `shown` is its path as the user gave it, for messages and sources."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"{shown}: cannot read: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{shown}: not JSON ({exc})") from exc
    rows = data.get("rows") if isinstance(data, dict) else None
    if isinstance(rows, list) and any(isinstance(row, dict) and LATENCY_ROW_KEYS <= row.keys() for row in rows):
        scheduler = _scheduler(data, shown, None)
        return [_table_row(record, f"{shown}: row {i}", shown, scheduler) for i, record in enumerate(rows, 1)]
    if isinstance(data, dict) and "latency_ms" in data:
        return [_demo_report_row(data, shown)]
    raise NotAReport(f"{shown}: not a latency report (neither a demo-diffusion report nor rows with "
                     f"{' and '.join(sorted(LATENCY_ROW_KEYS))})")


def read_inputs(inputs: list[str]) -> list[Row]:
    """The rows of every input. A JSON file that is no latency report is skipped, one line on stderr, inside a
    directory and among several files (as a shell glob such as results/*.json names them); named alone, it is an
    error, as are a directory without a report and files none of which is one."""
    rows: list[Row] = []
    seen_files: set[Path] = set()
    alone = len(inputs) == 1
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            files = sorted(path.glob("*.json"))
            found = 0
            for file in files:
                if file.resolve() in seen_files:
                    continue
                seen_files.add(file.resolve())
                found_rows = _read_or_skip(file, str(file))
                rows += found_rows
                found += bool(found_rows)
            if not found:
                raise UsageError(f"{given}: no latency report among its {len(files)} *.json file(s)")
        elif path.is_file():
            if path.resolve() not in seen_files:
                seen_files.add(path.resolve())
                rows += read_report(path, given) if alone else _read_or_skip(path, given)
        else:
            raise UsageError(f"{given}: no such file or directory")
    if not rows:  # files alone, each skipped (a directory without a report is refused above)
        raise UsageError(f"no latency report among the {len(inputs)} files given")
    return rows


def _read_or_skip(path: Path, shown: str) -> list[Row]:
    """The rows of a report file; none for a file that is no latency report, skipped with a line on stderr."""
    try:
        return read_report(path, shown)
    except NotAReport as exc:
        print(f"{PROG}: skipped {exc}", file=sys.stderr)
        return []


def merge(rows: list[Row], with_published: bool) -> dict[str, list[Row]]:
    """Rows by configuration (in Row.configuration's order), under its title, each fastest first; duplicates shown
    once. Published rows
    (none unless `with_published`) only beside a measured row of their configuration, which they are a reference
    for: alone they would compare nothing."""
    unique: dict[tuple, Row] = {}
    for row in [*rows, *(PUBLISHED_ROWS if with_published else ())]:
        if with_published or not row.published:
            unique.setdefault(row.identity(), row)
    recorded = {row.measurement() for row in unique.values() if row.scheduler is not None}
    by_configuration: dict[tuple, list[Row]] = {}
    for row in unique.values():
        if row.scheduler is not None or row.measurement() not in recorded:
            by_configuration.setdefault(row.configuration, []).append(row)
    return {group[0].title: sorted(group, key=lambda r: (r.pipeline_ms, r.device, r.label))
            for _, group in sorted(by_configuration.items())
            if not all(row.published for row in group)}


def markdown(groups: dict[str, list[Row]]) -> str:
    header = ("| GPU | Backend | Precision | CLIP ms | UNet ms | UNet calls | ms / UNet call | VAE ms | Pipeline ms "
              "| Source |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    parts = []
    for title, rows in groups.items():
        lines = [f"**{title}**", "", header]
        for r in rows:
            per_call = None if r.unet_ms is None else r.unet_ms / r.unet_calls
            source = f"{PUBLISHED_SOURCE} †" if r.published else r.source
            lines.append(f"| {r.device} | {r.label} | {r.precision or '—'} | {ms(r.clip_ms)} | {ms(r.unet_ms)} "
                         f"| {r.unet_calls} | {ms(per_call)} | {ms(r.vae_ms)} | {ms(r.pipeline_ms)} | {source} |")
        parts.append("\n".join(lines))
    if any(r.published for rows in groups.values() for r in rows):
        parts.append(PUBLISHED_NOTE)
    return "\n\n".join(parts) + "\n"


def _write(path: str, data: bytes) -> None:
    try:
        atomic_write_bytes(Path(path), data)
    except OSError as exc:
        raise UsageError(f"{path}: cannot write: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class ReportFlags:
    inputs: tuple[str, ...] = flag("report JSON files or directories of them", (), positional=True)
    out_md: str | None = flag("write the markdown table here", metavar="FILE")
    out_png: str | None = flag("write the chart here", metavar="FILE")
    out_json: str | None = flag("write the merged rows here (the rows shape, readable as input)", metavar="FILE")
    no_published: bool = flag("leave out NVIDIA's published TensorRT 8.5 reference rows (the inputs' too)", False)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=PROG, description=summary(__doc__))
    add_flags(p, ReportFlags, required=("inputs",))
    return run_command(PROG, lambda: report(parse_flags(p, argv)[ReportFlags]))


def report(flags: ReportFlags) -> int:
    groups = merge(read_inputs(list(flags.inputs)), with_published=not flags.no_published)
    if not groups:
        raise UsageError("no measured row among the inputs: published rows are shown only beside one")
    table = markdown(groups)
    # Everything is rendered before anything is written: bad input leaves no output file.
    outputs = []
    if flags.out_md:
        outputs.append((flags.out_md, table.encode()))
    if flags.out_json:
        rows = [r.as_json() for group in groups.values() for r in group]
        outputs.append((flags.out_json, (json.dumps({"rows": rows}, indent=1) + "\n").encode()))
    if flags.out_png:
        outputs.append((flags.out_png, gpu_chart(groups)))
    for path, data in outputs:
        _write(path, data)
    print(table, end="")
    return 0
