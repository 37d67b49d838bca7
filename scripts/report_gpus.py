"""Merge latency reports of several GPUs into one table and chart: see bench/gpu_report.py (console command
report-gpus)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing
    from bench.entry import report_gpus

    sys.exit(report_gpus())
