"""bench.gpu_report (report-gpus): reports from several GPUs merged into tables and one chart, a table per workload
and scheduler."""

import json
from pathlib import Path

import pytest
from PIL import Image

from bench.charts import STAGE_COLOURS
from bench.gpu_report import main
from demo.runtime.report import LatencyReport
from tests.conftest import ROOT

# The published rows' configuration (NVIDIA's TensorRT 8.5 demo: 50 steps of its default scheduler, LMSD).
SD15_512 = "sd1.5-arch, LMSD, 512x512, batch 1, 50 steps"
PUBLISHED_DEVICES = {"L40", "A10", "A30", "T4", "A100"}


def demo_report(path: Path, device: str, backend: str, latency: tuple, size: int = 512, scheduler: str = "LMSD",
                model: str = "sd1.5-arch") -> Path:
    """A report exactly as demo_diffusion writes it."""
    report = LatencyReport(model=model, backend=backend, backend_reason="requested", device=device,
                           precision="fp16", scheduler=scheduler, steps=50, unet_calls=51, guidance_scale=7.5, seed=0,
                           batch_size=1, height=size, width=size, latent_shape=[1, 4, size // 8, size // 8],
                           latency_ms=dict(zip(("clip", "unet", "vae", "pipeline"), latency)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.to_json())
    return path


def bench_row(device, label, latency, size=512, batch_size=1, label_key="label"):
    return {"device": device, label_key: label, "precision": "fp16", "model": "sd1.5-arch", "height": size,
            "width": size, "batch_size": batch_size, "steps": 50,
            "latency_ms": dict(zip(("clip", "unet", "vae", "pipeline"), latency))}


@pytest.fixture
def reports(tmp_path):
    h200 = demo_report(tmp_path / "h200" / "sd1.5-arch-seed0.json", "NVIDIA H200", "torch",
                       (6.07, 1320.75, 21.23, 1351.29))
    a10 = demo_report(tmp_path / "a10" / "sd1.5-arch-seed0.json", "NVIDIA A10", "tensorrt", (5.0, 1700.0, 38.0, 1750.0))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"scheduler": "LMSD", "rows": [  # once for all rows, as sd-benchmark writes it
        bench_row("NVIDIA H100", "diffusers + compile", (2.5, 420.0, 9.0, 435.0)),
        bench_row("NVIDIA H100", "ours torch", (4.0, 900.0, 20.0, 930.0), size=768),
        bench_row("NVIDIA H100", "tensorrt", (3.0, 1200.0, 30.0, 1240.0), batch_size=4, label_key="backend"),
    ]}))
    return [h200, a10, bench]


def tables(markdown: str) -> dict[str, list[dict[str, str]]]:
    """Each bold workload title with its table's rows as {column: cell}."""
    out, title, header = {}, None, None
    for line in markdown.splitlines():
        if line.startswith("**"):
            title, header = line.strip("*"), None
            out[title] = []
        elif line.startswith("| ---"):
            continue
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
            else:
                out[title].append(dict(zip(header, cells)))
    return out


def outputs(directory: Path) -> dict[str, Path]:
    return {kind: directory / f"gpus.{kind}" for kind in ("md", "png", "json")}


def run(inputs, out: dict[str, Path] | None = None, *extra) -> int:
    flags = [f for kind, path in (out or {}).items() for f in (f"--out-{kind}", str(path))]
    return main([*map(str, inputs), *flags, *extra])


def test_rows_grouped_by_workload_fastest_first_with_published_reference(reports, tmp_path, capsys):
    out = outputs(tmp_path / "out")
    assert run(reports, out) == 0
    markdown = out["md"].read_text()
    assert capsys.readouterr().out == markdown
    found = tables(markdown)
    # Mismatched model/size/batch/steps never share a table.
    assert list(found) == [SD15_512, "sd1.5-arch, LMSD, 512x512, batch 4, 50 steps",
                           "sd1.5-arch, LMSD, 768x768, batch 1, 50 steps"]
    assert [(r["GPU"], r["Backend"]) for r in found["sd1.5-arch, LMSD, 768x768, batch 1, 50 steps"]] == [
        ("NVIDIA H100", "ours torch")]
    assert [(r["GPU"], r["Backend"]) for r in found["sd1.5-arch, LMSD, 512x512, batch 4, 50 steps"]] == [
        ("NVIDIA H100", "tensorrt")]

    main_table = found[SD15_512]
    assert [(r["GPU"], r["Pipeline ms"]) for r in main_table] == [
        ("NVIDIA H100", "435.00"), ("A100", "815.18"), ("L40", "999.98"), ("NVIDIA H200", "1351.29"),
        ("A30", "1403.43"), ("NVIDIA A10", "1750.00"), ("A10", "1937.50"), ("T4", "4651.09")]
    h200 = next(r for r in main_table if r["GPU"] == "NVIDIA H200")
    assert (h200["Backend"], h200["Precision"], h200["CLIP ms"], h200["UNet ms"], h200["UNet calls"],
            h200["ms / UNet call"], h200["VAE ms"]) == ("torch", "fp16", "6.07", "1320.75", "51", "25.90", "21.23")
    assert h200["Source"] == str(reports[0])
    assert next(r for r in main_table if r["GPU"] == "NVIDIA H100")["Source"] == str(reports[2])

    published = [r for r in main_table if r["Source"] == "published †"]
    assert {r["GPU"] for r in published} == PUBLISHED_DEVICES
    assert {r["Backend"] for r in published} == {"TensorRT 8.5 + plugins"}
    l40 = next(r for r in published if r["GPU"] == "L40")
    assert (l40["CLIP ms"], l40["UNet ms"], l40["UNet calls"], l40["ms / UNet call"], l40["VAE ms"]) == (
        "2.42", "973.56", "50", "19.47", "23.98")
    a100 = next(r for r in published if r["GPU"] == "A100")
    assert [a100[c] for c in ("CLIP ms", "UNet ms", "ms / UNet call", "VAE ms")] == ["—"] * 4
    assert "\n† Published by NVIDIA for demoDiffusion with TensorRT 8.5" in markdown


def test_schedulers_never_share_a_table(tmp_path, capsys):
    ddim = demo_report(tmp_path / "ddim.json", "NVIDIA H200", "torch", (6.0, 350.0, 7.0, 365.0), scheduler="DDIM")
    pndm = demo_report(tmp_path / "pndm.json", "NVIDIA H200", "torch", (6.0, 352.0, 7.0, 367.0), scheduler="PNDM")
    rows = tmp_path / "rows.json"
    own = {**bench_row("NVIDIA H100", "own scheduler", (1.0, 2.0, 3.0, 400.0)), "scheduler": "PNDM"}
    rows.write_text(json.dumps({"scheduler": "DDIM", "rows": [bench_row("NVIDIA H100", "file's", (1, 2, 3, 410.0)),
                                                              own]}))
    unrecorded = tmp_path / "unrecorded.json"
    unrecorded.write_text(json.dumps({"rows": [bench_row("NVIDIA A10", "unrecorded", (1, 2, 3, 900.0))]}))
    assert run([ddim, pndm, rows, unrecorded]) == 0
    found = tables(capsys.readouterr().out)
    assert {title: [r["Backend"] for r in rows] for title, rows in found.items()} == {
        "sd1.5-arch, DDIM, 512x512, batch 1, 50 steps": ["torch", "file's"],
        "sd1.5-arch, PNDM, 512x512, batch 1, 50 steps": ["torch", "own scheduler"],
        "sd1.5-arch, scheduler not recorded, 512x512, batch 1, 50 steps": ["unrecorded"]}


def test_controlnet_rows_are_a_workload_of_their_own(tmp_path, capsys):
    """sd-benchmark --controlnet writes the model's name with the ControlNets beside it: the steered rows get their own
    table (and chart panel), titled with the ControlNets and any scale other than 1."""
    rows = tmp_path / "rows.json"
    steered = [{**bench_row("NVIDIA H200", label, (2.0, 500.0, 7.0, 510.0)), "controlnets": controlnets}
               for label, controlnets in (("one", [{"name": "sd15-controlnet-arch", "scale": 1.0}]),
                                          ("two", [{"name": "/models/canny", "scale": 0.5},
                                                   {"name": "sd15-controlnet-arch", "scale": 1}]))]
    rows.write_text(json.dumps({"scheduler": "DDIM", "rows": [bench_row("NVIDIA H200", "plain", (2, 350, 7, 360.0)),
                                                              *steered]}))
    assert run([rows]) == 0
    found = tables(capsys.readouterr().out)
    assert {title: [r["Backend"] for r in rows] for title, rows in found.items()} == {
        "sd1.5-arch, DDIM, 512x512, batch 1, 50 steps": ["plain"],
        "sd1.5-arch + sd15-controlnet-arch, DDIM, 512x512, batch 1, 50 steps": ["one"],
        "sd1.5-arch + canny x0.5 + sd15-controlnet-arch, DDIM, 512x512, batch 1, 50 steps": ["two"]}


def test_a_measurement_read_without_its_scheduler_is_shown_once(tmp_path, capsys):
    ddim = demo_report(tmp_path / "ddim.json", "NVIDIA H200", "torch", (6.0, 350.0, 7.0, 365.0), scheduler="DDIM")
    older = tmp_path / "older.json"  # the same row as a merge that recorded no scheduler wrote it
    row = {key: value for key, value in json.loads(ddim.read_text()).items() if key != "scheduler"}
    older.write_text(json.dumps({"rows": [{**row, "label": "torch"}]}))
    assert run([older, ddim]) == 0
    found = tables(capsys.readouterr().out)
    assert {title: [r["Source"] for r in rows] for title, rows in found.items()} == {
        "sd1.5-arch, DDIM, 512x512, batch 1, 50 steps": [str(ddim)]}


def test_published_rows_only_beside_a_measured_row_of_their_configuration(tmp_path, capsys):
    cpu = demo_report(tmp_path / "cpu" / "tiny-seed0.json", "CPU (x86_64)", "torch", (20.0, 900.0, 80.0, 1000.0),
                      size=64, model="tiny")
    ddim = demo_report(tmp_path / "ddim.json", "NVIDIA H200", "torch", (6.0, 350.0, 7.0, 365.0), scheduler="DDIM")
    for inputs, titles in (([cpu], ["tiny, LMSD, 64x64, batch 1, 50 steps"]),
                           ([cpu, ddim], ["sd1.5-arch, DDIM, 512x512, batch 1, 50 steps",
                                          "tiny, LMSD, 64x64, batch 1, 50 steps"])):
        assert run(inputs, {"md": tmp_path / "gpus.md"}) == 0
        markdown = (tmp_path / "gpus.md").read_text()
        assert list(tables(markdown)) == titles and "†" not in markdown, inputs
    capsys.readouterr()
    # Published rows read back from a merge count as published: alone they are no table either.
    only_published = tmp_path / "published.json"
    assert run([cpu], {"json": only_published}) == 0
    rows = json.loads(only_published.read_text())["rows"]
    only_published.write_text(json.dumps({"rows": [{**rows[0], "published": True}]}))
    assert run([only_published]) == 2
    assert capsys.readouterr().err == ("report-gpus: error: no measured row among the inputs: published rows are "
                                       "shown only beside one\n")


def test_the_repositorys_results_folder_reports_with_its_other_json_skipped(capsys):
    results = ROOT / "results"
    assert run([results]) == 0
    captured = capsys.readouterr()
    skipped = captured.err.splitlines()
    assert f"report-gpus: skipped {results / 'ablation-nvidia-h200.json'}: not a latency report" in captured.err
    assert all(line.startswith(f"report-gpus: skipped {results}/") and ": not a latency report (" in line
               for line in skipped), skipped
    found = tables(captured.out)
    assert "sd1.5-arch, DDIM, 512x512, batch 1, 50 steps" in found
    for title, rows in found.items():
        assert any(r["Source"] != "published †" for r in rows), title


def test_chart_is_a_png_with_a_panel_row_per_result(reports, tmp_path):
    out = {"png": tmp_path / "with.png"}
    assert run(reports, out) == 0
    fewer = {"png": tmp_path / "without.png"}
    assert run(reports, fewer, "--no-published") == 0
    with Image.open(out["png"]) as chart, Image.open(fewer["png"]) as smaller:
        assert chart.format == "PNG" and smaller.format == "PNG"
        assert 800 <= chart.width <= 2000 and 300 <= chart.height <= 2000
        # Five published rows make the chart taller, the width stays.
        assert chart.width == smaller.width and chart.height > smaller.height
        unet = tuple(int(STAGE_COLOURS["UNet"][i:i + 2], 16) for i in (1, 3, 5))
        unet_pixels = sum(n for n, colour in chart.convert("RGB").getcolors(chart.width * chart.height)
                          if colour == unet)
    assert unet_pixels > 5000  # the stacked UNet bars, far more than the legend's patch


def test_merged_json_reads_back_as_input_without_duplicates(reports, tmp_path):
    first = outputs(tmp_path / "first")
    assert run(reports, first) == 0
    rows = json.loads(first["json"].read_text())["rows"]
    assert sum(r["published"] for r in rows) == len(PUBLISHED_DEVICES)
    assert {r["scheduler"] for r in rows} == {"LMSD"}
    # The merged rows plus the very reports they came from: every row once.
    again = {"md": tmp_path / "again.md"}
    assert run([first["json"], *reports], again) == 0
    assert again["md"].read_text() == first["md"].read_text()


def test_no_published_leaves_out_the_reference_rows(reports, tmp_path):
    merged = tmp_path / "merged.json"
    assert run(reports, {"json": merged}) == 0
    out = {"md": tmp_path / "gpus.md"}
    assert run([merged], out, "--no-published") == 0  # the published rows of a merge too
    markdown = out["md"].read_text()
    assert [r["GPU"] for r in tables(markdown)[SD15_512]] == ["NVIDIA H100", "NVIDIA H200", "NVIDIA A10"]
    assert "Published by NVIDIA" not in markdown and "†" not in markdown


def ablation_rows(path: Path) -> Path:
    """Rows that are no latency report: sd-ablation's configurations, which name no device."""
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "scheduler": "DDIM", "rows": [
        {"label": "none", "unet_calls": 50, "latency_ms": {"clip": 1.0, "unet": 400.0, "vae": 7.0, "pipeline": 410.0},
         "plugins": []}]}))
    return path


def test_directory_input_skips_json_that_is_no_latency_report(reports, tmp_path, capsys):
    folder = reports[0].parent
    (folder / "bench_plugins.json").write_text(json.dumps({"device": "NVIDIA H200", "results": []}))
    ablation_rows(folder / "ablation.json")
    assert run([folder, reports[0]], {"md": tmp_path / "gpus.md"}, "--no-published") == 0
    assert [r["GPU"] for r in tables((tmp_path / "gpus.md").read_text())[SD15_512]] == ["NVIDIA H200"]
    assert capsys.readouterr().err.splitlines() == [
        f"report-gpus: skipped {folder / name}: not a latency report (neither a demo-diffusion report nor rows with "
        "device and latency_ms)" for name in ("ablation.json", "bench_plugins.json")]


def _not_json(d):
    (d / "bad.json").write_text('{"model": "sd1.5-arch", "latency_ms": {')
    return d / "bad.json", "not JSON"


def _not_a_report(d):
    (d / "bad.json").write_text(json.dumps({"device": "NVIDIA H200", "results": []}))
    return d / "bad.json", "not a latency report"


def _ablation(d):
    return ablation_rows(d / "bad.json"), "not a latency report"


def _missing_stage(d):
    path = demo_report(d / "bad.json", "NVIDIA L4", "torch", (1.0, 2.0, 3.0, 4.0))
    report = json.loads(path.read_text())
    del report["latency_ms"]["vae"]
    path.write_text(json.dumps(report))
    return path, "'latency_ms' lacks vae"


def _row_missing_height(d):
    row = bench_row("NVIDIA L4", "torch", (1.0, 2.0, 3.0, 4.0))
    del row["height"]
    (d / "bad.json").write_text(json.dumps({"rows": [bench_row("NVIDIA L4", "x", (1, 2, 3, 4)), row]}))
    return d / "bad.json", "row 2: 'height' must be a positive integer"


def _controlnet_without_scale(d):
    row = {**bench_row("NVIDIA L4", "torch", (1.0, 2.0, 3.0, 4.0)), "controlnets": [{"name": "canny"}]}
    (d / "bad.json").write_text(json.dumps({"rows": [row]}))
    return d / "bad.json", "row 1: 'controlnets' must be a list of objects with a name and a scale"


def _missing_file(d):
    return d / "nowhere.json", "no such file or directory"


def _directory_without_reports(d):
    (d / "empty").mkdir()
    return d / "empty", "no latency report"


@pytest.mark.parametrize("bad_input", [_not_json, _missing_stage, _row_missing_height, _controlnet_without_scale,
                                       _missing_file, _directory_without_reports])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(bad_input, reports, tmp_path, capsys):
    bad, reason = bad_input(tmp_path)
    out_dir = tmp_path / "out"
    assert run([*reports, bad], outputs(out_dir)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"report-gpus: error: {bad}: ") and reason in captured.err
    assert not out_dir.exists() or not any(out_dir.iterdir())


@pytest.mark.parametrize("no_report", [_not_a_report, _ablation])
def test_files_given_as_a_glob_skip_what_is_no_latency_report_as_a_folder_does(no_report, reports, tmp_path, capsys):
    """Issue: `report-gpus results/*.json` exited 2 on the ablation's JSON where `report-gpus results/` skipped it.
    Among several files it is skipped with the folder form's line; named alone, it is an error, as are files given
    none of which is a report."""
    bad, reason = no_report(tmp_path)
    assert run([*reports, bad], {"md": tmp_path / "gpus.md"}) == 0
    assert capsys.readouterr().err == (f"report-gpus: skipped {bad}: not a latency report (neither a demo-diffusion "
                                       "report nor rows with device and latency_ms)\n")
    assert run([bad], outputs(tmp_path / "alone")) == 2
    assert capsys.readouterr().err == (f"report-gpus: error: {bad}: not a latency report (neither a demo-diffusion "
                                       "report nor rows with device and latency_ms)\n")
    other = ablation_rows(tmp_path / "other.json")
    assert run([bad, other], outputs(tmp_path / "none")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "report-gpus: error: no latency report among the 2 files given"
    assert not (tmp_path / "alone").exists() and not (tmp_path / "none").exists()


def test_the_repositorys_results_read_alike_as_a_glob_and_as_a_folder(capsys):
    results = ROOT / "results"
    assert run([results]) == 0
    folder = capsys.readouterr()
    assert run(sorted(results.glob("*.json"))) == 0
    assert capsys.readouterr() == folder
