"""sd-quality's `scenes` yardstick (bench/scenes_quality.py, bench/fidelity.py, bench/sensitivity.py): its pinned and
balanced case set, the detector's check before any model is judged, the scoring, fidelity against a reference with a
floor, --sensitivity end to end (its planted faults behind the test-only switch) and the new options' usage errors.
The machinery runs on the `tiny` model judged by the scenes yardstick (its images are noise); the shipped model's
own figures are tests/test_scenes.py's."""

import hashlib
import json
import os
import sys
from collections import Counter

import pytest

from bench import scenes_quality
from bench.quality import main
from bench.sensitivity import PLANTING
from demo.request import TEXT_TO_IMAGE
from models.scenes.world import COLOURS, FILLS, MAX_OBJECTS, PLACES, SHAPES, SIZES
from tests.conftest import ROOT

QUALITY = ROOT / "scripts" / "quality.py"
# The sha256 of each set version's case descriptions: a change to the set fails here until the version is bumped.
PINNED = {1: "41604d9d12c98ad6669473ed00decc83ee1cce3292803f1ffbb216bc22977127"}
# The machinery on `tiny` (64x64 images, resized for the detector): fp32 on the torch backend, two steps.
TINY = ("--model", "tiny", "--yardstick", "scenes", "--backend", "torch", "--precision", "fp32", "--cases", "3",
        "--denoising-steps", "2", "--scheduler", "DDIM", "--max-batch-size", "3")


def test_the_case_set_is_pinned_and_balanced():
    cases = scenes_quality.quality_cases()
    descriptions = [case.description() for case in cases]
    digest = hashlib.sha256(json.dumps(descriptions, sort_keys=True).encode()).hexdigest()
    assert digest == PINNED[scenes_quality.SET_VERSION], (
        f"the scenes case set changed: bump SET_VERSION and pin the new version's sha256 ({digest}) here")
    assert scenes_quality.quality_cases() == cases and len(cases) == scenes_quality.SET_SIZE
    assert len({case.seed for case in cases}) == len(cases) and len({case.id for case in cases}) == len(cases)
    assert Counter(len(case.scene.objects) for case in cases) == {n: len(cases) // MAX_OBJECTS
                                                                  for n in range(1, MAX_OBJECTS + 1)}
    objects = [o for case in cases for o in case.scene.objects]
    for name, values in (("shape", SHAPES), ("colour", COLOURS), ("size", SIZES), ("fill", FILLS),
                         ("place", PLACES)):
        assert {getattr(o, name) for o in objects} == set(values), name
    assert {case.scene.background_bottom is None for case in cases} == {True, False}  # plain and two-tone
    for case in cases:  # a prompt names everything the detector reads
        for o in case.scene.objects:
            assert o.phrase in case.prompt
        assert case.prompt.endswith(f"on a {case.scene.backdrop} background")


def test_the_detector_reads_every_case_of_the_set_as_the_renderer_draws_it():
    check = scenes_quality.detector_check(scenes_quality.quality_cases())
    assert check["exact"] == 1.0 and check["misread"] == [] and check["images"] == scenes_quality.SET_SIZE


def test_a_misreading_detector_judges_no_model(tmp_path, monkeypatch, capsys, tiny, no_loading):
    """The run stops before anything loads (no_loading) when the detector misreads the renderer's images."""
    from models.scenes import detector

    real = detector.read_image
    monkeypatch.setattr(detector, "read_image",
                        lambda image: real(image.transpose(0)))  # a mirrored reading: places on the wrong side
    monkeypatch.chdir(tmp_path)
    assert main([*TINY]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the scenes detector misreads" in err[0] and "judges no model" in err[0], err
    assert not (tmp_path / "quality").exists()


def _entry(expected_objects, read_objects, background="white", read_background="white") -> dict:
    def reading(objects, back):
        return {"background": back, "count": str(len(objects)), "objects": objects}

    return {"mode": TEXT_TO_IMAGE, "expected": reading(expected_objects, background),
            "reading": reading(read_objects, read_background)}


def _object(place, **changes) -> dict:
    return {"shape": "circle", "colour": "red", "size": "small", "fill": "striped", "place": place, **changes}


def test_the_score_matches_objects_by_place():
    a, b = _object("top left"), _object("bottom right", shape="square")
    entries = [
        _entry([a, b], [a, b]),  # right
        _entry([a, b], [_object("top left", fill="solid")]),  # a's fill wrong, b missing: count wrong
        _entry([a], [_object("top center")], read_background="blue"),  # a misplaced, background wrong
    ]
    figures = scenes_quality.summarise(entries)[TEXT_TO_IMAGE]
    assert figures["cases"] == 3 and figures["objects"] == 5 and figures["exact_match"] == pytest.approx(1 / 3)
    accuracy = figures["accuracy"]
    assert accuracy["count"] == pytest.approx(2 / 3) and accuracy["background"] == pytest.approx(2 / 3)
    assert accuracy["place"] == pytest.approx(3 / 5) and accuracy["shape"] == pytest.approx(3 / 5)
    assert accuracy["fill"] == pytest.approx(2 / 5) and accuracy["whole objects"] == pytest.approx(2 / 5)


def _run(tmp_path, *args):
    import subprocess

    return subprocess.run([sys.executable, str(QUALITY), *TINY, *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ), timeout=600)


def test_fidelity_against_a_reference_and_a_floor(tmp_path):
    """The reference run keeps its images; the same path against it is identical (SSIM 1, every object where it
    was) and is not flagged against a floor (the same path at another batch); another guidance scale is."""
    first = _run(tmp_path, "--json", "reference.json")
    assert first.returncode == 0, first.stderr[-3000:]
    reference = json.loads((tmp_path / "reference.json").read_text())
    assert reference["yardstick"] == "scenes" and reference["detector_check"]["exact"] == 1.0
    assert all((tmp_path / case["image"]).is_file() for case in reference["cases"])
    speed = reference["speed"]
    assert speed["runs"] == 3 and speed["images_per_s"] > 0 and speed["first_call_s"] > 0 and speed["batch"] == 3

    floor = _run(tmp_path, "--reference", "reference.json", "--max-batch-size", "1", "--json", "floor.json")
    assert floor.returncode == 0, floor.stderr[-3000:]
    same = _run(tmp_path, "--reference", "reference.json", "--floor", "floor.json", "--json", "same.json")
    assert same.returncode == 0, same.stderr[-3000:]
    fidelity = json.loads((tmp_path / "same.json").read_text())["reference"]["fidelity"]
    assert fidelity["floor"] == "floor.json" and fidelity["summary"]["flagged"] is False
    assert fidelity["summary"]["ssim"]["value"]["mean"] == pytest.approx(1.0, abs=1e-6)
    assert "| SSIM, whole image |" in same.stdout and "flagged: no" in same.stdout

    other = _run(tmp_path, "--reference", "reference.json", "--floor", "floor.json", "--guidance-scale", "1.5",
                 "--json", "other.json")
    assert other.returncode == 0, other.stderr[-3000:]
    summary = json.loads((tmp_path / "other.json").read_text())["reference"]["fidelity"]["summary"]
    assert summary["ssim"]["value"]["mean"] < 0.99 and summary["flagged"] is True and "ssim" in summary["flagged_by"]


def test_sensitivity_end_to_end_with_a_planted_fault(tmp_path, monkeypatch):
    """The reference, the floor, the fp16 row against the floor and the other rows against fp16, as a table, JSON and
    chart; the planted fault's row runs only behind the test-only switch, and says so."""
    rows = "cache:2,planted:vae-scale"
    monkeypatch.delenv(PLANTING, raising=False)
    refused = _run(tmp_path, "--sensitivity", rows)
    assert refused.returncode == 2 and f"set {PLANTING}=1" in refused.stderr, refused.stderr
    monkeypatch.setenv(PLANTING, "1")
    result = _run(tmp_path, "--sensitivity", rows)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "quality"
    [summary_path] = out.glob("*-sensitivity.json")
    assert summary_path.with_suffix(".md").is_file() and summary_path.with_suffix(".png").stat().st_size > 0
    summary = json.loads(summary_path.read_text())
    assert [row["row"] for row in summary["rows"]] == ["fp16", "cache:2:0", "planted:vae-scale"]
    assert [row["baseline"] for row in summary["rows"]] == ["floor", "fp16", "fp16"]
    assert summary["floor"]["settings"]["precision"] == "fp32" and summary["reference"]["batch"] == 3
    assert all(row["settings"]["precision"] == "fp16" for row in summary["rows"])
    assert summary["rows"][1]["settings"]["cache_interval"] == 2
    assert any("planted fault: vae-scale" in option for option in summary["rows"][2]["settings"]["options"])
    colour = {row["row"]: row["fidelity"]["colour_distance"]["value"]["mean"] for row in summary["rows"]}
    assert colour["planted:vae-scale"] > colour["fp16"]
    assert "| planted:vae-scale | fp16 |" in result.stdout and "| floor: fp32 at batch 1 | — |" in result.stdout


@pytest.fixture(scope="module")
def a_reference(tmp_path_factory):
    """A scenes report with its images, and one of the shapes yardstick, both hand-made."""
    folder = tmp_path_factory.mktemp("reports")
    cases = scenes_quality.quality_cases()[:3]
    entries = [{**case.description(), "expected": case.expected(), "reading": case.expected(),
                "image": f"images/{case.id}.png"} for case in cases]
    (folder / "images").mkdir()
    for entry in entries[:2]:  # the third's image is missing
        (folder / entry["image"]).write_bytes(b"")
    report = {"yardstick": "scenes", "set_version": scenes_quality.SET_VERSION, "cases": entries}
    (folder / "ref.json").write_text(json.dumps(report))
    shapes = {"set_version": 1, "cases": [{"id": "text-to-image-000", "mode": TEXT_TO_IMAGE,
                                           "expected": {"shape": "circle"},
                                           "reading": {"shape": "circle", "style": "filled"}}]}
    (folder / "shapes.json").write_text(json.dumps(shapes))
    (folder / "floor.json").write_text(json.dumps({**report, "reference": {"path": "elsewhere.json"}}))
    (folder / "bare-floor.json").write_text(json.dumps({**report, "reference": {"path": str(folder / "ref.json")}}))
    return folder


@pytest.mark.parametrize("args, message", [
    (("--floor", "{dir}/floor.json"), "--floor is a difference from a reference: give the --reference"),
    (("--model", "tiny", "--yardstick", "shapes", "--floor", "x.json", "--reference", "y.json"),
     "--floor compare images by the scenes yardstick"),
    (("--sensitivity", "fp16", "--reference", "{dir}/ref.json"), "--sensitivity renders its own reference"),
    (("--sensitivity", "fp4"), "--sensitivity: unknown row 'fp4'"),
    (("--sensitivity", "cache:1"), "a cache row is cache:N or cache:N:K (N 2 or more), got 'cache:1'"),
    (("--sensitivity", "cache:3,cache:3:0"), "row 'cache:3:0' given twice"),
    (("--sensitivity", "threshold:0"), "an adaptive cache row is threshold:T or threshold:T:K (T above 0), got"),
    (("--sensitivity", "threshold:nan"), "an adaptive cache row is threshold:T or threshold:T:K"),
    (("--sensitivity", "threshold:abc:1"), "an adaptive cache row is threshold:T or threshold:T:K"),
    (("--sensitivity", "threshold:0.1:x"), "an adaptive cache row is threshold:T or threshold:T:K"),
    (("--sensitivity", "threshold:0.1,threshold:0.10:0"), "row 'threshold:0.1:0' given twice"),
    (("--sensitivity", "planted:vae-scale"), "plants a fault, for testing the yardstick only"),
    (("--cases", "121"), "--cases must be 1..120, got 121"),
    (("--cases", "3", "--reference", "{dir}/ref.json"), "the image of case text-to-image-002 is not beside it"),
    (("--cases", "4", "--reference", "{dir}/ref.json"), "lacks 1 of this run's cases (first: text-to-image-003)"),
    (("--cases", "2", "--reference", "{dir}/shapes.json"), "was judged by the shapes yardstick, this run by scenes"),
    (("--cases", "2", "--reference", "{dir}/ref.json", "--floor", "{dir}/floor.json"),
     "was made against elsewhere.json, not against --reference"),
    (("--cases", "2", "--reference", "{dir}/ref.json", "--floor", "{dir}/bare-floor.json"),
     "case text-to-image-000 has no fidelity figures (a floor needs each of this run's)"),
])
def test_bad_options_are_one_line_before_anything_loads(args, message, a_reference, monkeypatch, capsys,
                                                        no_loading):
    monkeypatch.delenv(PLANTING, raising=False)
    monkeypatch.chdir(a_reference)
    base = [] if "--model" in args else ["--model", "tiny", "--yardstick", "scenes"]
    status = main([*base, *(arg.format(dir=a_reference) for arg in args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("sd-quality: error: "), err
    assert message in err[0], err[0]
