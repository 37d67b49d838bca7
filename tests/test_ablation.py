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
