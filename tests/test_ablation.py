"""bench.ablation (sd-ablation) and its engine jobs, where they need no GPU: configurations, what --plugins auto
records (only with --update-defaults), the tables, the build jobs' command lines and scheduling."""

import pytest

from bench.ablation import CONFIGS, PEERS, faster_than_none, kernel_comparisons, select_configs
from bench.tables import ablation_table, kernel_table
from core.errors import UsageError
from plugins.contract import OURS, TENSORRT


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
    assert {convention for _, _, convention in CONFIGS[:10]} == {OURS}
    # The peer: TensorRT's own plugins, for the attention pair and for everything; and, for Hopper, where
    # TensorRT 8.6's fMHA_V2 has no kernels, the other four of theirs against the same four of ours
    without_attention = cumulative[-1] - cumulative[1]
    assert [(set(p), c) for _, p, c in CONFIGS[10:]] == [
        (cumulative[1], TENSORRT), (cumulative[-1], TENSORRT), (without_attention, OURS), (without_attention, TENSORRT)]
    assert select_configs("none,GroupNorm alone") == [("none", (), OURS), ("GroupNorm alone", ("GroupNorm",), OURS)]
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
    table = ablation_table([row("none", 500.0), row("+fMHA/fMHCA", 400.0, ("fMHA", "fMHCA"), match=False)],
                           "NVIDIA H100 80GB HBM3", "8.6.0")
    lines = table.splitlines()
    assert "NVIDIA H100 80GB HBM3, TensorRT 8.6.0" in lines[0]
    assert lines[4].startswith("| none | 1.00 | 488.00 | 10.00 | 500.00 | 1.000x | 0 (yes) | — | 1282.32 |")
    assert lines[5].startswith("| +fMHA/fMHCA | 1.00 | 388.00 | 10.00 | 400.00 | 1.250x | 32 (NO) | 50.0 dB "
                               "| 1047.26 |")


def test_peers_pair_the_same_families_in_either_convention():
    configs = {label: (set(plugins), convention) for label, plugins, convention in CONFIGS}
    for ours, theirs in PEERS:
        assert configs[ours][0] == configs[theirs][0] and (configs[ours][1], configs[theirs][1]) == (OURS, TENSORRT)


def test_kernel_table_compares_each_family_only_where_both_peers_ran():
    ours = {"GroupNorm": 2.0, "LayerNorm": 1.0, "reformat": 0.5, "TensorRT": 6.0}
    theirs = {"GroupNorm": 3.0, "LayerNorm": 0.8, "TensorRT": 6.5}  # no reformat layers there
    rows = [{"label": "none", "unet_ms_by_kind": {"TensorRT": 11.0}},
            {"label": "ours without attention", "unet_ms_by_kind": ours},
            {"label": "TensorRT's without attention", "unet_ms_by_kind": theirs},
            {"label": "+fMHA/fMHCA", "unet_ms_by_kind": {"fMHA": 1.0, "fMHCA": 0.5, "TensorRT": 8.0}}]  # peer absent
    comparisons = kernel_comparisons(rows)
    assert [(c["family"], c["ours_ms"], c["tensorrt_ms"]) for c in comparisons] == [("LayerNorm", 1.0, 0.8),
                                                                                     ("GroupNorm", 2.0, 3.0)]
    table = kernel_table(rows, comparisons).splitlines()
    assert "| none | — | — | — | — | — | — | — | — | — | 11.000 | 11.000 |" in table
    assert "| ours without attention | — | — | 1.000 | 2.000 | — | — | 0.500 | — | — | 6.000 | 9.500 |" in table
    assert "| GroupNorm | 2.000 | 3.000 | 1.50x | ours without attention / TensorRT's without attention |" in table
    assert "| LayerNorm | 1.000 | 0.800 | 0.80x | ours without attention / TensorRT's without attention |" in table
    assert not any(line.startswith("| fMHA |") for line in table)
    assert "family by family" not in kernel_table(rows[:2], kernel_comparisons(rows[:2]))  # no pair, no comparison


def test_text_encoder_and_vae_engines_are_shared_where_their_families_are_absent():
    from bench.jobs import config_jobs

    families = {("clip", OURS): {"LayerNorm"}, ("vae", OURS): {"GroupNorm"},
                ("clip", TENSORRT): {"LayerNorm"}, ("vae", TENSORRT): {"GroupNorm"}}
    jobs = config_jobs(CONFIGS, families)
    assert jobs["+fMHA/fMHCA"]["clip"] == jobs["none"]["clip"]  # no LayerNorm yet: the plain text encoder
    assert jobs["+LayerNorm"]["clip"].plugins == ("LayerNorm",) and jobs["+LayerNorm"]["vae"] == jobs["none"]["vae"]
    assert jobs["+Seq2Spatial"]["vae"].plugins == ("GroupNorm",)
    assert jobs["TensorRT's plugins (all six)"]["vae"].convention == TENSORRT
    assert len({job.folder for config in jobs.values() for job in config.values()}) == len(set(
        job for config in jobs.values() for job in config.values()))  # one folder per distinct engine
    engines = {stage: {config[stage] for config in jobs.values()} for stage in ("clip", "unet", "vae")}
    assert [len(engines[stage]) for stage in ("clip", "unet", "vae")] == [3, 14, 3]


def test_the_run_finds_exactly_the_engines_the_build_jobs_made(tiny, tmp_path, monkeypatch):
    """The run's engine settings come from the build jobs' own flags: a run that would build again
    (e.g. dynamic where the build was static) fails here."""
    from dataclasses import replace

    from bench.jobs import BuildPlan, config_jobs
    from demo.cli.build_engines import main as build_engines
    from demo.runtime.loader import load_pipeline
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "8.6.0")
    plan = BuildPlan(str(tiny.path), tmp_path, height=64, width=48, optimization_level=0)
    jobs = config_jobs([("none", (), OURS)], {})["none"]
    for job in jobs.values():
        assert build_engines(plan.argv(job)) == 0

    def no_build(*_, **__):
        raise AssertionError("the run tried to build an engine the jobs had built")

    monkeypatch.setattr("demo.backends.tensorrt.build.build_engine_file", no_build)

    def stages(spec):
        with load_pipeline(spec, "cpu", progress=lambda *_: None) as pipeline:
            return set(pipeline.stages)

    assert stages(plan.config_spec(tiny, (), OURS, jobs)) == {"clip", "unet", "vae"}
    # sd-benchmark --engines-from-ablation: the same engines, for the contender with no plugins
    assert stages(plan.config_spec(tiny, (), OURS, use_cuda_graph=True)) == {"clip", "unet", "vae"}
    # Other build settings than the ablation's: an error naming what differs, not a build
    from core.artifacts import ArtifactError

    with pytest.raises(ArtifactError, match="optimization_level changed.*building is off"):
        stages(replace(plan, optimization_level=2).config_spec(tiny, (), OURS, jobs))
    with pytest.raises(UsageError, match="no ablation probe of clip"):  # plugins, but no probes there
        plan.config_spec(tiny, ("LayerNorm",), OURS)


def test_a_jobs_command_line_parses_back_into_the_flags_the_run_uses(tmp_path):
    """build-engines parses a job's arguments into exactly the EngineFlags (and request shape) that
    BuildPlan.config_spec gives the run: build and run agree by construction."""
    from dataclasses import replace

    from bench.common import ALL
    from bench.jobs import BuildPlan, Job
    from demo.cli.build_engines import BuildFlags, build_spec, make_parser
    from demo.cli.flags import EngineFlags, ModelFlags, parse_flags

    plans = [BuildPlan("tiny", tmp_path / "work", 64, 48),
             BuildPlan("sd1.5-arch", tmp_path / "other", 512, 768, batch_size=2, guided=False, optimization_level=5,
                       disable_tactic_sources="CUDNN,CUBLAS_LT")]
    for plan in plans:
        for job in (Job("unet", (), OURS), Job("clip", ("LayerNorm",), OURS), Job("unet", ALL, TENSORRT)):
            flags = parse_flags(make_parser(), plan.argv(job))
            assert flags[EngineFlags] == plan.engine_flags(job)
            assert flags[BuildFlags] == plan.build_flags(job)
            assert flags[ModelFlags] == ModelFlags(model=plan.model)
            engine, build = flags[EngineFlags], flags[BuildFlags]
            assert engine.engine_dir == str(plan.work / job.folder / "engine") and engine.build_static_batch
            assert engine.plugins == (",".join(job.plugins) or "none") and engine.plugin_convention == job.convention
            assert (engine.optimization_level, engine.disable_tactic_sources) == (plan.optimization_level,
                                                                                 plan.disable_tactic_sources)
            assert (build.backend, build.stages, build.height, build.width, build.batch_size, build.no_guidance) == (
                "tensorrt", job.stage, plan.height, plan.width, plan.batch_size, not plan.guided)
            # The spec build-engines builds, and the run's, agree on the stage's engine (building aside)
            built, run = build_spec(flags), plan.config_spec(None, job.plugins, job.convention, {job.stage: job})
            (override,) = run.stage_overrides
            assert override.engine == replace(built.engine, build_missing=False) and override.plugins == built.plugins
            assert (run.height, run.width, run.batch_size, run.guided) == (built.height, built.width,
                                                                            built.batch_size, built.guided)


def test_builds_spread_over_the_gpus_given_the_fewest_builds_first(tmp_path, monkeypatch):
    import itertools
    import sys
    from pathlib import Path

    from bench.jobs import BuildPlan, Job, build_all

    launched = []

    class Finished:
        def __init__(self, command, env=None, **_):
            assert command[:3] == [sys.executable, "-m", "demo.cli.build_engines"]
            folder = Path(command[command.index("--engine-dir") + 1]).parent.name
            launched.append((folder, (env or {}).get("CUDA_VISIBLE_DEVICES")))
            self.polls, self.returncode = itertools.count(), 0
            self.length = 1 if folder == "unet-none" else 5  # the first finishes first

        def poll(self):
            return 0 if next(self.polls) >= self.length else None

    monkeypatch.setattr("bench.jobs.subprocess.Popen", Finished)
    monkeypatch.setattr("bench.jobs.time.sleep", lambda _: None)
    plan = BuildPlan("tiny", tmp_path, 64, 64, optimization_level=0)
    jobs = [Job("unet", (), OURS), Job("unet", ("GroupNorm",), OURS), Job("clip", (), OURS), Job("vae", (), OURS)]
    for stage in ("unet", "clip", "vae"):
        (tmp_path / Job(stage, (), OURS).folder / "onnx").mkdir(parents=True)
    times, failed = build_all(plan, jobs, parallel_builds=3, build_gpus=2)
    assert failed == {} and set(times) == set(jobs)
    # three at a time over two GPUs: 0, 1, 0; the first finishes first, so the fourth goes where it ran
    # (not in turn, which would give GPU 1 a second build while GPU 0 has one)
    assert [gpu for _, gpu in launched] == ["0", "1", "0", "0"]
    launched[:] = []
    build_all(plan, jobs, parallel_builds=3, build_gpus=1)
    assert [gpu for _, gpu in launched] == [None] * 4  # one GPU: the environment is left as it is


def test_runs_keep_the_table_order_and_nothing_built_is_an_error_that_writes_nothing(tiny, tmp_path, monkeypatch,
                                                                                       capsys):
    """--configs orders the builds (a budget cuts the last); the runs and the table keep CONFIGS' order; only
    --update-defaults writes what --plugins auto takes. When no configuration was built, the ablation exits 1
    with one line and writes no results."""
    import json

    from bench import ablation, jobs, runner, tables
    from bench.common import STAGES
    from plugins.tuned import PLUGINS_AUTO, read_entry, write_entry

    ran = []
    monkeypatch.setattr(jobs, "export_and_probe", lambda *_: {})
    monkeypatch.setattr(jobs, "build_all", lambda plan, jobs, *_: ({}, {}))
    monkeypatch.setattr(runner, "run_config", lambda plan, source, request, runs, label, *_: ran.append(label) or {
        "label": label, "latency_ms": {s: 2.0 if label == "none" else 1.0 for s in STAGES},
        "plugin_layers": {}, "image": None, "unet_ms_by_kind": {"TensorRT": 5.0}})
    monkeypatch.setattr("PIL.Image.fromarray", lambda _: type("Image", (), {"save": lambda *_: None})())
    monkeypatch.setattr(tables, "ablation_table", lambda rows, *_: "")
    monkeypatch.setattr(ablation, "ablation_chart", lambda *_: b"")
    results = tmp_path / "results"
    (tmp_path / "work").mkdir()  # export_and_probe, stood in for here, makes it
    argv = ["--model", str(tiny.path), "--work-dir", str(tmp_path / "work"), "--results-dir", str(results),
            "--configs", "+Seq2Spatial,none,+fMHA/fMHCA", "--build-only"]
    assert ablation.main(argv) == 0 and ran == []
    monkeypatch.setattr("demo.backends.tensorrt.backend.version", lambda _: "8.6.0")
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *_: "Test GPU")
    monkeypatch.setattr(ablation, "local_compute_capability", lambda: "9.0")
    defaults = tmp_path / "tuned.json"
    write_entry(PLUGINS_AUTO, "8.0", {"plugins": ["GroupNorm"]}, defaults)
    before = defaults.read_bytes()
    assert ablation.main(argv[:-1] + ["--defaults-file", str(defaults)]) == 0
    assert ran == ["none", "+fMHA/fMHCA", "+Seq2Spatial"]
    assert [row["label"] for row in json.loads((results / "ablation-test-gpu.json").read_text())["rows"]] == ran
    assert defaults.read_bytes() == before  # no --update-defaults
    assert ablation.main(argv[:-1] + ["--defaults-file", str(defaults), "--update-defaults"]) == 0
    entry = read_entry(PLUGINS_AUTO, "9.0", defaults)
    assert entry["plugins"] == ["fMHA", "fMHCA"] and entry["gpu"] == "Test GPU" and entry["tensorrt"] == "8.6.0"
    assert read_entry(PLUGINS_AUTO, "8.0", defaults) == {"plugins": ["GroupNorm"]}

    every_job_failed = lambda plan, jobs, *_: ({}, {job: f"{job.folder} not built" for job in jobs})  # noqa: E731
    monkeypatch.setattr(jobs, "build_all", every_job_failed)
    ran.clear()
    capsys.readouterr()
    status = ablation.main(argv[:-1] + ["--results-dir", str(tmp_path / "empty")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and ran == [] and err == ["sd-ablation: error: no configuration was built, so none ran"]
    assert not (tmp_path / "empty").exists()
