"""Issue 21's figures from one lease.sh run: python3 summarize.py RUN_DIR (the lease's /tmp/s21).

Reads the load tests' JSON (RUN_DIR/results/loadtest-*.json), the CLI's reports (RUN_DIR/cli/**/*.json: the median
of its runs' pipeline times is the yardstick), the servers' drain times (RUN_DIR/steps.log) and their pipeline calls
(their logs, RUN_DIR/serve-*.log); writes RUN_DIR/results/summary.md and summary.json: a row per load test; the
issue's ratios against their targets (two GPUs against one at concurrency 16, at least 1.9x; batch 4 against batch 1
at concurrency 8, reported; p50 at concurrency 1 against the CLI's pipeline time, within 5%; the long run without a
failure); and each server's pipeline calls per device and batch size: their mean time, and of it the pipeline's own
(the rest is the hand-off; logs from before the servers logged it have none)."""

import json
import re
import statistics
import sys
from pathlib import Path

run = Path(sys.argv[1])
tests = {path.stem.removeprefix("loadtest-"): json.loads(path.read_text())
         for path in sorted((run / "results").glob("loadtest-*.json"))}
cli = [json.loads(path.read_text()) for path in sorted((run / "cli").rglob("*.json"))]
cli_runs = [report["latency_ms"]["pipeline"] for report in cli]
cli_ms = statistics.median(cli_runs) if cli else None
drains = dict(re.findall(r"\] \S+ (\S+) stopped in (\S+) s", (run / "steps.log").read_text()))


def ratio(a: str, b: str, field=lambda t: t["images_per_s"]):
    return round(field(tests[a]) / field(tests[b]), 3) if a in tests and b in tests else None


# one-*: ONE_GPU=1
at_one = next((tests[name] for name in ("two-b4-c1", "one-b4-c1", "one-b1-c1") if name in tests), {})
p50 = at_one.get("latency_ms", {}).get("p50")
many = tests.get("two-b4-many", tests.get("one-b4-many"))
checks = {
    "two_gpus_over_one_at_c16": {"value": ratio("two-b4-c16", "one-b4-c16"), "target": ">= 1.9"},
    "batch4_over_batch1_at_c8": {"value": ratio("one-b4-c8", "one-b1-c8"), "target": "reported"},
    "p50_c1_over_cli_pipeline": {"value": round(p50 / cli_ms, 3) if p50 and cli_ms else None, "target": "<= 1.05",
                                 "p50_ms": p50, "cli_pipeline_ms": cli_ms},
    "long_run": {"value": None if many is None else f"{many['answered']}/{many['requests']} answered, "
                 f"{many['errors']} errors", "target": "0 errors"},
}
lines = ["| load test | concurrency | requests | errors | images/s | p50 ms | p95 ms | p99 ms | batch sizes (requests) |",
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
for name, test in tests.items():
    latency = test["latency_ms"]
    cells = " | ".join("—" if latency[k] is None else f"{latency[k]:.1f}" for k in ("p50", "p95", "p99"))
    batches = ", ".join(f"{size}: {count}" for size, count in test["batch_sizes"].items())
    lines.append(f"| {name} | {test['concurrency']} | {test['requests']} | {test['errors']} | {test['images_per_s']} "
                 f"| {cells} | {batches} |")
lines += ["", "| check | measured | target |", "| --- | --- | --- |"]
lines += [f"| {name} | {check['value']} | {check['target']} |" for name, check in checks.items()]
lines += ["", f"CLI pipeline ms (each run one after warm-up; the median is the yardstick): "
          f"{', '.join(f'{ms:.1f}' for ms in cli_runs)}; servers drained and exited in (s): {drains}"]
# Each server's pipeline calls from its log lines (one per request; a batch's requests share its number and ms):
# a call that takes longer on two GPUs than on one says the two pipelines slow each other down.
calls: dict[tuple, dict] = {}
for log in sorted(run.glob("serve-*.log")):
    batches = {}
    for number, size, device, ms, own in re.findall(r"batch (\d+) of (\d+) on (\S+), ([\d.]+) ms"
                                                    r"(?: \(pipeline ([\d.]+) ms\))?", log.read_text()):
        batches[number] = (int(size), device, float(ms), float(own) if own else None)
    for size, device, ms, own in batches.values():
        row = calls.setdefault((log.stem.removeprefix("serve-"), device, size), {"ms": [], "own": []})
        row["ms"].append(ms)
        if own is not None:
            row["own"].append(own)


def mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 1) if values else None


lines += ["", "| server | device | batch size | pipeline calls | mean ms per call | of it the pipeline's own |",
          "| --- | --- | ---: | ---: | ---: | ---: |"]
lines += [f"| {server} | {device} | {size} | {len(row['ms'])} | {mean(row['ms'])} | {mean(row['own']) or '—'} |"
          for (server, device, size), row in sorted(calls.items())]
summary = {"load_tests": {name: {k: v for k, v in test.items() if k != "samples"} for name, test in tests.items()},
           "checks": checks, "cli": cli, "cli_pipeline_ms": cli_runs, "drain_s": drains,
           "pipeline_calls": [{"server": server, "device": device, "batch_size": size, "calls": len(row["ms"]),
                               "mean_ms": mean(row["ms"]), "mean_pipeline_ms": mean(row["own"])}
                              for (server, device, size), row in sorted(calls.items())]}
(run / "results" / "summary.json").write_text(json.dumps(summary, indent=1))
(run / "results" / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
