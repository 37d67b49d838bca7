"""sd-quality (bench/quality.py): the detector it trusts, its pinned and balanced case set, the reference comparison
on hand-made reports, its usage errors, and the command itself: the tiny model end to end (the machinery; its images
are noise), and the shapes model drawing what its prompts name, its outline LoRA at scales 1 and 0, and its
ControlNet placing the shape."""

import hashlib
import json
import os
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from bench.quality import (
    QUALITY_SET_VERSION,
    SET_SIZES,
    YARDSTICKS,
    compare_with,
    main,
    output_stem,
    quality_cases,
    quality_table,
    read_report,
    run_counts,
    run_title,
    select_cases,
    summarise,
)
from demo.backends import INT8_UNET
from demo.request import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE
from models.shapes.detector import read_image
from models.shapes.scenes import ATTRIBUTES, COLOURS, POSITIONS, SHAPES, SIZES, STYLES, random_scene, render
from tests.conftest import ROOT

QUALITY = ROOT / "scripts" / "quality.py"
# The sha256 of each set version's case descriptions: a change to the set fails here until the version is bumped.
PINNED = {1: "af1b10a2b956f3ec6f67f2f1c75f62f81a8de69852d42b814a827a7a766cb099"}
SUMMARY_KEYS = {"cases", "judged", "accuracy", "exact_match", "outline_share"}


def expected_reading(scene) -> dict:
    return {**{name: getattr(scene, name) for name in ATTRIBUTES}, "style": scene.style}


def test_the_detector_reads_the_renderer_exactly():
    """The yardstick itself: at least 99% of 600 drawn scenes (filled and outlined, jittered as training draws them)
    read back with every attribute and the style right."""
    rng = random.Random("detector-check")
    scenes = [random_scene(rng).with_(style=STYLES[index % 2]) for index in range(600)]
    misread = [(scene, reading) for scene in scenes
               if (reading := read_image(render(scene, rng)).as_dict()) != expected_reading(scene)]
    assert len(misread) <= 6, misread[:5]


def test_the_case_set_is_pinned():
    descriptions = [case.description() for case in quality_cases()]
    digest = hashlib.sha256(json.dumps(descriptions, sort_keys=True).encode()).hexdigest()
    assert digest == PINNED[QUALITY_SET_VERSION], ("the case set changed: bump QUALITY_SET_VERSION and pin the new "
                                                   f"version's sha256 ({digest}) here")


def test_the_case_set_is_balanced_and_its_edits_change_only_the_colour():
    cases = quality_cases()
    assert quality_cases() == cases  # the same every time
    assert Counter(case.mode for case in cases) == SET_SIZES
    assert len({case.id for case in cases}) == len(cases) and len({case.seed for case in cases}) == len(cases)
    text = [case.scene for case in cases if case.mode == TEXT_TO_IMAGE]
    for name, values in (("shape", SHAPES), ("colour", COLOURS), ("background", COLOURS), ("position", POSITIONS),
                         ("size", SIZES)):
        seen = Counter(getattr(scene, name) for scene in text)
        # each value about as often as the others: 200 over 30 colour pairs leaves colours 32..34
        assert set(seen) == set(values) and max(seen.values()) - min(seen.values()) <= 2, (name, seen)
        assert min(seen.values()) >= 20, (name, seen)
    assert all(scene.colour != scene.background and scene.style == "filled" for scene in text)
    # any prefix is balanced too: --cases 18 has every shape and position twice or more
    assert min(Counter(scene.shape for scene in text[:18]).values()) == 6
    assert min(Counter(scene.position for scene in text[:18]).values()) == 2
    edits = [case for case in cases if case.mode != TEXT_TO_IMAGE]
    for case in edits:
        assert case.scene.colour not in (case.source.colour, case.source.background)
        assert case.scene == case.source.with_(colour=case.scene.colour)
    for mode in (INPAINTING, IMAGE_TO_IMAGE):
        assert set(case.source.shape for case in edits if case.mode == mode) == set(SHAPES)
    assert {case.strength for case in edits if case.mode == IMAGE_TO_IMAGE} == {0.6}


def test_an_inpainting_mask_covers_its_object_and_nothing_of_it_is_left_outside():
    for case in [case for case in quality_cases() if case.mode == INPAINTING]:
        image, mask = np.asarray(case.input_image()), np.asarray(case.mask_image()) > 0
        background = np.array(COLOURS[case.source.background])
        drawn = np.abs(image.astype(int) - background).sum(-1) > 0
        assert drawn.any() and not (drawn & ~mask).any(), case.id
        assert read_image(case.input_image()).as_dict() == expected_reading(case.source)


def test_a_quick_run_takes_the_first_cases_and_proportionally_fewer_edits():
    assert run_counts(None, True) == SET_SIZES
    assert run_counts(8, True) == {TEXT_TO_IMAGE: 8, INPAINTING: 1, IMAGE_TO_IMAGE: 1}
    assert run_counts(100, True) == {TEXT_TO_IMAGE: 100, INPAINTING: 12, IMAGE_TO_IMAGE: 12}
    assert run_counts(100, False) == {TEXT_TO_IMAGE: 100, INPAINTING: 0, IMAGE_TO_IMAGE: 0}
    chosen = select_cases(quality_cases(), run_counts(8, True))
    assert [case.id for case in chosen] == [f"text-to-image-00{i}" for i in range(8)] + ["inpainting-000",
                                                                                         "image-to-image-000"]


def case(case_id: str, mode: str, expected: dict, **read) -> dict:
    return {"id": case_id, "mode": mode, "expected": expected, "reading": {**expected, "style": "filled", **read}}


SCENE = {"shape": "circle", "colour": "red", "background": "blue", "position": "top left", "size": "large"}


def test_the_reference_comparison_counts_the_readings_that_changed(tmp_path):
    """Hand-made reports: four cases in both (one unchanged, one colour, one colour and position, one style), one
    only in the reference; the figures beside this run's are the reference's on the cases both have."""
    earlier = [case(f"text-to-image-00{i}", TEXT_TO_IMAGE, SCENE) for i in range(4)]
    earlier.append(case("inpainting-000", INPAINTING, SCENE))
    now = [case("text-to-image-000", TEXT_TO_IMAGE, SCENE),
           case("text-to-image-001", TEXT_TO_IMAGE, SCENE, colour="green"),
           case("text-to-image-002", TEXT_TO_IMAGE, SCENE, colour="green", position="top"),
           case("inpainting-000", INPAINTING, SCENE, style="outline")]
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({"set_version": QUALITY_SET_VERSION, "model": "shapes", "cases": earlier}))
    reference = read_report(str(path), run_counts(3, True), YARDSTICKS["shapes"])
    compared = compare_with(reference, str(path), now)
    assert compared["changed"] == {"cases": 4, "share": {"shape": 0.0, "colour": 0.5, "background": 0.0,
                                                         "position": 0.25, "size": 0.0, "style": 0.25, "any": 0.75}}
    assert compared["summary"][TEXT_TO_IMAGE]["cases"] == 3  # text-to-image-003 is not in this run
    assert compared["summary"][TEXT_TO_IMAGE]["exact_match"] == 1.0
    figures = summarise(now)
    assert figures[TEXT_TO_IMAGE]["accuracy"]["colour"] == pytest.approx(1 / 3)
    assert figures[TEXT_TO_IMAGE]["exact_match"] == pytest.approx(1 / 3)
    assert figures[INPAINTING]["outline_share"] == 1.0 and figures[INPAINTING]["exact_match"] == 1.0
    assert set(figures[INPAINTING]) == SUMMARY_KEYS and figures[INPAINTING]["judged"][0] == "colour"
    settings = {"backend": "torch", "precision": "fp32", "device": "CPU", "scheduler": "PNDM", "steps": 30,
                "guidance_scale": 7.5, "loras": [], "options": []}
    report = {"set_version": 1, "model": "shapes", "settings": settings, "summary": figures, "reference": compared}
    table = quality_table(report)
    assert table.startswith("sd-quality, case set v1: shapes on torch (fp32, CPU), PNDM, 30 steps, guidance 7.5; ")
    assert "| colour | 33.3% | 100.0% |" in table and "| new colour | 100.0% | 100.0% |" in table
    assert "| any attribute | 75.0% |" in table and "4 images in both" in table
    assert output_stem(report) == "quality-shapes-torch-fp32"
    # An INT8 UNet changes the images: its run is named apart, in the table's heading and in the file names.
    int8 = {**report, "settings": {**settings, "backend": "tensorrt", "precision": "fp16", "device": "NVIDIA H200",
                                   "options": ["CUDA graphs", INT8_UNET]}}
    assert quality_table(int8).startswith("sd-quality, case set v1: shapes on tensorrt (fp16, INT8 UNet, NVIDIA H200)")
    assert run_title(int8, detailed=False) == "shapes on tensorrt (fp16, INT8 UNet), 30 steps"
    assert output_stem(int8) == "quality-shapes-tensorrt-fp16-int8"


@pytest.mark.parametrize("args, message", [
    (["--cases", "0"], "--cases must be 1..200, got 0"),
    (["--cases", "201"], "--cases must be 1..200, got 201"),
    (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
    (["--backend", "tensorrt", "--build-static-batch"], "give --max-batch-size 1"),
    (["--denoising-steps", "1"], "leaves the image-to-image cases (strength 0.6) no step to run"),
    (["--scheduler", "bogus"], "bogus"),
    (["--output-dir", "{file}/out"], "output directory '{file}/out' cannot be written"),
    (["--json", "{file}/q.json"], "--json file '{file}/q.json' cannot be written"),
    (["--reference", "{dir}/missing.json"], "--reference {dir}/missing.json: no such file"),
    (["--reference", "{dir}/broken.json"], "--reference {dir}/broken.json: not JSON"),
    (["--reference", "{dir}/list.json"], "not an sd-quality report"),
    (["--reference", "{dir}/old.json"], "made on case set version 0, this run's is 1"),
    (["--reference", "{dir}/later.json", "--cases", "8", "--no-edits"], "no case in common with this run"),
    (["--reference", "{dir}/later.json", "--json", "{dir}/later.json"], "--json names the --reference file"),
    (["--cache-sweep", "3:0,1:0"], "pairs like 3:0 (interval 2 or more), got '1:0'"),
    (["--cache-sweep", "3"], "got '3'"),
    (["--cache-sweep", "3:0", "--json", "{dir}/q.json"], "--cache-sweep names its reports itself"),
    (["--controlnet", "{dir}/none"], "no such ControlNet (a folder with config.json, or one of shapes-controlnet,"),
])
def test_usage_errors_are_one_line_and_write_nothing(args, message, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "old.json").write_text(json.dumps({"set_version": 0, "cases": []}))
    (tmp_path / "later.json").write_text(json.dumps({"set_version": 1, "cases": [
        case("text-to-image-150", TEXT_TO_IMAGE, SCENE)]}))
    before = sorted(tmp_path.iterdir())
    args = [arg.format(file=a_file, dir=tmp_path) for arg in args]
    status = main(["--output-dir", str(tmp_path / "quality"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("sd-quality: error: "), err
    assert message.format(file=a_file, dir=tmp_path) in err[0]
    assert sorted(tmp_path.iterdir()) == before


def run_quality(*args, cwd):
    return subprocess.run([sys.executable, str(QUALITY), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ), timeout=600)


# The torch backend in fp32 wherever the test runs, a few steps, three cases to a call.
TINY = ("--backend", "torch", "--precision", "fp32", "--cases", 8, "--denoising-steps", 4, "--scheduler", "DDIM",
        "--max-batch-size", 3)


def test_tiny_end_to_end_through_the_command(tmp_path, monkeypatch, capsys):
    """The machinery on a model every machine has (its images are noise, so its figures mean nothing): the cases
    rendered and read, the table, the JSON, the chart and the images; then again as a comparison with the first,
    without edits and without matplotlib."""
    result = run_quality("--model", "tiny", *TINY, "--save-images", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "quality"
    first = out / "quality-tiny-torch-fp32.json"
    assert sorted(p.name for p in out.iterdir()) == [first.stem + "-images", first.name, first.stem + ".png"]
    report = json.loads(first.read_text())
    assert report["set_version"] == QUALITY_SET_VERSION and report["model"] == "tiny"
    assert report["cases_run"] == {TEXT_TO_IMAGE: 8, INPAINTING: 1, IMAGE_TO_IMAGE: 1}
    assert report["command"].startswith("sd-quality --model tiny --backend torch")
    settings = report["settings"]
    assert (settings["backend"], settings["precision"], settings["scheduler"], settings["steps"]) == (
        "torch", "fp32", "DDIM", 4)
    assert settings["max_batch_size"] == 3 and settings["device"] and "torch" in report["versions"]
    assert [entry["id"] for entry in report["cases"]] == [c.id for c in select_cases(quality_cases(),
                                                                                     report["cases_run"])]
    for entry in report["cases"]:
        assert set(entry["reading"]) == {*ATTRIBUTES, "style"} and set(entry["expected"]) == set(ATTRIBUTES)
    assert set(report["summary"]) == set(SET_SIZES)
    assert all(set(figures) == SUMMARY_KEYS for figures in report["summary"].values())
    assert report["summary"][TEXT_TO_IMAGE]["cases"] == 8 and report["reference"] is None
    assert report["images_per_s"] > 0
    images = out / (first.stem + "-images")
    assert len(list(images.glob("*.png"))) == 11 and (images / "grid.png").is_file()
    assert report["cases"][0]["image"] == f"{images.name}/text-to-image-000.png"
    assert "| exact match (all five right) |" in result.stdout and "10/10 images" in result.stdout

    # Again, compared with the first: the same settings give the same readings; without matplotlib, no chart.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    status = main(["--model", "tiny", *map(str, TINY), "--no-edits", "--reference", str(first)])
    output = capsys.readouterr().out
    assert status == 0
    second = json.loads((out / "quality-tiny-torch-fp32-run2.json").read_text())
    assert second["reference"]["changed"]["cases"] == 8
    assert set(second["reference"]["changed"]["share"].values()) == {0.0}
    assert second["reference"]["summary"][TEXT_TO_IMAGE] == second["summary"][TEXT_TO_IMAGE]
    assert "no chart: matplotlib is not installed" in output and "| any attribute | 0.0% |" in output
    assert not (out / "quality-tiny-torch-fp32-run2.png").exists()


def test_the_shapes_model_draws_what_its_prompts_name(tmp_path):
    """The trained model on the first cases at its defaults (30 steps, guidance 3): most images right in every
    attribute; with its outline LoRA at scale 1, most drawn as outlines; at scale 0, the base model's images, bit for
    bit."""
    from models.shapes import OUTLINE_LORA

    # both runs render the cases four to a call: a CPU's kernels may round another batch size differently
    result = run_quality("--cases", 8, "--no-edits", "--save-images", "--max-batch-size", 4, "--json",
                         tmp_path / "base.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "base.json").read_text())
    assert report["model"] == "shapes" and set(report["summary"]) == {TEXT_TO_IMAGE}
    assert set(report["summary"][TEXT_TO_IMAGE]) == SUMMARY_KEYS
    assert report["summary"][TEXT_TO_IMAGE]["exact_match"] >= 0.75, result.stdout
    assert report["summary"][TEXT_TO_IMAGE]["outline_share"] <= 0.25, result.stdout

    result = run_quality("--cases", 4, "--no-edits", "--lora", OUTLINE_LORA, "--json",
                         tmp_path / "outline.json", "--reference", tmp_path / "base.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    outline = json.loads((tmp_path / "outline.json").read_text())
    assert outline["summary"][TEXT_TO_IMAGE]["outline_share"] >= 0.75, result.stdout
    assert outline["reference"]["changed"]["share"]["style"] >= 0.5, result.stdout

    result = run_quality("--cases", 4, "--no-edits", "--lora", f"{OUTLINE_LORA}:0",
                         "--save-images", "--max-batch-size", 4, "--json", tmp_path / "scale0.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    scale0_images = sorted((tmp_path / "scale0-images").glob("text-to-image-*.png"))
    assert len(scale0_images) == 4
    for image in scale0_images:
        assert image.read_bytes() == (tmp_path / "base-images" / image.name).read_bytes(), image.name


def test_shapes_controlnet_puts_the_shape_where_its_silhouette_is(tmp_path):
    """--controlnet shapes-controlnet: the first nine cases (one per position), prompted without their position and
    steered by their silhouettes; most shapes land where the silhouette is, and every attribute is right in most; at
    scale 0 (the prompt alone) the position is mostly wrong."""
    common = ("--cases", 9, "--save-images", "--json")
    result = run_quality(*common, tmp_path / "steered.json", "--controlnet", "shapes-controlnet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    steered = json.loads((tmp_path / "steered.json").read_text())
    assert steered["cases_run"] == {TEXT_TO_IMAGE: 9, INPAINTING: 0, IMAGE_TO_IMAGE: 0}
    assert steered["settings"]["controlnets"] == [["shapes-controlnet", 1.0]]
    assert "ControlNet shapes-controlnet x 1.0" in run_title(steered, detailed=False)
    assert output_stem(steered) == "quality-shapes-torch-fp32-controlnet-shapes-controlnet-x1"
    for entry in steered["cases"]:
        assert entry["control_image"] == "the scene's silhouette"
        assert not any(phrase in entry["prompt"] for _, phrase in POSITIONS.values()), entry["prompt"]
    assert {entry["expected"]["position"] for entry in steered["cases"]} == set(POSITIONS)
    figures = steered["summary"][TEXT_TO_IMAGE]
    assert figures["accuracy"]["position"] >= 7 / 9 and figures["exact_match"] >= 5 / 9, result.stdout

    result = run_quality(*common, tmp_path / "scale0.json", "--controlnet", "shapes-controlnet:0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    unsteered = json.loads((tmp_path / "scale0.json").read_text())
    assert unsteered["summary"][TEXT_TO_IMAGE]["accuracy"]["position"] <= 3 / 9, result.stdout


def test_the_cache_sweep_writes_each_run_and_the_curve(tmp_path, monkeypatch, capsys):
    """--cache-sweep on shapes (4 cases, 12 steps): the uncached run, each interval:branch against it, the curve's
    table, JSON and chart; a bad branch is refused before anything renders."""
    monkeypatch.chdir(tmp_path)
    args = ["--backend", "torch", "--precision", "fp32", "--cases", "4", "--no-edits", "--denoising-steps", "12",
            "--max-batch-size", "4"]
    assert main([*args, "--cache-sweep", "3:0,2:6"]) == 2
    assert "--cache-branch 6: this UNet's skip branches are 0 to 5" in capsys.readouterr().err
    assert not (tmp_path / "quality").exists()
    assert main([*args, "--cache-sweep", "3:0,2:1"]) == 0
    out = tmp_path / "quality"
    assert {p.name for p in out.glob("*.json")} == {
        "quality-shapes-torch-fp32.json", "quality-shapes-torch-fp32-cache3-b0.json",
        "quality-shapes-torch-fp32-cache2-b1.json", "quality-shapes-torch-fp32-cache-sweep.json"}
    cached = json.loads((out / "quality-shapes-torch-fp32-cache3-b0.json").read_text())
    assert (cached["settings"]["cache_interval"], cached["settings"]["cache_branch"]) == (3, 0)
    assert cached["reference"]["path"].endswith("quality-shapes-torch-fp32.json")
    sweep = json.loads((out / "quality-shapes-torch-fp32-cache-sweep.json").read_text())
    assert [(row["cache_interval"], row["cache_branch"]) for row in sweep["rows"]] == [(1, None), (3, 0), (2, 1)]
    assert sweep["rows"][0]["speedup"] == 1.0 and sweep["rows"][0]["changed_vs_uncached"] == 0.0
    uncached = sweep["rows"][0]["images_per_s"]  # timings on a shared CPU: their ratio, not their size, is checked
    assert all(row["speedup"] == pytest.approx(row["images_per_s"] / uncached, abs=0.01) for row in sweep["rows"][1:])
    assert sweep["rows"][1]["exact_match"][TEXT_TO_IMAGE] == cached["summary"][TEXT_TO_IMAGE]["exact_match"]
    assert (out / "quality-shapes-torch-fp32-cache-sweep.png").stat().st_size > 10_000
    table = (out / "quality-shapes-torch-fp32-cache-sweep.md").read_text()
    assert "| N=3, K=0 |" in table and table in capsys.readouterr().out
