"""scripts/ablation.py's decisions that need no GPU: configurations, what --plugins auto records, the table."""

import pytest

from core.errors import UsageError
from scripts.ablation import CONFIGS, faster_than_none, markdown_table, select_configs


def row(label, pipeline, plugins=(), match=True):
    layers = {"unet": {"engine": {p: 16 for p in plugins}, "passes": {p: 16 for p in plugins}, "match": match}}
    return {"label": label, "plugins": list(plugins), "plugin_layers": layers, "psnr_vs_none": 50.0,
            "latency_ms": {"clip": 1.0, "unet": pipeline - 12.0, "vae": 10.0, "pipeline": pipeline}}


def test_configurations_follow_demodiffusion_then_each_family_alone():
    labels = [label for label, _, _ in CONFIGS]
    assert labels[:6] == ["none", "+fMHA/fMHCA", "+LayerNorm", "+GroupNorm", "+SplitGeLU", "+Seq2Spatial"]
    cumulative = [set(plugins) for _, plugins, _ in CONFIGS[:6]]
    assert all(a < b for a, b in zip(cumulative, cumulative[1:]))  # each row adds a family
    assert cumulative[-1] == {"fMHA", "fMHCA", "LayerNorm", "GroupNorm", "SplitGeLU", "Seq2Spatial"}
    assert [len(plugins) for _, plugins, _ in CONFIGS[6:10]] == [1, 1, 1, 1]
    assert {convention for _, _, convention in CONFIGS[:10]} == {"sdplugins"}
    # The peer: TensorRT's own plugins, for the attention pair and for everything
    assert [(set(p), c) for _, p, c in CONFIGS[10:]] == [(cumulative[1], "tensorrt"), (cumulative[-1], "tensorrt")]
    assert select_configs("none,GroupNorm alone") == [("none", (), "sdplugins"),
                                                      ("GroupNorm alone", ("GroupNorm",), "sdplugins")]
    assert select_configs(",".join(labels)) == list(CONFIGS)  # every label can be named in --configs
    with pytest.raises(UsageError, match="unknown configuration.*Bogus"):
        select_configs("none,Bogus")


def test_auto_takes_only_what_measured_faster_alone():
    rows = [row("none", 500.0), row("+fMHA/fMHCA", 480.0, ("fMHA", "fMHCA")),
            row("+LayerNorm", 470.0, ("fMHA", "fMHCA", "LayerNorm")),  # cumulative rows do not decide
            row("LayerNorm alone", 505.0, ("LayerNorm",)), row("GroupNorm alone", 490.0, ("GroupNorm",)),
            row("SplitGeLU alone", 500.0, ("SplitGeLU",))]  # a tie is not faster
    assert faster_than_none(rows) == ["GroupNorm", "fMHA", "fMHCA"]
    assert faster_than_none(rows[1:]) == []  # no baseline, no claim


def test_table_marks_mismatched_layer_counts_and_shows_published_rows():
    table = markdown_table([row("none", 500.0), row("+fMHA/fMHCA", 400.0, ("fMHA", "fMHCA"), match=False)],
                           "NVIDIA H100 80GB HBM3", "8.6.0")
    lines = table.splitlines()
    assert "NVIDIA H100 80GB HBM3, TensorRT 8.6.0" in lines[0]
    assert lines[4].startswith("| none | 1.00 | 488.00 | 10.00 | 500.00 | 1.000x | 0 (yes) | — | 1282.32 |")
    assert lines[5].startswith("| +fMHA/fMHCA | 1.00 | 388.00 | 10.00 | 400.00 | 1.250x | 32 (NO) | 50.0 dB | 1047.26 |")


def test_text_encoder_and_vae_engines_are_shared_where_their_families_are_absent():
    from scripts.ablation import config_jobs

    families = {("clip", "sdplugins"): {"LayerNorm"}, ("vae", "sdplugins"): {"GroupNorm"},
                ("clip", "tensorrt"): {"LayerNorm"}, ("vae", "tensorrt"): {"GroupNorm"}}
    jobs = config_jobs(CONFIGS, families)
    assert jobs["+fMHA/fMHCA"]["clip"] == jobs["none"]["clip"]  # no LayerNorm yet: the plain text encoder
    assert jobs["+LayerNorm"]["clip"].plugins == ("LayerNorm",) and jobs["+LayerNorm"]["vae"] == jobs["none"]["vae"]
    assert jobs["+Seq2Spatial"]["vae"].plugins == ("GroupNorm",)
    assert jobs["TensorRT's plugins (all six)"]["vae"].convention == "tensorrt"
    assert len({job.folder for config in jobs.values() for job in config.values()}) == len(set(
        job for config in jobs.values() for job in config.values()))  # one folder per distinct engine
    engines = {stage: {config[stage] for config in jobs.values()} for stage in ("clip", "unet", "vae")}
    assert [len(engines[stage]) for stage in ("clip", "unet", "vae")] == [3, 12, 3]


def test_the_run_finds_exactly_the_engines_the_build_jobs_made(tiny, tmp_path, monkeypatch):
    """The run's engine settings come from the build jobs' own arguments: a run that would build again
    (e.g. dynamic where the build was static) fails here."""
    import argparse
    import sys

    from scripts import build_engines
    from scripts.ablation import config_jobs, create_config_stages, job_argv
    from tests import fake_tensorrt

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt.make_module("8.6.0"))
    monkeypatch.setattr("demo.engine.current_cc", lambda: (9, 0))
    args = argparse.Namespace(model=str(tiny.path), height=64, width=48, optimization_level=0,
                              disable_tactic_sources=None)
    jobs = config_jobs([("none", (), "sdplugins")], {})["none"]
    for job in jobs.values():
        assert build_engines.main(job_argv(args, job, tmp_path)) == 0

    def no_build(*_, **__):
        raise AssertionError("the run tried to build an engine the jobs had built")

    monkeypatch.setattr("demo.engine.build_engine_file", no_build)
    stages = create_config_stages(args, tiny, jobs, tmp_path)
    assert set(stages) == {"clip", "unet", "vae"}
