"""The entry points of bench/'s commands (console scripts, scripts/*.py): each answers Ctrl-C from its first moment,
before the command's imports (core.interrupts.run_main)."""

from core.interrupts import run_main


def sd_benchmark() -> int:
    return run_main("sd-benchmark", "bench.benchmark")


def sd_ablation() -> int:
    return run_main("sd-ablation", "bench.ablation")


def report_gpus() -> int:
    return run_main("report-gpus", "bench.gpu_report")


def loadtest() -> int:
    return run_main("loadtest", "bench.loadtest")


def profile_denoiser() -> int:
    return run_main("profile_denoiser", "bench.profile_denoiser")


def bench_plugins() -> int:
    return run_main("bench_plugins", "bench.kernels")


def sd_quality() -> int:
    return run_main("sd-quality", "bench.quality")


def sd_loadgen() -> int:
    return run_main("sd-loadgen", "bench.loadgen")


def sd_throughput() -> int:
    return run_main("sd-throughput", "bench.throughput")
