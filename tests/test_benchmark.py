"""bench.benchmark (sd-benchmark) on the CPU: the tiny model end to end with the contenders a CPU can run (the
others reported as skipped with their reasons), its JSON merged by report-gpus, rows kept across runs, failures
reported without stopping the rest, usage errors, and the torch defaults it writes (only with --update-defaults)
read back; and where scripts/loadtest.py writes by default."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from bench import benchmark, runner
from bench.benchmark import main, write_defaults
from bench.common import slug
from bench.contenders import DEFAULT_CONTENDERS, EAGER, contenders, resolve_here, select_contenders
from bench.runner import Workload, contender_engine_flags
from core.errors import UsageError
from demo.backends.torch.settings import TorchSettings, resolve_torch_settings
from demo.cli.flags import EngineFlags
from demo.runtime.report import device_name
from models.plugin_set import parse_plugin_set
from plugins import torch_ops
from plugins.contract import PLUGIN_KEYS
from plugins.tuned import PLUGINS_AUTO, TORCH_DEFAULTS, read_entry, write_entry

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path; the GPU runs the real thing")

COMMON = ["--model", "tiny", "--height", "64", "--width", "48", "--denoising-steps", "2", "--warmup-runs", "0",
          "--seed", "0", "--scheduler", "DDIM"]
WORKLOAD = "tiny, 48x64, batch 1, 2 steps"
STEM = "benchmark-" + slug(device_name(torch.device("cpu")))  # e.g. benchmark-cpu-x86-64


def run(tmp_path, *args, common=COMMON):
    results, work = tmp_path / "results", tmp_path / "work"
    status = main([*common, "--results-dir", str(results), "--work-dir", str(work),
                   "--defaults-file", str(tmp_path / "defaults.json"), *args])
    data = json.loads((results / f"{STEM}.json").read_text()) if (results / f"{STEM}.json").is_file() else None
    return status, data, results


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    status, data, results = run(tmp_path, "--runs", "2", "--contenders",
                                "diffusers-channels-last,ours,diffusers-compile,tensorrt-plugins,diffusers-eager,"
                                "ours-defaults")
    return tmp_path, status, data, results


def test_tiny_on_the_cpu_end_to_end(first_run, capfd):
    tmp_path, status, data, results = first_run
    assert status == 0
    # the reference first; ours-defaults is the plain modules on a CPU (the defaults table has GPUs only)
    assert [row["label"] for row in data["rows"]] == [EAGER, "diffusers-channels-last", "ours-defaults"]
    for row in data["rows"]:
        assert row["workload"] == WORKLOAD and row["device"] == data["gpu"] and row["precision"] == "fp32"
        assert row["unet_calls"] == 2 and len(row["latency_ms_runs"]) == 2
        for stage in ("clip", "unet", "vae", "pipeline"):
            assert row["latency_ms"][stage] == pytest.approx(np.median([r[stage] for r in row["latency_ms_runs"]]))
        assert row["latency_ms"]["pipeline"] > row["latency_ms"]["unet"] > 0
        assert row["unet_ms_per_call"] == pytest.approx(row["latency_ms"]["unet"] / 2)
        assert Image.open(row["image"]).size == (48, 64)
    eager, channels_last, defaults = data["rows"]
    assert defaults["settings"] == TorchSettings().as_dict() and "no entry for a CPU" in defaults["what"]
    assert eager["max_pixel_diff_vs_eager"] == 0 and eager["psnr_vs_eager_db"] is None  # identical
    assert channels_last["max_pixel_diff_vs_eager"] <= 1 and channels_last["settings"]["channels_last"] is True
    skipped = {entry["label"]: entry["reason"] for entry in data["skipped"]}
    assert set(skipped) == {"ours", "diffusers-compile", "tensorrt-plugins"} and not data["failed"]
    assert "need a CUDA GPU" in skipped["ours"]
    assert "--compile reduce-overhead needs a CUDA GPU" in skipped["diffusers-compile"]
    assert "tensorrt" in skipped["tensorrt-plugins"]
    table = (results / f"{STEM}.md").read_text()
    assert "| diffusers-eager |" in table and "| diffusers-channels-last |" in table and "| 1.00x |" in table
    assert f"ours ({WORKLOAD}) skipped: " in table
    assert Image.open(results / f"{STEM}.png").size[0] > 500
    assert not (tmp_path / "defaults.json").exists()  # no GPU, no defaults


def test_report_gpus_merges_the_benchmark_json(first_run, capsys):
    from bench.gpu_report import main as report_gpus

    _, status, _, results = first_run
    assert status == 0
    capsys.readouterr()
    assert report_gpus([str(results), "--no-published"]) == 0  # the directory: the markdown and PNG are no JSON
    table = capsys.readouterr().out
    assert "**tiny, DDIM, 48x64, batch 1, 2 steps**" in table  # the file's scheduler, for each of its rows
    lines = [line for line in table.splitlines() if line.startswith("| CPU")]
    assert {line.split(" | ")[1] for line in lines} == {EAGER, "diffusers-channels-last", "ours-defaults"}


def test_rows_of_earlier_runs_are_kept_and_replaced(tmp_path):
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager,tensorrt")
    assert status == 0 and [r["label"] for r in data["rows"]] == [EAGER]
    first = data["rows"][0]["latency_ms_runs"]
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-channels-last")
    assert status == 0 and [r["label"] for r in data["rows"]] == [EAGER, "diffusers-channels-last"]
    assert data["rows"][0]["latency_ms_runs"] == first and [s["label"] for s in data["skipped"]] == ["tensorrt"]
    # compared with the eager image the first run saved
    assert data["rows"][1]["max_pixel_diff_vs_eager"] is not None
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager", "--fresh")
    assert status == 0 and [r["label"] for r in data["rows"]] == [EAGER] and data["skipped"] == []
    assert data["rows"][0]["latency_ms_runs"] != first


def test_a_discarded_row_stays_discarded_until_its_contender_is_measured_again(tmp_path):
    status, data, results = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager")
    data["discarded"] = [{"label": "tensorrt", "workload": WORKLOAD, "reason": "a build shared the GPU"}]
    (results / f"{STEM}.json").write_text(json.dumps(data))
    status, data, results = run(tmp_path, "--runs", "1", "--contenders", "diffusers-channels-last")
    assert status == 0 and [e["label"] for e in data["discarded"]] == ["tensorrt"]
    assert f"tensorrt ({WORKLOAD}) discarded: a build shared the GPU" in (results / f"{STEM}.md").read_text()
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "tensorrt")  # measured again (here: skipped)
    assert data["discarded"] == [] and [e["label"] for e in data["skipped"]] == ["tensorrt"]


def test_a_failing_contender_is_reported_and_the_others_run(tmp_path, monkeypatch):
    real = runner.run_contender

    def flaky(setup, contender, *rest):
        if contender.label == EAGER:
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")
        return real(setup, contender, *rest)

    monkeypatch.setattr(runner, "run_contender", flaky)
    status, data, results = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager,diffusers-channels-last")
    assert status == 0
    assert data["failed"] == [{"label": EAGER, "workload": WORKLOAD, "what": data["failed"][0]["what"],
                               "reason": "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"}]
    assert [r["label"] for r in data["rows"]] == ["diffusers-channels-last"]
    assert data["rows"][0]["psnr_vs_eager_db"] is None  # no reference image to compare with
    assert f"diffusers-eager ({WORKLOAD}) failed: RuntimeError: CUDA out of memory." in (
        results / f"{STEM}.md").read_text()


def test_a_run_cut_short_leaves_the_rows_so_far(tmp_path, monkeypatch, capsys):
    real = runner.run_contender

    def interrupted(setup, contender, *rest):
        if contender.label != EAGER:
            raise KeyboardInterrupt
        return real(setup, contender, *rest)

    monkeypatch.setattr(runner, "run_contender", interrupted)
    status, _, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager,diffusers-channels-last")
    assert status == 130 and capsys.readouterr().err == "sd-benchmark: interrupted\n"  # demo.cli.command.run_command
    data = json.loads((tmp_path / "results" / f"{STEM}.json").read_text())
    assert [r["label"] for r in data["rows"]] == [EAGER]
    assert "| diffusers-eager |" in (tmp_path / "results" / f"{STEM}.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--contenders", "ours,bogus"], "unknown contender(s) bogus"),
    (["--contenders", "ours+GEGLU"], "unknown contender(s) ours+GEGLU"),
    (["--contenders", "ours,ours"], "names a contender twice"),
    (["--runs", "0"], "--runs must be at least 1"),
    (["--denoising-steps", "0"], "--denoising-steps must be at least 1"),
    (["--height", "60"], "--height must be a multiple of 8"),
    (["--results-dir", "{file}/x"], "results directory '{file}/x' cannot be written"),
    (["--engines-from-ablation", "{file}/ablation"], "--engines-from-ablation: no such directory"),
    (["--plugins", "all", "--use-cuda-graph"], "--use-cuda-graph, --plugins: the benchmark sets this per contender"),
    (["--update-defaults", "--defaults-file", "{file}/tuned.json"], "tuned-defaults file '{file}/tuned.json' cannot"),
])
def test_usage_errors(args, message, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    args = [a.format(file=a_file) for a in args]
    status = main([*COMMON, "--work-dir", str(tmp_path / "work"), *(["--results-dir", str(tmp_path / "r")]
                                                                    if "--results-dir" not in args else []), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("sd-benchmark: error: ")
    assert message.format(file=a_file) in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_contender_selection():
    assert [c.label for c in select_contenders(None)] == list(DEFAULT_CONTENDERS)
    everything = select_contenders("all")
    assert everything[0].label == EAGER and len(everything) == len(contenders())
    chosen = select_contenders("ours+GroupNorm+LayerNorm,diffusers-eager,ours+none")
    assert [c.label for c in chosen] == [EAGER, "ours+GroupNorm+LayerNorm", "ours+none"]
    ours = contenders()["ours"].settings
    assert chosen[1].settings == TorchSettings(("GroupNorm", "LayerNorm"), ours.channels_last, ours.cuda_graph,
                                               ours.compile)
    assert chosen[2].settings.plugins == ()
    toggles = {c.label: c.settings for c in everything if c.label.startswith("ours-no-")}
    assert toggles["ours-no-plugins"].plugins == () and toggles["ours-no-compile"].compile == "none"
    assert toggles["ours-no-cuda-graph"].cuda_graph is False and toggles["ours-no-channels-last"].channels_last is False
    assert "fMHA" not in toggles["ours-no-attention"].plugins and "GroupNorm" in toggles["ours-no-attention"].plugins
    with pytest.raises(UsageError):
        select_contenders(",")


def test_tensorrt_auto_takes_the_plugins_auto_picks_here_and_engines_of_each_set_their_own_folder(monkeypatch):
    monkeypatch.setattr("models.plugin_set.local_compute_capability", lambda: "9.0")
    picks = {"plugins": ["fMHCA", "GroupNorm", "fMHA"]}  # not the shipped entry: that one may pick all
    monkeypatch.setattr("models.plugin_set.find_entry", lambda section, key, xl, table: (key, picks))
    auto = resolve_here(contenders()["tensorrt-auto"], None)
    assert auto.plugins == ("GroupNorm", "fMHA", "fMHCA") == parse_plugin_set("auto", "9.0")
    first, other = Workload(512, 512, 1), Workload(768, 768, 1)
    folders = {label: contender_engine_flags(EngineFlags(), c, first, first).engine_dir
               for label, c in {"tensorrt": contenders()["tensorrt"], "tensorrt-auto": auto,
                                "tensorrt-plugins": contenders()["tensorrt-plugins"]}.items()}
    assert len(set(folders.values())) == 3 and folders["tensorrt-plugins"] == folders["tensorrt"] + "-plugins"
    assert folders["tensorrt-auto"].startswith(folders["tensorrt"] + "-plugins-")
    assert contender_engine_flags(EngineFlags(), auto, other, first).engine_dir == \
        f"{folders['tensorrt-auto']}-{other.slug()}"
    assert contender_engine_flags(EngineFlags(), auto, first, first).plugins == ",".join(auto.plugins)
    picks["plugins"] = sorted(PLUGIN_KEYS)  # auto picking every plugin shares the all-plugins engines
    all_auto = resolve_here(contenders()["tensorrt-auto"], None)
    assert contender_engine_flags(EngineFlags(), all_auto, first, first).engine_dir == folders["tensorrt-plugins"]


def _row(label, backend, pipeline, settings, workload="sd1.5-arch, 512x512, batch 1, 50 steps"):
    return {"label": label, "backend": backend, "workload": workload, "settings": settings,
            "latency_ms": {"pipeline": pipeline}}


def test_defaults_table_takes_the_fastest_torch_row_and_the_backend_reads_it(tmp_path, monkeypatch):
    fast = TorchSettings(("GroupNorm",), True, True, "max-autotune-no-cudagraphs").as_dict()
    rows = [_row("diffusers-eager", "torch", 1900.0, TorchSettings().as_dict()),
            _row("ours+GroupNorm", "torch", 700.0, fast),
            _row("tensorrt", "tensorrt", 500.0, {"plugins": [], "cuda_graph": True}),  # engines do not count
            _row("ours", "torch", 650.0, TorchSettings().as_dict(), workload="sd1.5-arch, 768x768, batch 1, 50 steps")]
    table = tmp_path / "tuned_defaults.json"
    write_entry(TORCH_DEFAULTS, "8.0", {"plugins": [], "channels_last": False, "cuda_graph": False, "compile": "none"},
                table)
    write_defaults(table, {"rows": rows}, "sd1.5-arch, 512x512, batch 1, 50 steps", "NVIDIA H100 80GB HBM3", "9.0",
                   tmp_path / "benchmark-nvidia-h100-80gb-hbm3.json")
    entries = json.loads(table.read_text())[TORCH_DEFAULTS]
    assert set(entries) == {"8.0", "9.0"}
    assert entries["9.0"]["label"] == "ours+GroupNorm" and entries["9.0"]["pipeline_ms"] == 700.0
    assert entries["9.0"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert "benchmark-nvidia-h100-80gb-hbm3.json" in entries["9.0"]["source"]
    monkeypatch.setattr("demo.backends.torch.settings.local_compute_capability", lambda: "9.0")
    monkeypatch.setattr(torch_ops, "_STATUS", "available")
    settings, source = resolve_torch_settings(device=torch.device("cuda"), table=table)
    assert settings == TorchSettings(("GroupNorm",), True, True, "max-autotune-no-cudagraphs")
    assert "NVIDIA H100 80GB HBM3" in source


def test_the_defaults_are_written_only_with_update_defaults(tiny, tmp_path, monkeypatch):
    """Without --update-defaults the tuned-defaults file is left byte for byte; with it, this compute capability's
    torch defaults become the fastest torch row (on a GPU, not for the built-in tiny model); the rest is kept."""
    defaults = tmp_path / "defaults.json"
    write_entry(PLUGINS_AUTO, "9.0", {"plugins": ["GroupNorm"]}, defaults)
    write_entry(TORCH_DEFAULTS, "8.0", {"plugins": [], "channels_last": True, "cuda_graph": False,
                                        "compile": "none"}, defaults)
    before = defaults.read_bytes()
    monkeypatch.setattr(benchmark, "compute_capability", lambda device: "9.0")  # a GPU, as far as the defaults go
    as_a_directory = ["--model", str(tiny.path), *COMMON[2:]]  # not the built-in name, which never sets them
    assert run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager", common=as_a_directory)[0] == 0
    assert defaults.read_bytes() == before
    assert run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager", "--update-defaults")[0] == 0
    assert defaults.read_bytes() == before  # the built-in tiny model
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager", "--update-defaults",
                          common=as_a_directory)
    assert status == 0
    entry = read_entry(TORCH_DEFAULTS, "9.0", defaults)
    measured = next(row for row in data["rows"] if row["model"] == str(tiny.path))
    assert entry["label"] == EAGER and entry["pipeline_ms"] == round(measured["latency_ms"]["pipeline"], 2)
    assert {k: entry[k] for k in ("plugins", "channels_last", "cuda_graph", "compile")} == TorchSettings().as_dict()
    assert read_entry(TORCH_DEFAULTS, "8.0", defaults)["channels_last"] is True
    assert read_entry(PLUGINS_AUTO, "9.0", defaults) == {"plugins": ["GroupNorm"]}


def test_the_request_is_recorded_and_images_are_compared_only_for_the_same_one(tmp_path):
    """A random seed (none given) and the model's own scheduler are resolved once and recorded; an eager image
    made for another seed is no reference."""
    no_seed = COMMON[:-4]  # no --seed, no --scheduler: a random seed and the model's own scheduler
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager", common=no_seed)
    assert status == 0 and isinstance(data["seed"], int) and data["scheduler"] == data["rows"][0]["scheduler"]
    assert data["rows"][0]["seed"] == data["seed"]
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-channels-last", "--seed",
                          str(data["seed"] + 1), common=no_seed)
    assert status == 0 and data["rows"][1]["max_pixel_diff_vs_eager"] is None


def test_int8_engines_are_compared_with_their_fp16_ones(tmp_path, monkeypatch):
    """tensorrt-auto then tensorrt-int8 on the stand-in TensorRT (ONNX Runtime runs the engines, the Q/DQ one in
    int8): the INT8 row carries its image and UNet output against the fp16 engines', and the table shows them."""
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "8.6.0")  # runs "on" a compute capability 9.0 GPU: engines run here
    monkeypatch.chdir(tmp_path)  # the engines' default folders
    status, data, results = run(tmp_path, "--runs", "1", "--contenders", "diffusers-eager,tensorrt-auto,tensorrt-int8",
                                "--optimization-level", "0", "--calibration-steps", "4")
    assert status == 0 and not data["failed"] and not data["skipped"], data
    rows = {row["label"]: row for row in data["rows"]}
    int8, fp16 = rows["tensorrt-int8"], rows["tensorrt-auto"]
    assert int8["reference"] == "tensorrt-auto" and int8["engine_dir"] == fp16["engine_dir"]
    assert 25 < int8["psnr_vs_reference_db"] < 100
    error = int8["unet_error_vs_reference"]
    assert error["reference"] == "tensorrt-auto" and 1e-4 < error["rel_l2"] < 0.2 and error["max_abs"] > 0
    assert (tmp_path / f"{fp16['engine_dir']}" / "unet.int8.engine").is_file()
    # The stand-in lists a layer fed by a DequantizeLinear as reading int8, as TensorRT does where it fuses the pair
    assert int8["unet_int8_layers"] == int8["unet_quantized_layers"] > 0
    # Each engine set's UNet profile, by layer kind: time in int8 layers only in the INT8 one
    assert int8["unet_ms_by_kind"]["TensorRT int8"] > 0 and "TensorRT int8" not in fp16["unet_ms_by_kind"]
    assert set(int8["unet_slowest_layers"]) == set(int8["unet_ms_by_kind"])
    assert int8["unet_slowest_layers"]["TensorRT int8"][0]["ms"] > 0
    table = (results / f"{STEM}.md").read_text()
    assert "| tensorrt-int8 | tensorrt-auto |" in table
    kinds_header = next(line for line in table.splitlines() if line.startswith("| contender | fMHA |"))
    assert kinds_header.split(" | ")[-3:] == ["TensorRT int8", "TensorRT", "total |"]
    assert sum(line.startswith(("| tensorrt-auto | —", "| tensorrt-int8 | —")) for line in table.splitlines()) == 2


def test_the_load_test_writes_into_loadtest_not_the_results_archive(tmp_path, monkeypatch, capsys):
    from bench import loadtest

    answered = [loadtest.Sample(0.1 * i, 900.0 + i, "64x64", 2) for i in range(4)]
    monkeypatch.setattr(loadtest, "run_load", lambda *_: answered)  # a server that answered them all
    monkeypatch.chdir(tmp_path)
    assert loadtest.main(["--requests", "4", "--name", "t"]) == 0
    assert json.loads((tmp_path / "loadtest" / "loadtest-t.json").read_text())["answered"] == 4
    assert not (tmp_path / "results").exists()
    assert "saved loadtest/loadtest-t.json" in capsys.readouterr().out


def test_cached_contenders_run_beside_their_uncached_selves(tmp_path):
    """`<label>@cache<N>`: the same contender with the step cache, its row saying so, its picture compared with the
    uncached one's; --cache-branch is the cached rows'; the defaults never come from a cached row."""
    for label in ("ours@cache1", "ours@thr0", "ours@thrnan", "ours@thr-1", "ours@thrx"):
        with pytest.raises(UsageError, match="@cache<N>.*@thr<T>"):
            select_contenders(label)
    adaptive = select_contenders("ours@thr0.25")[0]
    assert adaptive.spec_fields()["cache_threshold"] == 0.25 and adaptive.spec_fields()["cache_interval"] == 1
    steps = ["--denoising-steps", "6"]
    status, data, _ = run(tmp_path, "--runs", "1", "--cache-branch", "2", "--contenders",
                          "diffusers-eager,diffusers-eager@cache3,ours-defaults@cache2,diffusers-eager@thr1e9",
                          common=[*COMMON[:COMMON.index("--denoising-steps")], *steps,
                                  *COMMON[COMMON.index("--denoising-steps") + 2:]])
    assert status == 0 and not data["failed"]
    rows = {row["label"]: row for row in data["rows"]}
    plain, cached = rows["diffusers-eager"], rows["diffusers-eager@cache3"]
    assert (plain["cache_interval"], plain["cache_branch"]) == (1, None)
    assert (cached["cache_interval"], cached["cache_branch"]) == (3, 2) and cached["unet_calls"] == 6
    assert cached["max_pixel_diff_vs_uncached"] == cached["max_pixel_diff_vs_eager"] > 0
    assert rows["ours-defaults@cache2"]["cache_interval"] == 2
    assert "psnr_vs_uncached_db" not in rows["ours-defaults@cache2"]  # ours-defaults itself did not run
    thresholded = rows["diffusers-eager@thr1e9"]  # every call under the cap cached: not the uncached picture
    assert (thresholded["cache_threshold"], thresholded["cache_interval"], thresholded["cache_branch"]) == (1e9, 1, 2)
    assert thresholded["max_pixel_diff_vs_uncached"] > 0
    # whole calls as the runs counted them: calls 0 and 3 at N=3; 0 and 4 under the cap of 3 cached in a row
    assert (plain["cache_whole_calls"], cached["cache_whole_calls"], thresholded["cache_whole_calls"]) == (6, 2, 2)
    # the floor counts what each row's pipeline runs: 2 full and 4 shallow calls at N=3, 3 and 3 at N=2
    flops = {label: row["denoiser_gflop_per_step"] for label, row in rows.items()}
    assert flops["diffusers-eager"] > flops["ours-defaults@cache2"] > flops["diffusers-eager@cache3"] > 0
    assert flops["diffusers-eager@thr1e9"] == flops["diffusers-eager@cache3"]
    assert plain["floor_ms_per_step"] is None  # no GPU peak here


SD3_WORKLOAD = "tiny-sd3, 48x64, batch 1, 2 steps"


def test_sd3_runs_against_diffusers_own_sd3_pipeline(tmp_path):
    """tiny-sd3: our pipeline's modules and diffusers' StableDiffusion3Pipeline on the same request (FlowMatchEuler,
    SD3's guidance), the floor counting its transformer; TensorRT skipped for what this machine lacks (the family has
    engines) and the ablations of plugins that find nothing in its stages skipped, each in one line."""
    from bench.floor import call_gflop
    from models.source import resolve_model
    from models.transformer import SD3TransformerModel

    common = ["--model", "tiny-sd3", *COMMON[2:-2]]  # its own scheduler
    status, data, _ = run(tmp_path, "--runs", "1", "--contenders", "diffusers-pipeline,diffusers-pipeline-compile,ours,"
                          "tensorrt,ours-no-splitgelu,ours-no-seq2spatial,ours-no-attention,diffusers-eager",
                          common=common)
    assert status == 0 and data["scheduler"] == "FlowMatchEuler" and data["guidance_scale"] == 7.0
    assert [row["label"] for row in data["rows"]] == [EAGER, "diffusers-pipeline"] and not data["failed"]
    transformer = call_gflop(SD3TransformerModel(resolve_model("tiny-sd3")), 2, 64, 48)  # guided: batch 2
    for row in data["rows"]:
        assert row["workload"] == SD3_WORKLOAD and row["unet_calls"] == 2
        assert row["denoiser_gflop_per_step"] == round(transformer, 1) > 0
    assert data["rows"][1]["max_pixel_diff_vs_eager"] <= 1  # diffusers' own loop draws our image
    skipped = {entry["label"]: entry["reason"] for entry in data["skipped"]}
    assert skipped["tensorrt"].startswith("tensorrt is not installed")  # this machine's reason: SD3 has engines
    for ablation, keys in (("ours-no-splitgelu", "SplitGeLU"), ("ours-no-seq2spatial", "Seq2Spatial")):
        assert skipped[ablation] == (f"{keys}: nothing in tiny-sd3's stages for their kernels, so it would run as ours "
                                     "does")
    assert "need a CUDA GPU" in skipped["ours-no-attention"]  # its VAE's attention takes our fMHA
    assert "need a CUDA GPU" in skipped["ours"] and "needs a CUDA GPU" in skipped["diffusers-pipeline-compile"]


def test_diffusers_sd3_pipeline_compiles_its_transformer():
    from bench.diffusers_pipeline import DiffusersPipeline
    from models.source import resolve_model

    pipeline = DiffusersPipeline(resolve_model("tiny-sd3"), (), torch.device("cpu"), torch.float32, "reduce-overhead")
    assert isinstance(pipeline.pipe.transformer, torch._dynamo.eval_frame.OptimizedModule)  # compiled at its first call
    assert pipeline.pipe.transformer.pos_embed.proj.weight.is_contiguous(memory_format=torch.channels_last)
