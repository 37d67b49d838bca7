"""sd-quality's faults (bench/quality.py): a damaged or foreign --reference refused before anything renders, options
that do nothing noted or refused, and its outputs written as one set: never over what the run did not write, whole
or not at all under a full disk, a rival run or a SIGTERM. Only one test renders (the tiny model, one case, one
step); the others stop the run where it would render, or write a hand-made report."""

import errno
import json
import pathlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import quality
from bench.quality import (
    PROG,
    QUALITY_SET_VERSION,
    QualityFlags,
    check_same_cases,
    main,
    output_stem,
    run_cases,
    run_counts,
    write_outputs,
)
from core.errors import RunFailure, UsageError
from demo.cli.command import run_command
from demo.request import TEXT_TO_IMAGE
from tests.conftest import ROOT

# ---- what a run without rendering needs ----------------------------------------------------------------------------

SCENE = {"shape": "circle", "colour": "red", "background": "blue", "position": "top left", "size": "large"}
SETTINGS = {"backend": "torch", "precision": "fp32", "device": "CPU", "scheduler": "DDIM", "steps": 1,
            "guidance_scale": 3.0, "loras": [], "options": [], "controlnets": [], "cache_branch": None}


def fake_report(command: str = "sd-quality", cases: int = 2) -> dict:
    """A report as measure() makes one, of `cases` hand-made text-to-image cases (the summary left out: the chart,
    which reads it, is not drawn)."""
    entries = [{"id": f"text-to-image-00{index}", "mode": TEXT_TO_IMAGE, "prompt": "a large red circle", "seed": index,
                "expected": SCENE, "reading": {**SCENE, "style": "filled"}} for index in range(cases)]
    return {"tool": PROG, "command": command, "set_version": QUALITY_SET_VERSION, "model": "shapes",
            "settings": SETTINGS, "summary": {}, "reference": None, "cases": entries}


def fake_images(count: int = 2) -> list:
    from PIL import Image

    return [Image.new("RGB", (8, 8), "red") for _ in range(count)]


def report_of(cases, model: str = "shapes") -> dict:
    """A reference as an earlier run of `cases` wrote it (through JSON), every image read right."""
    entries = [{**case.description(), "expected": case.expected(), "reading": {**case.expected(), "style": "filled"}}
               for case in cases]
    return json.loads(json.dumps({"set_version": QUALITY_SET_VERSION, "model": model, "settings": SETTINGS,
                                  "cases": entries}))


@pytest.fixture
def no_chart(monkeypatch):
    monkeypatch.setattr(quality, "quality_chart", lambda report: b"chart")


@pytest.fixture
def rendered(monkeypatch):
    """The runs that reached rendering (measure stopped there, each recorded)."""
    calls = []
    monkeypatch.setattr(quality, "measure", lambda *args, **kwargs: calls.append(args) or ({}, Path()))
    return calls


def refused(args: list, capsys) -> str:
    """The one line `sd-quality ARGS` answers with, exit status 2."""
    status = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith(f"{PROG}: error: "), err
    return err[0]


def names(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


# ---- a --reference: its schema, version and cases checked before anything renders ----------------------------------

def damaged(report: dict, change) -> dict:
    report = json.loads(json.dumps(report))
    change(report)
    return report


REFERENCE = report_of([])  # cases added by each damage below
ONE_CASE = {"id": "text-to-image-000", "mode": TEXT_TO_IMAGE, "expected": SCENE, "reading": {**SCENE, "style": "f"}}
SCHEMA = {
    "no reading": ({**ONE_CASE, "reading": None}, "case text-to-image-000 has no reading"),
    "reading without the attributes": ({**ONE_CASE, "reading": {"style": "filled"}},
                                       "case text-to-image-000's reading lacks shape, colour, background, position, "
                                       "size"),
    "an attribute the reading lacks": ({**ONE_CASE, "expected": {**SCENE, "weight": "heavy"}},
                                       "case text-to-image-000's reading lacks weight"),
    "no style": ({**ONE_CASE, "reading": SCENE}, "case text-to-image-000's reading lacks style"),
    "no expected": ({**ONE_CASE, "expected": {}}, "case text-to-image-000 has no expected attributes"),
    "a number read": ({**ONE_CASE, "reading": {**SCENE, "style": 1}}, "case text-to-image-000 has no reading"),
    "no mode": ({**ONE_CASE, "mode": "sketch"}, "case text-to-image-000's mode is none of text-to-image, inpainting, "
                                                "image-to-image"),
    "no id": ({**ONE_CASE, "id": 7}, "case 0 has no id of its own"),
}


@pytest.mark.parametrize("entry, message", SCHEMA.values(), ids=list(SCHEMA))
def test_a_reference_with_damaged_cases_is_refused_before_rendering(entry, message, tmp_path, rendered, capsys):
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({**REFERENCE, "cases": [entry]}))
    line = refused(["--output-dir", str(tmp_path / "out"), "--cases", "2", "--reference", str(path)], capsys)
    assert line == f"{PROG}: error: --reference {path}: not an sd-quality report ({message})"
    assert rendered == [] and names(tmp_path) == ["reference.json"]


@pytest.mark.parametrize("version, message", [
    ("1", 'its set_version must be a whole number, got "1"'),
    (True, "its set_version must be a whole number, got true"),
    (1.0, "its set_version must be a whole number, got 1.0"),
    (None, "its set_version must be a whole number, got null"),
])
def test_a_set_version_that_is_not_a_whole_number_is_a_schema_error(version, message, tmp_path, rendered, capsys):
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({"set_version": version, "cases": [ONE_CASE]}))
    line = refused(["--output-dir", str(tmp_path), "--cases", "2", "--reference", str(path)], capsys)
    assert line.endswith(f"not an sd-quality report ({message})") and rendered == []


def test_a_reference_with_one_id_twice_is_refused(tmp_path, rendered, capsys):
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({**REFERENCE, "cases": [ONE_CASE, ONE_CASE]}))
    line = refused(["--output-dir", str(tmp_path), "--cases", "2", "--reference", str(path)], capsys)
    assert line.endswith("not an sd-quality report (case 1 has no id of its own)") and rendered == []


@pytest.mark.parametrize("reference_steered, args, message", [
    (True, ["--no-edits"], "was made with --controlnet and this run without"),
    (False, ["--controlnet", "shapes-controlnet"], "was made without --controlnet and this run with"),
], ids=["reference-steered", "run-steered"])
def test_a_controlnet_run_and_one_without_do_not_compare(reference_steered, args, message, tmp_path, rendered, capsys):
    counts = run_counts(2, False)
    path = tmp_path / "reference.json"
    path.write_text(json.dumps(report_of(run_cases(counts, steered=reference_steered))))
    line = refused(["--output-dir", str(tmp_path), "--cases", "2", "--reference", str(path), *args], capsys)
    assert f"--reference {path} {message}: a steered case's prompt leaves its position" in line
    assert rendered == []

    # the same kind compares: rendering is reached
    path.write_text(json.dumps(report_of(run_cases(counts, steered=not reference_steered))))
    assert main(["--output-dir", str(tmp_path), "--cases", "2", "--reference", str(path), *args]) == 0
    assert len(rendered) == 1


def test_a_reference_whose_case_is_another_is_refused():
    cases = run_cases(run_counts(2, True), steered=False)
    reference = report_of(cases)
    check_same_cases(reference, "r.json", cases)  # its own cases pass
    reference["cases"][1]["seed"] += 1
    reference["cases"][1]["expected"]["colour"] = "none"
    with pytest.raises(UsageError, match=r"^--reference r.json: its case text-to-image-001 is not this run's "
                                         r"\(different expected, seed\): only runs of the same cases compare$"):
        check_same_cases(reference, "r.json", cases)


# ---- options that do nothing: refused where they contradict, else a note ------------------------------------------

@pytest.mark.parametrize("cache", [["--cache-interval", "3"], ["--cache-branch", "1"],
                                   ["--cache-interval", "3", "--cache-branch", "1"]])
def test_the_cache_sweep_refuses_a_cache_of_its_own(cache, tmp_path, rendered, capsys):
    line = refused(["--output-dir", str(tmp_path), "--cases", "2", "--cache-sweep", "3:0", *cache], capsys)
    given = " and ".join(cache[::2])
    assert line == f"{PROG}: error: --cache-sweep sets the step cache of each of its runs: drop {given}"
    assert rendered == []


@pytest.mark.parametrize("args, note", [
    (["--no-edits", "--controlnet", "shapes-controlnet"],
     "note: --no-edits unused with --controlnet: a steered run takes the text-to-image cases alone"),
    (["--json", "{dir}/q.json", "--output-dir", "{dir}/elsewhere"],
     "note: --output-dir unused beside --json, which names the report's path"),
])
def test_an_option_without_effect_is_noted(args, note, tmp_path, rendered, capsys):
    assert main(["--cases", "2", *(arg.format(dir=tmp_path) for arg in args)]) == 0
    assert capsys.readouterr().err.strip().splitlines() == [note] and len(rendered) == 1


# ---- the outputs: one set, never over what this run did not write --------------------------------------------------

@pytest.mark.parametrize("there", ["a file", "a folder with a user's file"])
def test_save_images_never_replaces_what_is_there(there, tmp_path, rendered, capsys):
    """--json names the report; its images folder is there already: refused before rendering, nothing touched."""
    images = tmp_path / "q-images"
    if there == "a file":
        images.write_text("mine")
    else:
        images.mkdir()
        (images / "notes.txt").write_text("mine")
    line = refused(["--cases", "2", "--json", str(tmp_path / "q.json"), "--save-images"], capsys)
    assert line == (f"{PROG}: error: --save-images: {images} is there already, and this run never replaces what it "
                    "did not write: move it away, or give another --json")
    assert rendered == [] and "mine" in {p.read_text() for p in tmp_path.rglob("*") if p.is_file()}


def test_a_folder_that_appears_while_rendering_is_left_alone(tmp_path, no_chart):
    """Made after the check (by another process): the run writes nothing, deletes nothing, in one line."""
    images = tmp_path / "q-images"
    images.mkdir()
    (images / "notes.txt").write_text("mine")
    flags = QualityFlags(json_path=str(tmp_path / "q.json"), save_images=True)
    with pytest.raises(RunFailure, match="q-images appeared while this run rendered, and this run never writes into "
                                         r"a folder it did not make \(nothing was written\)"):
        write_outputs(flags, fake_report(), fake_images())
    assert names(tmp_path) == ["q-images", "q-images/notes.txt"]


def test_a_taken_name_takes_the_next(tmp_path, no_chart):
    """An earlier run's images folder, with a user's file in it: the new set goes beside it, under -run2."""
    out = tmp_path / "quality"
    stem = output_stem(fake_report())
    (out / f"{stem}-images").mkdir(parents=True)
    (out / f"{stem}-images" / "notes.txt").write_text("mine")
    path = write_outputs(QualityFlags(output_dir=str(out), save_images=True), fake_report(), fake_images())
    assert path == out / f"{stem}-run2.json"
    assert json.loads(path.read_text())["cases"][0]["image"] == f"{stem}-run2-images/text-to-image-000.png"
    assert names(out) == [f"{stem}-images", f"{stem}-images/notes.txt", f"{stem}-run2-images",
                          f"{stem}-run2-images/grid.png", f"{stem}-run2-images/text-to-image-000.png",
                          f"{stem}-run2-images/text-to-image-001.png", f"{stem}-run2.json", f"{stem}-run2.png"]


def test_two_runs_into_one_folder_keep_both_reports(tmp_path, monkeypatch):
    """Run B writes its set while run A is between finishing its renders and writing (A draws its chart): each
    report stays, under a name of its own."""
    out = tmp_path / "quality"
    flags = QualityFlags(output_dir=str(out))
    rival = []

    def chart(report):
        if report["command"] == "run A":  # A's chart: B writes its set meanwhile
            rival.append(write_outputs(flags, fake_report("run B"), fake_images()))
        return b"chart"

    monkeypatch.setattr(quality, "quality_chart", chart)
    first = write_outputs(flags, fake_report("run A"), fake_images())
    stem = output_stem(fake_report())
    assert rival == [out / f"{stem}.json"] and first == out / f"{stem}-run2.json"
    assert [json.loads(path.read_text())["command"] for path in (rival[0], first)] == ["run B", "run A"]


def test_a_full_disk_while_writing_the_report_leaves_none_of_the_set(tmp_path, no_chart, monkeypatch, capsys):
    """ENOSPC as the report is written, its images written before it: one line, exit 1, nothing left."""
    real = pathlib.Path.write_bytes

    def write_bytes(self, data):
        if data.startswith(b"{"):  # the report
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    out = tmp_path / "quality"
    out.mkdir()
    flags = QualityFlags(output_dir=str(out), save_images=True)
    assert run_command(PROG, lambda: write_outputs(flags, fake_report(), fake_images())) == 1
    json_path = out / f"{output_stem(fake_report())}.json"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{PROG}: error: cannot write the report {json_path}: No space left on device (nothing was written)"]
    assert names(out) == []


# The set written by a real process that stops (stdout "ready", then waits for a line) just before its report is
# linked, its images folder in place: where a SIGTERM leaves the most of it.
PAUSED_WRITE = """
import sys
from bench import quality
from bench.quality import QualityFlags, write_outputs
from demo.cli.command import run_command
from tests.test_quality_faults import fake_images, fake_report

real = quality.write_new_set

def paused(directory, files):
    if any(name.endswith(".json") for name in files):
        print("ready", flush=True)
        sys.stdin.readline()
    return real(directory, files)

quality.write_new_set = paused
quality.quality_chart = lambda report: b"chart"

def write() -> int:
    write_outputs(QualityFlags(output_dir=sys.argv[1], save_images=True), fake_report(), fake_images())
    return 0

sys.exit(run_command("sd-quality", write))
"""


def test_sigterm_while_writing_leaves_none_of_the_set(tmp_path):
    out = tmp_path / "quality"
    writer = subprocess.Popen([sys.executable, "-c", PAUSED_WRITE, str(out)], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert writer.stdout.readline() == "ready\n", writer.communicate()[1]
        assert (out / f"{output_stem(fake_report())}-images" / "grid.png").is_file()  # the images are in place
        writer.send_signal(signal.SIGTERM)
        _, err = writer.communicate(timeout=60)
    finally:
        writer.kill()
    assert writer.returncode == 128 + signal.SIGTERM and err.strip().splitlines() == [f"{PROG}: interrupted"], err
    assert names(out) == []


# ---- one real run: a reference of another model compares, with a note ---------------------------------------------

def test_a_reference_of_another_model_is_noted(tmp_path, tiny, capsys):
    counts = run_counts(1, False)
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps(report_of(run_cases(counts, steered=False), model="shapes")))
    out = tmp_path / "quality"
    status = main(["--model", "tiny", "--backend", "torch", "--precision", "fp32", "--cases", "1", "--no-edits",
                   "--denoising-steps", "1", "--scheduler", "DDIM", "--output-dir", str(out), "--reference",
                   str(reference)])
    err = capsys.readouterr().err
    assert status == 0, err
    assert (f"note: --reference {reference} is of model shapes, this run's is tiny: the readings that changed are "
            "the two models' differences") in err.splitlines()
    report = json.loads((out / "quality-tiny-torch-fp32.json").read_text())
    assert report["reference"]["changed"]["cases"] == 1
