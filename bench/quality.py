"""Measure how well a model draws what its prompts name: a fixed set of `shapes` scenes rendered with any backend and
settings demo-diffusion takes, each image read back by a deterministic detector; with `--model scenes` (the scenes
yardstick, bench/scenes_quality.py), also how far each image is from an exact run's (fidelity, bench/fidelity.py).

    sd-quality [--model shapes] [--backend B] [--lora FILE[:SCALE]] [--controlnet shapes-controlnet[:SCALE]]
               [--cases N] [--no-edits] [--reference REPORT.json]
    sd-quality --model scenes [--reference REPORT.json [--floor REPORT.json]] [--sensitivity ROW,...]

The set, version QUALITY_SET_VERSION, is drawn from a fixed seed: 200 text-to-image cases (a scene's prompt and a
seed; every shape, colour, background, position and size many times), 24 inpainting cases (a drawn scene whose
object is repainted in another colour through a mask over it) and 24 image-to-image cases at strength 0.6 (a drawn
scene, prompted with its object in another colour). The detector reads each image; the table gives, per
kind, the share of cases whose reading has each attribute the prompt names, the share with all of them, and the share
drawn as outlines (what the outline LoRA changes). With --controlnet (shapes-controlnet), the text-to-image cases
alone, each prompted without its position and steered by its shape's silhouette where the scene puts it (one control
image per ControlNet): the position read back is the ControlNet's doing (at scale 0, chance). With --reference, an
earlier run's figures on the cases both ran stand beside this run's, with the share of images whose reading changed,
per attribute and overall (cases matched by id).

Writes into --output-dir (default quality/): quality-<model>-<backend>-<precision>[-lora-<name>]
[-controlnet-<name>-x<scale>].json (what ran, on what, the per-case readings and the summary) and its chart (.png,
with matplotlib: the `bench` extra); with --save-images (scenes: always), <name>-images/ (a PNG per case and
grid.png, the first 16 text-to-image cases with their prompts). Nothing is written before every case has run; then
the three as one set, whole or not at all, never over what this run did not write: -run2, -run3 ... after the name
where any of them is taken, unless --json names the report (replaced, with its chart; an images folder there is
refused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bench import scenes_quality
from bench.common import log, slug
from bench.sensitivity import parse_rows
from core.atomic import atomic_file, check_writable_directory, check_writable_file, write_new_set
from core.errors import RunFailure, UsageError, at_least, field, render_fields
from demo.backends import INT8_UNET, TORCH
from demo.cli.command import flag_name, run_command
from demo.cli.flags import (
    SPEC,
    CacheFlags,
    ControlNetFlags,
    DemoFlags,
    EngineFlags,
    LoraFlags,
    ModelFlags,
    Parser,
    RequestFlags,
    add_flags,
    add_pipeline_flags,
    changed,
    flag,
    parse_flags,
    same_as,
    summary,
)
from demo.cli.to_spec import spec_from_flags
from demo.request import DEFAULT_STRENGTH, IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE, Request, is_guided
from demo.runtime.spec import PRECISIONS
from models.builtin import SHIPPED_MODELS

if TYPE_CHECKING:
    import numpy as np
    from PIL.Image import Image

    from models.shapes.scenes import Scene

PROG = "sd-quality"
say = partial(log, PROG)

QUALITY_SET_VERSION = 1  # bump it whenever the cases change: reports of different versions are never compared
SET_SIZES = {TEXT_TO_IMAGE: 200, INPAINTING: 24, IMAGE_TO_IMAGE: 24}  # the whole set, in the order it renders
IMAGE_TO_IMAGE_STRENGTH = 0.6  # enough of the schedule to recolour the object, little enough to keep the layout
# What an inpainting case is judged on: the new colour inside the mask, and what the mask must not change.
INPAINTING_JUDGED = ("colour", "shape", "position", "background")
DEFAULT_STEPS = 30
DEFAULT_CASES_PER_CALL = 8
GRID_CASES = 16
GRID_CELL = 256  # pixels a side of each image in the grid (upscaled: the model draws 128)
PROGRESS_EVERY_S = 5.0
SPEED_RUNS = 3  # timed calls after every case has rendered; their median is the speed
SECTION_TITLES = {
    TEXT_TO_IMAGE: "text-to-image",
    INPAINTING: "inpainting: the object repainted in another colour through a mask",
    IMAGE_TO_IMAGE: f"image-to-image at strength {IMAGE_TO_IMAGE_STRENGTH}: the scene, its object in another colour",
}
EXACT_LABELS = {TEXT_TO_IMAGE: "exact match (all five right)",
                INPAINTING: "edit right (new colour; shape, position, background kept)",
                IMAGE_TO_IMAGE: "exact match (all five right)"}
OUTLINE_LABEL = "drawn as outlines"


@dataclass(frozen=True)
class QualityFlags:
    cases: int | None = flag(f"the first N of the {SET_SIZES[TEXT_TO_IMAGE]} text-to-image cases and proportionally "
                             "fewer edits (at least one of each kind), for quick runs (default: the whole set)",
                             metavar="N")
    no_edits: bool = flag("text-to-image cases only (no inpainting or image-to-image)", False)
    reference: str | None = flag("an earlier sd-quality JSON of the same set version: its figures beside this run's, "
                                 "and the share of images whose reading changed, per attribute and overall (cases "
                                 "matched by id)", metavar="REPORT.json")
    output_dir: str = flag("where the JSON, its chart and the images go (default: %(default)s)", "quality")
    json_path: str | None = flag("the JSON's path, replaced if it exists; the chart and the images take its name "
                                 "(default: <output-dir>/quality-<model>-<backend>-<precision>[-lora-<name>].json, "
                                 "never replacing one)", name="--json", metavar="PATH")
    save_images: bool = flag("also write each case's image, and a grid of the first 16 text-to-image cases with "
                             "their prompts", False)
    cache_sweep: str | None = flag("the step cache's curve: render the set without the cache, then at each "
                                   "interval:branch of this comma list (e.g. 2:0,3:0,5:0,3:2), each against the "
                                   "uncached run, and write a table and chart of exact match (and with scenes, "
                                   "fidelity) against speed (timed after warm-up; docs/step-cache.md)",
                                   metavar="N:K,...")
    yardstick: str | None = flag("the case set and detector that judge the run: shapes or scenes (default: scenes for "
                                 "the scenes and scenes-sd3 models, by name or folder; else shapes)", None,
                                 choices=("shapes", "scenes"), metavar="NAME")
    floor: str | None = flag("scenes: a report made against the same --reference by an exact run (fp32 at another "
                             "batch size; for a fast path, the exact path at its precision): the noise floor; this "
                             "run is flagged where it differs from the reference more than the floor does, by more "
                             "than a metric's margin (paired bootstrap, 95%%)", metavar="REPORT.json")
    sensitivity: str | None = flag("scenes: render an fp32 reference and an fp32 floor at half the batch, then each "
                                   "of these comma-listed paths against them (fp16, cache:N[:K], threshold:T[:K], "
                                   "forecast:T, vae:P, fp8[:S], compile, cuda-graphs, plugins, engines, "
                                   "engines-no-plugins), and "
                                   "write a table and chart of their fidelity with intervals, each flagged or not "
                                   "(docs/quality.md)", metavar="ROW,...")


@dataclass(frozen=True)
class RenderFlags:
    """How every case renders: demo-diffusion's request flags, less what the set decides (prompt, seed, size)."""

    negative_prompt: str | None = same_as(RequestFlags, "negative_prompt")
    # its own default, not what a model or LoRA recommends: the yardstick's readings are of this many steps
    denoising_steps: int = flag("scheduler steps (default: %(default)s, whatever the model or LoRA recommends)",
                                DEFAULT_STEPS)
    guidance_scale: float | None = same_as(RequestFlags, "guidance_scale")
    scheduler: str | None = same_as(RequestFlags, "scheduler")
    timestep_spacing: str | None = same_as(RequestFlags, "timestep_spacing")
    karras_sigmas: bool | None = same_as(RequestFlags, "karras_sigmas")
    eta: float | None = same_as(RequestFlags, "eta")
    timesteps: tuple[int, ...] | None = same_as(RequestFlags, "timesteps")
    backend: str = same_as(DemoFlags, "backend")
    precision: str = flag("auto (the backend's own: engines fp16; torch fp16 on a GPU, fp32 on a CPU), fp16, fp32 "
                          "or fp8 (the UNet's GEMMs in FP8 on the torch backend: docs/torch-backend.md) (default: "
                          "%(default)s)", SPEC.precision, choices=PRECISIONS)
    max_batch_size: int = flag("the most text-to-image cases one pipeline call renders, each from its own seed (an "
                               "edit is a call of its own); engines of one batch (--build-static-batch, "
                               "--use-cuda-graph) take 1 (default: %(default)s)", DEFAULT_CASES_PER_CALL)


def build_parser() -> Parser:
    p = Parser(prog=PROG, description=summary(__doc__))
    add_flags(p, ModelFlags, model="shapes")
    add_flags(p, QualityFlags, "the cases and the outputs")
    add_flags(p, RenderFlags, "rendering")
    add_flags(p, LoraFlags, "LoRA")
    add_flags(p, ControlNetFlags, "ControlNet", description="with --controlnet, the text-to-image cases alone, each "
              "prompted without its position and steered by its shape's silhouette")
    add_pipeline_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_command(PROG, lambda: run(parse_flags(build_parser(), argv), shlex.join([PROG, *argv])))


# ---- the case set ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One case: what its prompt asks for (`scene`: the reading a right image gives) and its seed; an edit's input
    image is `source` drawn with its jitter (`jitter_seed`), an inpainting case's mask a rectangle over its object."""

    id: str
    mode: str
    scene: Scene
    seed: int
    source: Scene | None = None
    jitter_seed: int | None = None
    steered: bool = False  # by ControlNets: the prompt leaves the position to the control image

    @property
    def prompt(self) -> str:
        from models.shapes.scenes import unplaced_prompt

        return unplaced_prompt(self.scene) if self.steered else self.scene.prompt

    def control_image(self) -> Image:
        """What steers the case: its scene's shape white on black, where the scene puts it (no jitter)."""
        from models.shapes.scenes import silhouette

        return silhouette(self.scene)

    @property
    def strength(self) -> float | None:
        """An edit's: inpainting repaints the masked part from noise (its default, 1.0)."""
        return {IMAGE_TO_IMAGE: IMAGE_TO_IMAGE_STRENGTH, INPAINTING: DEFAULT_STRENGTH[INPAINTING]}.get(self.mode)

    def input_image(self) -> Image | None:
        from models.shapes.scenes import render

        return None if self.source is None else render(self.source, random.Random(self.jitter_seed))

    def mask_box(self) -> tuple[int, int, int, int] | None:
        from models.shapes.scenes import object_box

        return object_box(self.source) if self.mode == INPAINTING else None

    def mask_image(self) -> Image | None:
        from PIL import Image, ImageDraw

        from models.shapes.scenes import SIZE

        box = self.mask_box()
        if box is None:
            return None
        mask = Image.new("L", (SIZE, SIZE), 0)
        ImageDraw.Draw(mask).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=255)  # right, bottom exclusive
        return mask

    def expected(self) -> dict[str, str]:
        """What a right image shows: the prompt's scene, each attribute the detector reads."""
        from models.shapes.scenes import ATTRIBUTES

        return {name: getattr(self.scene, name) for name in ATTRIBUTES}

    def description(self) -> dict:
        """What makes the case: its prompt and seed, an edit's input scene, jitter, mask and strength."""
        described = {"id": self.id, "mode": self.mode, "prompt": self.prompt, "seed": self.seed}
        if self.steered:
            described["control_image"] = "the scene's silhouette"
        if self.source is not None:
            described.update(input=self.source.prompt, jitter_seed=self.jitter_seed, strength=self.strength)
        if self.mode == INPAINTING:
            described["mask"] = list(self.mask_box())
        return described


def case_id(mode: str, index: int) -> str:
    return f"{mode}-{index:03d}"


def _deck(rng: random.Random, values: list, count: int) -> list:
    """`count` values drawn as from shuffled decks of `values`: every run of len(values) holds each once, so any
    prefix of the set is balanced too."""
    drawn = []
    while len(drawn) < count:
        drawn += rng.sample(values, len(values))
    return drawn[:count]


def _balanced_scenes(rng: random.Random, count: int) -> list[Scene]:
    from models.shapes.scenes import COLOURS, POSITIONS, SHAPES, SIZES, Scene

    pairs = [(colour, background) for colour in COLOURS for background in COLOURS if colour != background]
    columns = (_deck(rng, list(SHAPES), count), _deck(rng, pairs, count), _deck(rng, list(POSITIONS), count),
               _deck(rng, list(SIZES), count))
    return [Scene(shape, colour, background, position, size)
            for shape, (colour, background), position, size in zip(*columns)]


def quality_cases() -> list[Case]:
    """The whole set of QUALITY_SET_VERSION, the same on every machine: the text-to-image cases, then the inpainting
    and the image-to-image ones (each prompting its input scene with the object in a colour neither it nor the
    background has)."""
    from models.shapes.scenes import COLOURS

    rng = random.Random(f"shapes-quality-v{QUALITY_SET_VERSION}")
    cases = [Case(case_id(TEXT_TO_IMAGE, index), TEXT_TO_IMAGE, scene, rng.randrange(2**31))
             for index, scene in enumerate(_balanced_scenes(rng, SET_SIZES[TEXT_TO_IMAGE]))]
    for mode in (INPAINTING, IMAGE_TO_IMAGE):
        for index, source in enumerate(_balanced_scenes(rng, SET_SIZES[mode])):
            colour = rng.choice([c for c in COLOURS if c not in (source.colour, source.background)])
            cases.append(Case(case_id(mode, index), mode, source.with_(colour=colour), rng.randrange(2**31), source,
                              rng.randrange(2**31)))
    return cases


def run_counts(text_cases: int | None, edits: bool) -> dict[str, int]:
    """How many cases of each kind a run takes: the first `text_cases` text-to-image ones (None: all) and as large a
    share of each edit kind, rounded up."""
    total = SET_SIZES[TEXT_TO_IMAGE]
    text_cases = total if text_cases is None else text_cases
    return {mode: text_cases if mode == TEXT_TO_IMAGE else math.ceil(size * text_cases / total) if edits else 0
            for mode, size in SET_SIZES.items()}


def run_case_ids(counts: dict[str, int]) -> list[str]:
    return [case_id(mode, index) for mode, count in counts.items() for index in range(count)]


def select_cases(cases: list[Case], counts: dict[str, int]) -> list[Case]:
    wanted = set(run_case_ids(counts))
    return [case for case in cases if case.id in wanted]


def run_cases(counts: dict[str, int], steered: bool) -> list[Case]:
    """The cases a run takes (`steered`: by ControlNets, each prompted without its position)."""
    cases = select_cases(quality_cases(), counts)
    return [dataclasses.replace(case, steered=True) for case in cases] if steered else cases


# ---- judging -----------------------------------------------------------------------------------------------------

def judged(mode: str, attributes: list[str]) -> list[str]:
    return list(INPAINTING_JUDGED) if mode == INPAINTING else attributes


def summarise(cases: list[dict]) -> dict:
    """Per kind of case: how many, the share right of each attribute the prompt names, the share with every judged
    one right (exact_match), and the share drawn as outlines. `cases`: the report's per-case entries."""
    result = {}
    for mode in SET_SIZES:
        entries = [case for case in cases if case["mode"] == mode]
        if not entries:
            continue
        attributes = list(entries[0]["expected"])
        if mode != TEXT_TO_IMAGE:  # an edit's new colour first, then what it keeps
            attributes.sort(key=lambda name: name != "colour")
        right = [{name: case["reading"][name] == case["expected"][name] for name in attributes} for case in entries]
        result[mode] = {
            "cases": len(entries),
            "judged": judged(mode, attributes),
            "accuracy": {name: sum(r[name] for r in right) / len(entries) for name in attributes},
            "exact_match": sum(all(r[name] for name in judged(mode, attributes)) for r in right) / len(entries),
            "outline_share": sum(case["reading"]["style"] == "outline" for case in entries) / len(entries),
        }
    return result


def changed_readings(cases: list[dict], reference_cases: list[dict]) -> dict:
    """Of the cases both runs have (matched by id): how many, and per reading field and overall ("any") the share
    whose reading differs."""
    earlier = {case["id"]: case["reading"] for case in reference_cases}
    both = [(case["reading"], earlier[case["id"]]) for case in cases if case["id"] in earlier]
    if not both:
        return {"cases": 0, "share": {}}
    fields = list(both[0][0])
    differs = [{name: now[name] != before.get(name) for name in fields} for now, before in both]
    share = {name: sum(d[name] for d in differs) / len(both) for name in fields}
    share["any"] = sum(any(d.values()) for d in differs) / len(both)
    return {"cases": len(both), "share": share}


def summary_lines(mode: str, figures: dict, yardstick: str = "shapes") -> list[tuple[str, float]]:
    """A kind's figures as (label, share) lines, in the table's and the chart's order."""
    def label(name: str) -> str:
        if mode == TEXT_TO_IMAGE:
            return name
        return "new colour" if name == "colour" else f"{name} kept"

    return ([(label(name), share) for name, share in figures["accuracy"].items()]
            + [(YARDSTICKS[yardstick].exact_labels[mode], figures["exact_match"])]
            + ([(OUTLINE_LABEL, figures["outline_share"])] if "outline_share" in figures else []))


def _percent(share: float | None) -> str:
    return "—" if share is None else f"{100 * share:.1f}%"


def _cases(count: int) -> str:
    return f"{count} case" if count == 1 else f"{count} cases"


def scheduler_text(settings: dict) -> str:
    """The scheduler and the options the run set (a report from before they existed has none)."""
    options = settings.get("scheduler_options") or {}
    shown = [f"{name.replace('_', ' ')} {','.join(map(str, value)) if isinstance(value, list) else value}"
             for name, value in options.items()]
    return " ".join([settings["scheduler"], *(["(" + ", ".join(shown) + ")"] if shown else [])])


def run_title(report: dict, detailed: bool) -> str:
    """What rendered the images: model, backend, precision and what else changes them (an INT8 UNet, LoRAs, the step
    cache); detailed adds the device, scheduler and guidance."""
    settings = report["settings"]
    quantized = [INT8_UNET] if INT8_UNET in settings["options"] else []
    what = ", ".join([settings["precision"], *quantized, *([settings["device"]] if detailed else [])])
    loras = ", ".join(f"{Path(lora['path']).name} x {lora['scale']}" for lora in settings["loras"])
    return (f"{report['model']} on {settings['backend']} ({what}), "
            + (f"{scheduler_text(settings)}, " if detailed else "") + f"{settings['steps']} steps"
            + (f", guidance {settings['guidance_scale']}" if detailed else "")
            + (f", LoRA {loras}" if loras else "")
            + "".join(f", ControlNet {Path(name).name} x {scale}" for name, scale in settings.get("controlnets", ()))
            + (f", adaptive step cache at {settings['cache_threshold']:g} (branch {settings['cache_branch']}"
               + (", forecast)" if settings.get("cache_forecast") else ")")
               if settings.get("cache_threshold") else
               f", step cache every {settings['cache_interval']} (branch {settings['cache_branch']})"
               if settings.get("cache_branch") is not None else ""))


def quality_table(report: dict) -> str:
    """The report as markdown: a table per kind of case (beside the reference's figures where there is one), then the
    readings that changed against it."""
    reference = report.get("reference")
    parts = [f"sd-quality, case set v{report['set_version']}: {run_title(report, detailed=True)}"
             + (f"; reference: {reference['path']}" if reference else "")]
    for mode, figures in report["summary"].items():
        earlier = reference["summary"].get(mode) if reference else None
        earlier_lines = dict(summary_lines(mode, earlier, report_yardstick(report))) if earlier else {}
        head = f"| {SECTION_TITLES[mode]}, {_cases(figures['cases'])} | this run |"
        rule = "| --- | ---: |"
        if reference:
            head += f" reference ({_cases(earlier['cases'] if earlier else 0)}) |"
            rule += " ---: |"
        lines = [head, rule]
        for label, share in summary_lines(mode, figures, report_yardstick(report)):
            lines.append(f"| {label} | {_percent(share)} |" + (f" {_percent(earlier_lines.get(label))} |"
                                                                if reference else ""))
        parts.append("\n".join(lines))
    if reference:
        changed = reference["changed"]
        lines = [f"| readings changed against the reference, {changed['cases']} images in both | share |",
                 "| --- | ---: |"]
        lines += [f"| {name if name != 'any' else 'any attribute'} | {_percent(share)} |"
                  for name, share in changed["share"].items()]
        parts.append("\n".join(lines))
        if "fidelity" in reference:
            parts.append(fidelity_table(reference["fidelity"]))
    return "\n\n".join(parts) + "\n"


def fidelity_table(fidelity: dict) -> str:
    """Each metric's mean with its 95% interval, and with a floor its excess over the floor's and whether that is
    beyond the metric's margin."""
    from bench.fidelity import METRICS, interval_text

    summary, floor = fidelity["summary"], fidelity.get("floor")
    head = f"| fidelity to the reference, {fidelity['cases']} images | mean [95% interval] |"
    rule = "| --- | ---: |"
    if floor:
        head += " loss beyond the floor's [95%] | margin | flagged |"
        rule += " ---: | ---: | :---: |"
    lines = [head, rule]
    for metric in METRICS:
        figures = summary[metric]
        line = f"| {METRIC_LABELS[metric]} | {interval_text(figures['value'])} |"
        if floor:
            excess = figures["excess"]
            line += f" {interval_text(excess)} | {excess['margin']:g} | {'yes' if excess['flagged'] else 'no'} |"
        lines.append(line)
    verdict = ""
    if floor:
        verdict = (f"\n\nfloor: {floor}; flagged: " + (", ".join(summary["flagged_by"]) if summary["flagged"] else
                                                       "no (within the floor's noise and the margins)"))
    return "\n".join(lines) + verdict


METRIC_LABELS = {"mask_iou": "object mask IoU", "centroid_shift": "centroid shift (pixels)",
                 "colour_distance": "colour distance (8-bit RGB)", "frequency_error": "pattern frequency error "
                 "(changes per pixel)", "ssim": "SSIM, whole image"}


def quality_chart(report: dict) -> bytes:
    """Per kind of case, a bar for each line of the table; the reference's beside this run's where there is one."""
    from matplotlib.figure import Figure

    reference = report.get("reference")
    modes = list(report["summary"])
    heights = [len(summary_lines(mode, report["summary"][mode], report_yardstick(report))) + 1 for mode in modes]
    figure = Figure(figsize=(10, 0.3 * sum(heights) + 1.5), dpi=100, layout="constrained")
    axes = figure.subplots(len(modes), 1, squeeze=False, height_ratios=heights)[:, 0]
    runs = [("this run", report["summary"], "#4c72b0")]
    if reference:
        runs.append(("reference", reference["summary"], "#bbbbbb"))
    bar = 0.8 / len(runs)
    for ax, mode in zip(axes, modes):
        labels = [label for label, _ in summary_lines(mode, report["summary"][mode], report_yardstick(report))]
        for offset, (name, figures, colour) in enumerate(runs):
            shares = dict(summary_lines(mode, figures[mode], report_yardstick(report))) if mode in figures else {}
            places = [y + (offset - (len(runs) - 1) / 2) * bar for y in range(len(labels))]
            values = [100 * shares.get(label, 0.0) for label in labels]
            ax.barh(places, values, bar, color=colour, label=name)
            for y, value, label in zip(places, values, labels):
                if label in shares:
                    ax.text(value, y, f" {value:.1f}", va="center", fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_xlim(0, 130)  # room on the right for the legend beside the bars reaching 100
        ax.set_xticks(range(0, 101, 20))
        ax.set_title(f"{SECTION_TITLES[mode]}, {_cases(report['summary'][mode]['cases'])}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("% of cases")
    figure.suptitle(f"sd-quality v{report['set_version']}: {run_title(report, detailed=False)}", fontsize=10)
    if reference:
        axes[0].legend(fontsize=8, loc="lower right")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def grid_image(images: list[Image], cases: list[dict]) -> Image:
    """The images in rows of four, each upscaled with its prompt beneath, and what the detector read differently."""
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=14)
    columns, caption = 4, 76
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * GRID_CELL, rows * (GRID_CELL + caption)), "white")
    draw = ImageDraw.Draw(grid)
    for index, (image, case) in enumerate(zip(images, cases)):
        left, top = index % columns * GRID_CELL, index // columns * (GRID_CELL + caption)
        grid.paste(image.resize((GRID_CELL, GRID_CELL), Image.Resampling.NEAREST), (left, top))
        draw.multiline_text((left + 4, top + GRID_CELL + 2), "\n".join(textwrap.wrap(case["prompt"], 32)),
                            fill="black", font=font, spacing=1)
        read = case["reading"]
        wrong = [read[name] if isinstance(read[name], str) else name  # scenes: "objects"
                 for name in case["expected"] if read[name] != case["expected"][name]]
        if wrong:
            text = "read: " + ", ".join(wrong)
            while draw.textlength(text, font=font) > GRID_CELL - 8:
                text = text[:-2] + "…"
            draw.text((left + 4, top + GRID_CELL + caption - 18), text, fill="#c00000", font=font)
    return grid


# ---- checking the command line -----------------------------------------------------------------------------------

def read_report(path: str, counts: dict[str, int], yardstick: Yardstick, given: str = "--reference") -> dict:
    """A --reference (or --floor) report, checked before anything loads: an sd-quality JSON (reference_problem) of
    this yardstick and set version whose cases share some with this run (with scenes: all of them, with their
    images)."""
    where = f"{given} {path}"
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except ValueError as exc:
        raise UsageError(f"{where}: not JSON ({exc})") from None
    problem = reference_problem(report)
    if problem:
        raise UsageError(f"{where}: not an sd-quality report ({problem})")
    if report_yardstick(report) != yardstick.name:
        raise UsageError(f"{where} was judged by the {report_yardstick(report)} yardstick, this run by "
                         f"{yardstick.name}: only runs of one case set compare")
    if report["set_version"] != yardstick.set_version:
        raise UsageError(f"{where}: made on case set version {report['set_version']}, this run's is "
                         f"{yardstick.set_version}: only runs of one version compare")
    ours = set(run_case_ids(counts))
    cases = report["cases"]
    if not any(case["id"] in ours for case in cases):
        raise UsageError(f"{where}: no case in common with this run (it has {len(cases)}, none of this run's "
                         f"{len(ours)}; see --cases and --no-edits)")
    if yardstick.keeps_images and given == "--reference":  # fidelity compares each image with the reference's
        missing = sorted(ours - {case["id"] for case in cases})
        if missing:
            raise UsageError(f"{where} lacks {len(missing)} of this run's cases (first: {missing[0]}): give as many "
                             "--cases as it ran, or fewer")
        images = scenes_quality.image_paths(report, path, ours)
        absent = sorted(case_id for case_id in ours if case_id not in images or not images[case_id].is_file())
        if absent:
            raise UsageError(f"{where}: the image of case {absent[0]} is not beside it "
                             f"({images.get(absent[0], 'none named')}; {len(absent)} missing)")
    return report


def read_floor(path: str, reference_path: str, counts: dict[str, int]) -> dict:
    """A --floor report: a scenes report made against the same --reference, with the fidelity of each of this run's
    cases."""
    where = f"--floor {path}"
    report = read_report(path, counts, SCENES, given="--floor")
    theirs = (report.get("reference") or {}).get("path")
    if not theirs or Path(theirs).resolve() != Path(reference_path).resolve():
        raise UsageError(f"{where} was made against {theirs or 'no reference'}, not against --reference "
                         f"{reference_path}: a floor is two exact runs' difference, measured on the same reference")
    figures = {case["id"]: case.get("fidelity") for case in report["cases"]}
    lacking = [case_id for case_id in run_case_ids(counts) if not isinstance(figures.get(case_id), dict)]
    if lacking:
        raise UsageError(f"{where}: case {lacking[0]} has no fidelity figures (a floor needs each of this run's)")
    return report


def _is_text_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(item, str) for item in value.values())


def reference_problem(report) -> str | None:
    """What keeps `report` from being compared with (None: nothing): a whole-number set_version, and cases each with
    a unique id, a mode, the expected attributes and a reading of every one of them and the style, all text."""
    if not isinstance(report, dict):
        return "it is not a JSON object"
    version = report.get("set_version")
    if type(version) is not int:  # bool is an int too, and "1" would read as version 1 in a message
        return f"its set_version must be a whole number, got {json.dumps(version)}"
    cases = report.get("cases")
    if not isinstance(cases, list):
        return "it has no list of cases"
    seen = set()
    for index, case in enumerate(cases):
        if not (isinstance(case, dict) and isinstance(case.get("id"), str) and case["id"] not in seen):
            return f"case {index} has no id of its own"
        seen.add(case["id"])
        where = f"case {case['id']}"
        yardstick = YARDSTICKS.get(report_yardstick(report))
        if yardstick is None:
            return f"its yardstick {json.dumps(report.get('yardstick'))} is none of {', '.join(YARDSTICKS)}"
        if case.get("mode") not in yardstick.set_sizes:
            return f"{where}'s mode is none of {', '.join(yardstick.set_sizes)}"
        problem = yardstick.reading_problem(where, case.get("expected"), case.get("reading"))
        if problem:
            return problem
    return None


def shapes_reading_problem(where: str, expected, reading) -> str | None:
    if not (_is_text_map(expected) and expected):
        return f"{where} has no expected attributes"
    if not _is_text_map(reading):
        return f"{where} has no reading"
    lacking = [name for name in (*expected, "style") if name not in reading]
    if lacking:
        return f"{where}'s reading lacks {', '.join(lacking)}"
    return None


def check_same_cases(reference: dict, path: str, cases: list, given: str = "--reference") -> None:
    """A UsageError unless each case the reference and this run both have is the same case: its prompt, seed, inputs
    and control image, and what its image should show (a run steered by ControlNets prompts its cases without their
    position)."""
    where = f"{given} {path}"
    earlier = {case["id"]: case for case in reference["cases"]}
    derived = ("reading", "image", "fidelity")  # what a run made, not what makes its case
    for case in cases:
        if case.id not in earlier:
            continue
        theirs = {name: value for name, value in earlier[case.id].items() if name not in derived}
        ours = {**case.description(), "expected": case.expected()}
        if theirs == ours:
            continue
        if ("control_image" in theirs) != case.steered:
            made, ran = ("without", "with") if case.steered else ("with", "without")
            raise UsageError(f"{where} was made {made} {field('controlnets')} and this run {ran}: a steered case's "
                             "prompt leaves its position to the ControlNets; only runs of the same cases compare")
        differs = sorted(name for name in {*theirs, *ours} if theirs.get(name) != ours.get(name))
        raise UsageError(f"{where}: its case {case.id} is not this run's (different {', '.join(differs)}): only "
                         "runs of the same cases compare")


def compare_with(reference: dict, path: str, entries: list[dict], images: list[Image] | None = None,
                 readings: list | None = None, floor: tuple[dict, str] | None = None) -> dict:
    """The reference's figures on the cases this run has too (so that a subset compares with the same subset), and
    the readings that changed; with scenes (`images` and their `readings`: this run's, in the entries' order), each
    image's fidelity to the reference's (into its entry) and their summary, against the `floor` report's where
    given."""
    ours = {entry["id"] for entry in entries}
    yardstick = YARDSTICKS[report_yardstick(reference)]
    compared = {"path": path, "model": reference.get("model"), "settings": reference.get("settings"),
                "summary": yardstick.summarise([case for case in reference["cases"] if case["id"] in ours]),
                "changed": changed_readings(entries, reference["cases"])}
    if yardstick.keeps_images and images is not None:
        from bench.fidelity import summarise_fidelity

        figures = scenes_quality.fidelity_per_case(
            {entry["id"]: (image, reading) for entry, image, reading in zip(entries, images, readings)},
            scenes_quality.image_paths(reference, path, ours))
        for entry in entries:
            entry["fidelity"] = figures[entry["id"]]
        floor_figures = None
        if floor is not None:
            by_id = {case["id"]: case["fidelity"] for case in floor[0]["cases"] if case["id"] in ours}
            floor_figures = [by_id[entry["id"]] for entry in entries]
        compared["fidelity"] = {"cases": len(entries), "floor": None if floor is None else floor[1],
                                "summary": summarise_fidelity([entry["fidelity"] for entry in entries],
                                                              floor_figures)}
    return compared


@dataclass(frozen=True)
class Yardstick:
    """What judges a run: a world's case set (its version, the kinds of case and their sizes), its detector's
    reading of an image, and how readings are scored; `keeps_images`: its reports always hold their images, which
    fidelity to a reference compares."""

    name: str
    set_version: int
    set_sizes: dict[str, int]
    exact_labels: dict[str, str]
    counts: Callable[[int | None, bool], dict[str, int]]  # (--cases, edits) -> the cases of each kind a run takes
    cases: Callable[[dict[str, int], bool], list]  # (counts, steered) -> the run's cases
    read: Callable[[Image], object]  # the detector's reading (its as_dict() goes into the report)
    summarise: Callable[[list[dict]], dict]
    reading_problem: Callable[[str, object, object], str | None]
    keeps_images: bool


def _read_shapes(image: Image):
    from models.shapes.detector import read_image

    return read_image(image)


SHAPES = Yardstick("shapes", QUALITY_SET_VERSION, SET_SIZES, EXACT_LABELS, run_counts, run_cases, _read_shapes,
                   summarise, shapes_reading_problem, keeps_images=False)
SCENES = Yardstick(scenes_quality.NAME, scenes_quality.SET_VERSION, scenes_quality.SET_SIZES,
                   scenes_quality.EXACT_LABELS, lambda text_cases, edits: scenes_quality.run_counts(text_cases),
                   lambda counts, steered: scenes_quality.run_cases(counts),
                   scenes_quality.read, scenes_quality.summarise,
                   scenes_quality.reading_problem, keeps_images=True)
YARDSTICKS = {yardstick.name: yardstick for yardstick in (SHAPES, SCENES)}


def report_yardstick(report: dict) -> str:
    """The yardstick that judged a report (reports before `scenes` were all shapes')."""
    return report.get("yardstick", SHAPES.name)


def yardstick_of(model: str, named: str | None = None) -> Yardstick:
    """The yardstick `named` (--yardstick), else the one a --model is judged by: a shipped built-in's own (by name
    or its folder: scenes for `scenes` and `scenes-sd3`), shapes for any other."""
    if named is not None:
        return YARDSTICKS[named]
    for name, package in SHIPPED_MODELS.items():
        if model == name or Path(model).expanduser().resolve() == package.MODEL_DIR.resolve():
            return YARDSTICKS[package.YARDSTICK]
    return SHAPES


def check_flags(quality: QualityFlags, render: RenderFlags, engine: EngineFlags, cache: CacheFlags,
                steered: bool = False, yardstick: Yardstick = SHAPES) -> dict[str, int]:
    """Everything the command line alone decides, before torch is imported: the cases this run takes (`steered`: by
    ControlNets, the text-to-image ones alone)."""
    most = yardstick.set_sizes[TEXT_TO_IMAGE]
    if quality.cases is not None and not 1 <= quality.cases <= most:
        raise UsageError(f"--cases must be 1..{most}, got {quality.cases}")
    counts = yardstick.counts(quality.cases, not (quality.no_edits or steered))
    scenes_only = [name for name, given in (("--floor", quality.floor), ("--sensitivity", quality.sensitivity))
                   if given is not None]
    if scenes_only and not yardstick.keeps_images:
        raise UsageError(f"{' and '.join(scenes_only)} compare images by the scenes yardstick: give --model scenes or "
                         "scenes-sd3")
    if quality.floor is not None and quality.reference is None:
        raise UsageError("--floor is a difference from a reference: give the --reference it was made against")
    if quality.sensitivity is not None:
        parse_rows(quality.sensitivity)
        if quality.cache_sweep is not None or quality.json_path is not None or quality.reference is not None:
            raise UsageError("--sensitivity renders its own reference and floor and names its reports: drop "
                             "--cache-sweep, --json, --reference and --floor")
        given = changed(cache)
        if given:
            raise UsageError(f"--sensitivity sets the step cache of each of its rows: drop {' and '.join(given)}")
    at_least("max_batch_size", render.max_batch_size, 1)
    if render.max_batch_size > 1 and render.backend != TORCH and (engine.build_static_batch or engine.use_cuda_graph):
        raise UsageError("--build-static-batch and --use-cuda-graph make engines of one batch, and the cases run as "
                         "one-image requests, up to --max-batch-size to a call: give --max-batch-size 1")
    Request("", **case_fields(render)).check_inputs()
    if counts.get(IMAGE_TO_IMAGE) and int(render.denoising_steps * IMAGE_TO_IMAGE_STRENGTH) < 1:
        raise UsageError(f"--denoising-steps {render.denoising_steps} leaves the image-to-image cases (strength "
                         f"{IMAGE_TO_IMAGE_STRENGTH}) no step to run: give 2 or more, or --no-edits")
    check_writable_directory("output directory", Path(quality.output_dir))
    if quality.cache_sweep is not None:
        parse_sweep(quality.cache_sweep)
        if quality.json_path is not None or quality.reference is not None:
            raise UsageError("--cache-sweep names its reports itself, each against its own uncached run: drop --json "
                             "and --reference")
        given = changed(cache)
        if given:
            raise UsageError(f"--cache-sweep sets the step cache of each of its runs: drop {' and '.join(given)}")
    if quality.json_path is not None:
        check_writable_file("--json file", Path(quality.json_path))
        if quality.reference and Path(quality.json_path).resolve() == Path(quality.reference).resolve():
            raise UsageError("--json names the --reference file: this run would replace what it compares with")
        images_dir = outputs_of(Path(quality.json_path))[1]
        if quality.save_images and _exists(images_dir):
            raise UsageError(f"--save-images: {images_dir} is there already, and this run never replaces what it "
                             "did not write: move it away, or give another --json")
    return counts


def quality_notes(quality: QualityFlags, render: RenderFlags, steered: bool, yardstick: Yardstick = SHAPES
                  ) -> list[str]:
    """What this command's own flags set that the run does not use."""
    notes = []
    if yardstick.keeps_images:
        notes += [f"{name} unused with the {yardstick.name} yardstick: {why}" for name, given, why in (
            ("--no-edits", quality.no_edits, "its cases are text-to-image alone"),
            ("--save-images", quality.save_images, "its reports always keep their images (fidelity compares them)"))
            if given]
    if quality.sensitivity is not None:
        notes += [f"{name} unused with --sensitivity, whose rows set it" for name, given in (
            ("--backend", render.backend != RenderFlags.backend), ("--precision", render.precision != SPEC.precision))
            if given]
    if quality.no_edits and steered:
        notes.append(f"--no-edits unused with {field('controlnets')}: a steered run takes the text-to-image cases "
                     "alone")
    if quality.json_path is not None and quality.output_dir != QualityFlags.output_dir:
        notes.append("--output-dir unused beside --json, which names the report's path")
    return notes


def run(flags, command: str) -> int:
    quality, render = flags[QualityFlags], flags[RenderFlags]
    steered = bool(flags[ControlNetFlags].controlnet)
    yardstick = yardstick_of(flags[ModelFlags].model, quality.yardstick)
    counts = check_flags(quality, render, flags[EngineFlags], flags[CacheFlags], steered, yardstick)
    reference = (read_report(quality.reference, counts, yardstick), quality.reference) if quality.reference else None
    floor = (read_floor(quality.floor, quality.reference, counts), quality.floor) if quality.floor else None
    spec = spec_from_flags(flags, backend=render.backend, precision=render.precision, scheduler=render.scheduler,
                           batch_size=render.max_batch_size, max_batch_size=render.max_batch_size,
                           guided=is_guided(render.guidance_scale),
                           modes=tuple(mode for mode, count in counts.items() if count))
    spec.check()
    for note in quality_notes(quality, render, steered, yardstick):
        print(f"note: {render_fields(note, flag_name)}", file=sys.stderr, flush=True)
    for given, compared in (("--reference", reference), ("--floor", floor)):  # the set loads torch: after the checks
        if compared is not None:
            check_same_cases(*compared, yardstick.cases(counts, steered), given)
    if quality.cache_sweep is not None:
        return sweep(flags, spec, counts, parse_sweep(quality.cache_sweep), command)
    if quality.sensitivity is not None:
        return sensitivity(flags, spec, counts, parse_rows(quality.sensitivity), command)
    measure(flags, spec, counts, reference, command, floor=floor)
    return 0


def parse_sweep(text: str) -> list[tuple[int, int]]:
    """--cache-sweep's interval:branch pairs (a UsageError for anything else)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        interval, colon, branch = item.partition(":")
        if not (colon and interval.isdigit() and branch.isdigit() and int(interval) >= 2):
            raise UsageError(f"--cache-sweep takes interval:branch pairs like 3:0 (interval 2 or more), got '{item}'")
        pairs.append((int(interval), int(branch)))
    if not pairs:
        raise UsageError("--cache-sweep names no interval:branch pair")
    return pairs


def sweep(flags, spec, counts: dict[str, int], pairs: list[tuple[int, int]], command: str) -> int:
    """The set without the cache, then at each pair against it; then the curve (bench.cache_sweep)."""
    from bench.cache_sweep import sweep_chart, sweep_summary, sweep_table
    from models.source import resolve_model
    from models.unet_cache import Branches

    quality = flags[QualityFlags]
    branches = Branches.of(resolve_model(spec.model, vae=spec.vae, config=spec.model_config,
                                      prediction_type=spec.prediction_type).denoiser_config)
    for _, branch in pairs:  # a bad branch is a usage error before anything renders
        branches.check(branch)
    uncached, path = measure(flags, dataclasses.replace(spec, cache_interval=1), counts, None, command)
    reports = [uncached]
    for interval, branch in pairs:
        say(f"step cache every {interval}, branch {branch}")
        cached = dataclasses.replace(spec, cache_interval=interval, cache_branch=branch)
        reports.append(measure(flags, cached, counts, (uncached, str(path)), command)[0])
    summary = sweep_summary(reports, command)
    return write_summary(quality, f"{path.stem}-cache-sweep", sweep_table(summary), summary, sweep_chart)


def sensitivity(flags, spec, counts: dict[str, int], rows: list[str], command: str) -> int:
    """The fp32 reference, the floor (fp32 at half the batch), then each row against them (bench.sensitivity); a row
    that cannot run here is one line in the table, and the rest still run."""
    from bench.sensitivity import (
        BASELINE_ROW,
        exact_spec,
        planting,
        row_spec,
        sensitivity_chart,
        sensitivity_summary,
        sensitivity_table,
    )
    from models.families import STEP_CACHE
    from models.source import resolve_model
    from models.unet_cache import Branches

    quality, render = flags[QualityFlags], flags[RenderFlags]
    exact = exact_spec(spec)
    cache_rows = [row for row in rows if row.startswith("cache:")]
    if cache_rows:  # a family without the cache, or a bad branch, is a usage error before anything renders
        source = resolve_model(spec.model)
        source.family.require(STEP_CACHE, source.name, "--sensitivity " + cache_rows[0])
        branches = Branches.of(source.denoiser_config)
        for row in cache_rows:
            branches.check(int(row.split(":")[2]))
    half = render.max_batch_size // 2 if render.max_batch_size > 1 else 2
    say(f"sensitivity: the fp32 reference at batch {render.max_batch_size}")
    reference = measure(flags, exact, counts, None, command, label="reference")
    compared = (reference[0], str(reference[1]))
    say(f"sensitivity: the floor, fp32 at batch {half}")
    floor = measure(flags.replaced(dataclasses.replace(render, max_batch_size=half)),
                    dataclasses.replace(exact, batch_size=half, max_batch_size=half), counts, compared, command,
                    label="floor")
    baseline, done, failed = (floor[0], str(floor[1])), [], []
    for row in rows:
        say(f"sensitivity: {row}")
        row_of, fault = row_spec(exact, row)
        try:
            with planting(fault):
                report, path = measure(flags, row_of, counts, compared, command, floor=baseline, label=slug(row))
        except (RunFailure, UsageError) as exc:
            if row == BASELINE_ROW:
                raise
            say(f"sensitivity: {row} cannot run here: {exc}")
            failed.append({"row": row, "reason": str(exc)})
            continue
        done.append((row, report, str(path)))
        if row == BASELINE_ROW:  # every other row runs in fp16: tested against the exact fp16 path
            baseline = (report, str(path))
    summary = sensitivity_summary(reference[0], (floor[0], str(floor[1])), done, failed, command)
    return write_summary(quality, f"{Path(reference[1]).stem}-sensitivity", sensitivity_table(summary), summary,
                         sensitivity_chart)


def write_summary(quality: QualityFlags, stem: str, table: str, summary: dict, chart: Callable[[dict], bytes]) -> int:
    """A sweep's or sensitivity's table, JSON and chart (with matplotlib) as one set, under a name of their own."""
    files = {".md": table.encode(), ".json": (json.dumps(summary, indent=1) + "\n").encode()}
    try:
        files[".png"] = chart(summary)
    except ImportError:
        say("no chart: matplotlib is not installed (pip install 'demo-diffusion[bench]')")
    directory = Path(quality.output_dir)
    try:
        name = under_a_new_name(stem, lambda candidate: write_new_set(
            directory, {candidate + suffix: data for suffix, data in files.items()}))
    except OSError as exc:
        raise RunFailure(f"cannot write {stem} in {directory}: {exc.strerror or exc} (nothing was "
                         "written)") from None
    print(table, end="")
    say(f"wrote {directory / name}.json")
    return 0


# ---- the run -----------------------------------------------------------------------------------------------------

class Progress:
    """Images done of the total and images per second, a line every few seconds and at the end."""

    def __init__(self, total: int):
        self.total, self.done, self.seconds, self.said = total, 0, 0.0, 0.0

    def add(self, images: int, seconds: float) -> None:
        self.done, self.seconds = self.done + images, self.seconds + seconds
        if self.done == self.total or self.seconds - self.said >= PROGRESS_EVERY_S:
            self.said = self.seconds
            say(f"{self.done}/{self.total} images, {self.rate:.2f} images/s")

    @property
    def rate(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0


def case_fields(render: RenderFlags) -> dict:
    """The Request fields every case takes from the rendering flags."""
    requested = {item.name for item in dataclasses.fields(Request)}
    return {item.name: getattr(render, item.name) for item in dataclasses.fields(RenderFlags)
            if item.name in requested}


def case_requests(cases: list[Case], render: RenderFlags, size: int, controlnets: int = 0) -> list[Request]:
    """Each case as a request; the edits' input images at the model's own size (`size`), as its text-to-image cases
    are drawn, so that every call runs one shape; a steered case's control image once per ControlNet."""
    common = case_fields(render)
    requests = []
    for case in cases:
        if case.source is None:
            controls = (case.control_image(),) * controlnets if case.steered else None
            requests.append(Request(case.prompt, seed=case.seed, control_images=controls, **common))
        else:
            requests.append(Request(case.prompt, seed=case.seed, image=case.input_image(), mask=case.mask_image(),
                                    strength=case.strength, height=size, width=size, **common))
    return requests


def calls_of(requests: list[Request], most: int) -> list[list[Request]]:
    """The requests, in order, as pipeline calls: consecutive text-to-image ones up to `most` to a call (each drawn
    from its own seed, so the image is the one it makes alone), each edit alone (a call takes one input image)."""
    calls: list[list[Request]] = []
    for request in requests:
        if request.image is None and calls and len(calls[-1]) < most and calls[-1][0].image is None:
            calls[-1].append(request)
        else:
            calls.append([request])
    return calls


# What ran, as demo-diffusion's report of the first call gives it.
SETTINGS = ("backend", "backend_reason", "device", "precision", "scheduler", "scheduler_options", "steps", "unet_calls",
            "guidance_scale", "negative_prompt", "height", "width", "plugins", "options", "options_reason", "loras",
            "lora_refit_ms", "cache_interval", "cache_branch", "cache_threshold", "cache_forecast", "cache_whole_calls")


def measure(flags, spec, counts: dict[str, int], reference: tuple[dict, str] | None, command: str,
            floor: tuple[dict, str] | None = None, label: str | None = None) -> tuple[dict, Path]:
    """Render the cases with `spec`, read them, write the report (against `reference`, and `floor`: a report and its
    path each, where given; `label`: a sensitivity row's name, in the report's name) and print its table; the
    report and where it went. Speed is timed as sd-benchmark times it: the first call (compiling, CUDA-graph
    capture) apart, then SPEED_RUNS calls of the first call's requests once every case has rendered."""
    # Planning loads torch (seconds): --help and the usage errors above answer without it.
    from PIL import Image

    from demo.pipelines.timer import StageTimer
    from demo.runtime.loader import plan_pipeline, to_stderr

    quality, render = flags[QualityFlags], flags[RenderFlags]
    yardstick = yardstick_of(spec.model, quality.yardstick)
    plan = plan_pipeline(spec)
    cases = yardstick.cases(counts, bool(spec.controlnets))
    checked_detector = None
    if yardstick is SCENES:  # the detector proves itself on the renderer's images before it judges a model
        checked_detector = scenes_quality.detector_check(cases)
        if checked_detector["misread"]:
            raise RunFailure(f"the scenes detector misreads {len(checked_detector['misread'])} of the renderer's own "
                             f"{len(cases)} images of these cases (first: {checked_detector['misread'][0]}): it "
                             "judges no model until it reads every one")
    requests = [plan.checked(request) for request in case_requests(cases, render, plan.source.native_image_size,
                                                                    len(spec.controlnets))]
    notes = plan.notes + requests[0].unused()
    if reference is not None and reference[0].get("model") not in (None, plan.source.name):
        notes.append(f"--reference {reference[1]} is of model {reference[0]['model']}, this run's is "
                     f"{plan.source.name}: the readings that changed are the two models' differences")
    for note in notes:
        to_stderr(f"note: {render_fields(note, flag_name)}")
    say(f"model {plan.source.name} ({plan.source.path}), backend {plan.backend.name} ({plan.backend_reason}), "
        f"{plan.device}; {len(cases)} cases ({', '.join(f'{n} {mode}' for mode, n in counts.items() if n)}), "
        f"{yardstick.name} case set v{yardstick.set_version}")
    progress = Progress(len(cases))
    pixels: list[np.ndarray] = []
    calls = calls_of(requests, render.max_batch_size)
    start = time.perf_counter()
    with plan.load() as pipeline:
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        pipeline.run(calls[0], StageTimer(pipeline.device), pixels=True)  # compiling and capture: timed apart
        first_call_s = time.perf_counter() - start
        for call in calls:
            timer = StageTimer(pipeline.device)
            start = time.perf_counter()
            pixels.extend(pipeline.run(call, timer, pixels=True))
            progress.add(len(call), time.perf_counter() - start)
            if len(pixels) == len(call):  # the first call: what ran, as its report says
                ran = dataclasses.asdict(pipeline.report(call[0], timer))
        timed = []
        for _ in range(SPEED_RUNS):  # every shape the cases take has run once: nothing left to compile or capture
            start = time.perf_counter()
            pipeline.run(calls[0], StageTimer(pipeline.device), pixels=True)
            timed.append(time.perf_counter() - start)
    images = [Image.fromarray(image) for image in pixels]
    readings = [yardstick.read(image) for image in images]
    entries = [{**case.description(), "expected": case.expected(), "reading": reading.as_dict()}
               for case, reading in zip(cases, readings)]
    call_s = sorted(timed)[len(timed) // 2]
    report = {
        "tool": PROG, "command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "yardstick": yardstick.name, "set_version": yardstick.set_version, "model": plan.source.name,
        "model_path": str(plan.source.path),
        **({"row": label} if label else {}),
        "settings": {**{name: ran[name] for name in SETTINGS}, "max_batch_size": render.max_batch_size,
                     "controlnets": [list(pair) for pair in spec.controlnets]},
        "versions": ran["versions"], "cases_run": counts, "render_s": round(progress.seconds, 2),
        "images_per_s": round(len(calls[0]) / call_s, 3),
        "speed": {"images_per_s": round(len(calls[0]) / call_s, 3), "batch": len(calls[0]), "runs": SPEED_RUNS,
                  "median_call_s": round(call_s, 4), "first_call_s": round(first_call_s, 2),
                  "load_s": round(load_s, 2)},
        **({"detector_check": checked_detector} if checked_detector else {}),
        "summary": yardstick.summarise(entries),
        "reference": None if reference is None else compare_with(*reference, entries, images, readings, floor),
        "cases": entries,
    }
    json_path = write_outputs(quality, report, images, keep_images=yardstick.keeps_images)
    print(quality_table(report), end="")
    say(f"wrote {json_path}")
    return report, json_path


def output_stem(report: dict) -> str:
    settings = report["settings"]
    parts = ["quality", Path(report["model"]).name, *([report["row"]] if report.get("row") else []),
             settings["backend"], settings["precision"],
             *(["int8"] if INT8_UNET in settings["options"] else []),
             *(f"lora-{Path(lora['path']).stem}" for lora in settings["loras"]),
             *(f"controlnet-{Path(name).name}-x{scale:g}" for name, scale in settings.get("controlnets", ())),
             *([f"thr{settings['cache_threshold']:g}-b{settings['cache_branch']}"
                + ("-forecast" if settings.get("cache_forecast") else "")] if settings.get("cache_threshold")
               else [f"cache{settings['cache_interval']}-b{settings['cache_branch']}"]
               if settings.get("cache_branch") is not None else [])]
    return "-".join(slug(part) for part in parts)


def outputs_of(json_path: Path) -> tuple[Path, Path]:
    """The chart and the images folder that go with a report."""
    return json_path.with_suffix(".png"), json_path.with_name(json_path.stem + "-images")


def under_a_new_name(stem: str, write: Callable[[str], bool]) -> str:
    """The first of `stem`, `stem`-run2, -run3 ... that `write` takes (it returns False, having written nothing,
    where a name it needs is taken: by an earlier run, or by one writing beside this one)."""
    run = 1
    while not write(name := stem if run == 1 else f"{stem}-run{run}"):
        run += 1
    return name


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _png(image: Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_outputs(quality: QualityFlags, report: dict, images: list[Image], keep_images: bool = False) -> Path:
    """The report, its chart (with matplotlib) and, with --save-images, its images folder, as one set: all of it or
    none, never over a file or into a folder this run did not make. Its name: <stem>.json, or -run2, -run3 ... after
    the stem where any of the set's names is taken; --json names the report (replaced, with its chart, where it
    exists). A full disk is one line (exit 1)."""
    images_named = {}
    if quality.save_images or keep_images:
        images_named = {f"{case['id']}.png": _png(image) for case, image in zip(report["cases"], images)}
        first = [index for index, case in enumerate(report["cases"]) if case["mode"] == TEXT_TO_IMAGE][:GRID_CASES]
        images_named["grid.png"] = _png(grid_image([images[index] for index in first],
                                                   [report["cases"][index] for index in first]))
    try:
        chart = quality_chart(report)
    except ImportError:
        chart = None
        say("no chart: matplotlib is not installed (pip install 'demo-diffusion[bench]')")

    def write(json_path: Path) -> bool:
        try:
            return write_report_set(json_path, report, images_named, chart, replace=quality.json_path is not None)
        except OSError as exc:
            raise RunFailure(f"cannot write the report {json_path}: {exc.strerror or exc} (nothing was "
                             "written)") from None

    if quality.json_path is not None:
        json_path = Path(quality.json_path)
        if not write(json_path):  # checked before rendering: another process made it since
            raise RunFailure(f"{outputs_of(json_path)[1]} appeared while this run rendered, and this run never "
                             "writes into a folder it did not make (nothing was written)")
        return json_path
    directory = Path(quality.output_dir)
    name = under_a_new_name(output_stem(report), lambda stem: write(directory / f"{stem}.json"))
    return directory / f"{name}.json"


def write_report_set(json_path: Path, report: dict, images_named: dict[str, bytes], chart: bytes | None,
                     replace: bool) -> bool:
    """Write the report at `json_path` with its chart (where there is one) and its images folder (where there are
    images), whole or not at all; False, writing nothing, where a name of the set is taken (`replace`: the report's
    and the chart's are replaced, the images folder's never is)."""
    chart_path, images_dir = outputs_of(json_path)
    if not replace and any(map(_exists, (json_path, chart_path, images_dir))):
        return False
    if images_named:
        for case in report["cases"]:
            case["image"] = f"{images_dir.name}/{case['id']}.png"
    files = {json_path.name: (json.dumps(report, indent=1) + "\n").encode(),
             **({chart_path.name: chart} if chart is not None else {})}
    made_folder = written = False
    try:
        if images_named:
            try:
                images_dir.mkdir(parents=True)  # the folder's name is this run's from here
            except FileExistsError:
                return False
            made_folder = True
            write_new_set(images_dir, images_named)  # a folder this run has just made: none of its names is taken
        if replace:
            with contextlib.ExitStack() as staged:  # every file whole before any replaces its old one
                for name, data in files.items():
                    staged.enter_context(atomic_file(json_path.parent / name)).write_bytes(data)
            written = True
        else:
            written = write_new_set(json_path.parent, files)
        return written
    finally:
        if made_folder and not written:  # a name taken, a full disk or an interrupt: none of the set stays
            for name in images_named:
                (images_dir / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: what another process put there stays
                images_dir.rmdir()
