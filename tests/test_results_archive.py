"""results/ is an archive of what a reader compares, and the product speaks of GPUs, software and dates only (issue 38,
item 7): no scripts or logs in results/ (what a log showed is stated where it is cited), every link in results/,
README.md and docs/ leads to a file (and heading) that exists, and none of them tells how our own GPU machine is lent,
reached or kept busy. Plain file reads; no torch."""

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

RESULTS = ROOT / "results"
FORBIDDEN_SUFFIXES = (".py", ".sh", ".log", ".log.gz", ".txt", ".txt.gz")

# How our GPU machine is operated: words that do not belong in README.md, docs/ or results/. Each is narrow enough that
# ordinary prose ("release", "carry an SDP prefix", "holds", "device memory held") does not trip it.
MACHINE_OPERATION = re.compile(r"""
      \bleas(?:e|es|ed|ing)\b                         # a lease of the machine, lease.sh
    | \bbox(?:es)?\b                                  # "the box", "GPU box", docs/gpu-box.md
    | \bbox_\w+                                       # scripts/box_*.sh
    | \$OUT\b                                         # the machine's output folder
    | \.\./shared\b                                   # kits beside the checkout
    | \.carry\b | \bcarr(?:y|ies|ied)\s+(?:calls?|parts?|folders?)\b
    | \bdevice\s+(?:calls?|time)\b
    | /opt/(?:k|trt86|w)\b
    | \bcounted\s+at\s+(?:50\s*%|half\b) | \bheld\s+time\b
    | \blent\b
    | \b(?:the|same|a|one|\d+-minute)\s+hold\b        # "the 30-minute hold"
    | \bTRT86_SHA\b | \bmake_parts\b | \bblob\s+sha\b
    | \bx[248]\s+(?:was\s+)?asked\b | \basked\s+for\s+an?\s+H[12]00\b
""", re.IGNORECASE | re.VERBOSE)

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def present(paths: list[str]) -> list[str]:
    return [path for path in paths if (ROOT / path).exists()]


@cache
def results_files() -> tuple[str, ...]:
    """What git tracks (or will, once added) under results/ that is on disk; every file where git is not there."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "results"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        listed = [p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*") if p.is_file()]
    return tuple(sorted(present(listed)))


def product_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted(ROOT / path for path in results_files() if path.endswith(".md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a markdown file; code blocks included (commands count too)."""
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*~]", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    found, seen, fenced = set(), {}, False
    for _, line in prose_lines(path):
        if FENCE.match(line):
            fenced = not fenced
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not fenced:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def broken_links(path: Path) -> list[str]:
    broken, fenced = [], False
    for number, line in prose_lines(path):
        if FENCE.match(line):
            fenced = not fenced
        if fenced:
            continue
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not destination.exists():
                broken.append(where)
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{where} (no such heading)")
    return broken


def test_results_holds_no_scripts_or_logs():
    offenders = [path for path in results_files() if path.endswith(FORBIDDEN_SUFFIXES)]
    assert offenders == [], "results/ keeps tables, JSON and charts; state what a log showed where it is cited"


def test_results_keeps_its_index():
    assert (RESULTS / "README.md").is_file()
    assert any(path.endswith(".md") and path != "results/README.md" for path in results_files())


def test_results_index_links_only_existing_files():
    assert broken_links(RESULTS / "README.md") == []


@pytest.mark.parametrize("page", [path for path in results_files() if path.endswith(".md")])
def test_results_markdown_links_only_existing_files(page):
    assert broken_links(ROOT / page) == []


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                       for p in (ROOT / "docs").glob("*.md"))])
def test_readme_and_docs_link_only_existing_files(page):
    assert broken_links(ROOT / page) == []


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in product_pages()])
def test_product_never_speaks_of_operating_our_gpu_machine(page):
    hits = [f"{page}:{number}: {match.group(0)!r} in {line.strip()[:100]}"
            for number, line in prose_lines(ROOT / page) for match in MACHINE_OPERATION.finditer(line)]
    assert hits == []


@pytest.mark.parametrize("text", [
    "One lease of two H100s", "the box lent H100s", "on the GPU box", "see docs/gpu-box.md",
    "bash scripts/box_lease.sh", "copies into $OUT", "TensorRT 8.6 from ../shared/trt86", "a carry call",
    "in .carry/serve-a", "one device call", "/opt/k/misc/src/include", "counted at 50%", "the 30-minute hold ended",
    "H200 x2 asked", "TRT86_SHA=abc bash",
])
def test_the_word_list_catches_machine_operation(text):
    assert MACHINE_OPERATION.search(text)


@pytest.mark.parametrize("text", [
    "blocks on the way out remove staging folders and release locks", "Names carry an SDP prefix",
    "which parameters each initializer holds", "device memory held at the end", "Triton held each request",
    "one GPU of an H200 x4 machine", "measured on two H100s", "shared-memory atomics", "please note",
    "carried through every pass",
])
def test_the_word_list_leaves_ordinary_prose_alone(text):
    assert not MACHINE_OPERATION.search(text)


@pytest.mark.parametrize("heading, anchor", [
    ("Hopper attention (wgmma + TMA)", "hopper-attention-wgmma--tma"),
    ("SDXL: TensorRT 8.6 engines on an H200", "sdxl-tensorrt-86-engines-on-an-h200"),
    ("Every contender in one run on two H100s (2026-11-26)", "every-contender-in-one-run-on-two-h100s-2026-11-26"),
    ("`sd-serve` figures", "sd-serve-figures"),
    ("LoRA by engine refit on an H200", "lora-by-engine-refit-on-an-h200"),
])
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor
