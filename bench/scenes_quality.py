"""sd-quality's `scenes` yardstick (docs/quality.md): its case set, how a reading is judged, and each image's fidelity
to the image an exact run drew for the same case.

The set, version SET_VERSION, is drawn from a fixed seed: SET_SIZE text-to-image cases, a quarter each of one, two,
three and four objects (every shape, colour, size, fill, place and both kinds of background many times), each a
scene's prompt and a seed. A reading is judged per attribute: of the scene's objects, the share read at their place
with the right shape, colour, size and fill; the count and the background per image; exact match: everything right.
Before any image is judged, the detector reads the set's own scenes, drawn by the renderer with the jitter training
saw, and the run stops unless it reads every one exactly (a broken detector never judges a model).

With a reference run (--reference, a `scenes` report with its images), each image is also compared with the
reference's image of the same case (bench.fidelity): the objects' masks (IoU), centroids, colours and pattern
frequencies, and SSIM on the whole image; means with bootstrap 95% intervals. With a floor (--floor, a report made
against the same reference: two exact runs, or the exact path of the fast path's precision), a paired test per
metric: whether this run differs from the reference more than the floor does, by more than the metric's margin.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

from demo.request import TEXT_TO_IMAGE

NAME = "scenes"
SET_VERSION = 1  # bump it whenever the cases change: reports of different versions are never compared
SET_SIZE = 120
SET_SIZES = {TEXT_TO_IMAGE: SET_SIZE}
OBJECT_ATTRIBUTES = ("shape", "colour", "size", "fill", "place")
EXACT_LABELS = {TEXT_TO_IMAGE: "exact match (every object and the background)"}
DETECTOR_CHECK_JITTER_SEED = 7


@dataclass(frozen=True)
class Case:
    """One case: a scene (the reading a right image gives) and its seed."""

    id: str
    mode: str
    scene: object  # models.scenes.world.Scene
    seed: int
    source: None = None  # no input image: the set is text-to-image
    steered: bool = False

    @property
    def prompt(self) -> str:
        return self.scene.prompt

    def expected(self) -> dict:
        from models.scenes.detector import expected_reading

        return expected_reading(self.scene)

    def description(self) -> dict:
        return {"id": self.id, "mode": self.mode, "prompt": self.prompt, "seed": self.seed}


def quality_cases() -> list[Case]:
    """The whole set of SET_VERSION, the same on every machine: a quarter each of one to four objects, interleaved
    so that any prefix of the set holds all four counts."""
    from models.scenes.world import MAX_OBJECTS, random_scene

    rng = random.Random(f"scenes-quality-v{SET_VERSION}")
    return [Case(f"{TEXT_TO_IMAGE}-{index:03d}", TEXT_TO_IMAGE, random_scene(rng, count=1 + index % MAX_OBJECTS),
                 rng.randrange(2**31)) for index in range(SET_SIZE)]


def run_counts(text_cases: int | None) -> dict[str, int]:
    return {TEXT_TO_IMAGE: SET_SIZE if text_cases is None else text_cases}


def run_cases(counts: dict[str, int]) -> list[Case]:
    return quality_cases()[:counts[TEXT_TO_IMAGE]]


def read(image):
    """The detector's reading of a PIL image (models.scenes.detector.SceneReading)."""
    from models.scenes.detector import read_image

    return read_image(image)


def detector_check(cases: list[Case]) -> dict:
    """The detector on the cases' own scenes drawn by the renderer, jittered as in training: the share read exactly
    (1.0, or the run stops) and the cases it misread. Checked once per process for a set of cases (a sweep or a
    sensitivity run judges the same cases many times)."""
    check = _detector_check(tuple(cases))
    return {**check, "misread": list(check["misread"])}


@functools.lru_cache(maxsize=None)
def _detector_check(cases: tuple[Case, ...]) -> dict:
    from models.scenes.world import render

    rng = random.Random(DETECTOR_CHECK_JITTER_SEED)
    misread = [case.id for case in cases if read(render(case.scene, rng)).as_dict() != case.expected()]
    return {"images": len(cases), "exact": 1 - len(misread) / len(cases), "misread": misread,
            "jitter_seed": DETECTOR_CHECK_JITTER_SEED}


def _by_place(objects: list[dict]) -> dict[str, dict]:
    return {o["place"]: o for o in objects}


def summarise(cases: list[dict]) -> dict:
    """The share right of each attribute (objects' attributes over all the set's objects, matched by place; the count
    and the background per image) and of whole images (exact_match)."""
    if not cases:
        return {}
    objects = right = 0
    hits = dict.fromkeys(OBJECT_ATTRIBUTES, 0)
    for case in cases:
        read_objects = _by_place(case["reading"]["objects"])
        for expected in case["expected"]["objects"]:
            objects += 1
            found = read_objects.get(expected["place"])
            for name in OBJECT_ATTRIBUTES:
                hits[name] += found is not None and found[name] == expected[name]
            right += found == expected
    accuracy = {"count": sum(c["reading"]["count"] == c["expected"]["count"] for c in cases) / len(cases),
                "background": sum(c["reading"]["background"] == c["expected"]["background"] for c in cases)
                / len(cases),
                **{name: hits[name] / objects for name in OBJECT_ATTRIBUTES},
                "whole objects": right / objects}
    return {TEXT_TO_IMAGE: {"cases": len(cases), "objects": objects, "judged": list(accuracy),
                            "accuracy": accuracy,
                            "exact_match": sum(c["reading"] == c["expected"] for c in cases) / len(cases)}}


def reading_problem(where: str, expected, reading) -> str | None:
    """What keeps a report's case from being judged (None: nothing): a scenes reading and expectation each."""
    for name, value in (("expected", expected), ("reading", reading)):
        if not (isinstance(value, dict) and isinstance(value.get("background"), str)
                and isinstance(value.get("count"), str) and isinstance(value.get("objects"), list)
                and all(isinstance(o, dict) and all(isinstance(o.get(a), str) for a in OBJECT_ATTRIBUTES)
                        for o in value["objects"])):
            return f"{where} has no scenes {name} (background, count and objects, each with "\
                   f"{', '.join(OBJECT_ATTRIBUTES)})"
    return None


def image_paths(report: dict, report_path: str, ids: set[str]) -> dict[str, Path]:
    """Where the report's images of the cases `ids` are (each case's `image`, beside the report)."""
    folder = Path(report_path).parent
    return {case["id"]: folder / case["image"] for case in report["cases"]
            if case["id"] in ids and isinstance(case.get("image"), str)}


def at_size(image):
    """A PIL image as the detector reads it: RGB, at the world's size, as an array."""
    import numpy as np
    from PIL import Image

    from models.scenes.world import SIZE

    image = image.convert("RGB")
    if image.size != (SIZE, SIZE):
        image = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(image)


@functools.lru_cache(maxsize=None)
def _reference_image(file: Path, modified_ns: int):
    """A reference image at the world's size and its reading: read once per process (every row of a sweep or a
    sensitivity run compares with the same reference)."""
    from PIL import Image

    with Image.open(file) as image:
        pixels = at_size(image)
    return pixels, read(pixels)


def fidelity_per_case(ours: dict, reference_files: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Each case's fidelity figures (bench.fidelity.image_fidelity), this run's image against the reference's:
    `ours` {case id: (PIL image, its reading)}, `reference_files` {case id: the reference's image file}."""
    from bench.fidelity import image_fidelity

    figures = {}
    for case_id, (image, reading) in ours.items():
        file = reference_files[case_id]
        theirs, their_reading = _reference_image(file, file.stat().st_mtime_ns)
        figures[case_id] = image_fidelity(at_size(image), theirs, reading, their_reading)
    return figures
