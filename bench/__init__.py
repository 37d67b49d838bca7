"""Measuring the toolkit: the sd-benchmark, sd-ablation and report-gpus commands, the denoiser profile and the
plugin-kernel benchmark.

- common: the output flags, slugs and titles the commands share;
- contenders: what the benchmark compares (torch backend settings, TensorRT engines);
- jobs: the ablation's engine builds (one per stage and plugin set, several at a time, over GPUs);
- runner: one contender, or one ablation configuration, loaded, made ready and timed;
- tables, charts: markdown and PNG of the measurements;
- benchmark, ablation, gpu_report, profile_denoiser, kernels: the commands (each `main(argv) -> int`).

Layering: bench imports demo, models, plugins and core; none of them imports bench.
"""
