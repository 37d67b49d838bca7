"""What the bench commands share: their output flags, stage names, file-name slugs, workload titles and
one-line failure reasons."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from demo.cli.flags import ModelFlags, Parser, PrecisionFlags, RequestFlags, add_flags, flag
from plugins.contract import ATTENTION_KEYS
from plugins.tuned import TUNED_DEFAULTS_FILE

STAGES = ("clip", "unet", "vae", "pipeline")
# A benchmark results file's lists: measured rows, then entries with a reason why there is no row.
KINDS = ("rows", "skipped", "failed", "discarded")
# The plugin families in demoDiffusion 8.5's order, the order the ablation adds them in.
ALL = ATTENTION_KEYS + ("LayerNorm", "GroupNorm", "SplitGeLU", "Seq2Spatial")
# MLPerf Inference's SDXL reference (mlcommons/inference, text_to_image/backend_pytorch.py) as request fields:
# EulerDiscreteScheduler, 20 steps, guidance 8, 1024x1024; and the negative prompt it gives every sample.
MLPERF_SDXL = {"denoising_steps": 20, "scheduler": "Euler", "guidance_scale": 8.0, "height": 1024, "width": 1024}
MLPERF_SDXL_NEGATIVE_PROMPT = "normal quality, low quality, worst quality, low res, blurry, nsfw, nude"


@dataclass(frozen=True)
class ResultsFlags:
    """Where a measuring command writes, and whether it records what it measured fastest as a tuned default."""

    results_dir: str = flag("where the JSON, markdown and charts go, relative to the current directory "
                            "(default: %(default)s)", "results")
    update_defaults: bool = flag("record what this run measured fastest on this GPU's compute capability in the "
                                 "tuned defaults, which the backends' auto settings read (default: leave them)", False)
    defaults_file: str | None = flag("the tuned-defaults file --update-defaults writes (default: "
                                     "plugins/tuned_defaults.json, the one the package reads)", metavar="FILE")

    @property
    def defaults_path(self) -> Path:
        return Path(self.defaults_file) if self.defaults_file else TUNED_DEFAULTS_FILE


def measuring_parser(prog: str, description: str, own: type):
    """A measuring command's parser: the model (sd1.5-arch by default), the shared request flags, the command's
    own flags (`own`, a flags dataclass) and where it writes."""
    parser = Parser(prog=prog, description=description)
    add_flags(parser, ModelFlags, model="sd1.5-arch")
    add_flags(parser, PrecisionFlags)
    add_flags(parser, RequestFlags)
    add_flags(parser, own)
    add_flags(parser, ResultsFlags)
    return parser


def slug(text: str) -> str:
    """`text` for file and folder names: lower-case letters and digits, anything else between them one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "none"


def steered_model(model: str, controlnets) -> str:
    """The model as tables title it: with its ControlNets ((folder or name, scale) pairs), which change every step's
    work."""
    return model + "".join(f" + {Path(name).name}" + ("" if scale == 1 else f" x{scale:g}")
                           for name, scale in controlnets)


def workload_title(model: str, height: int, width: int, batch_size: int, steps: int) -> str:
    """One workload as every table and chart titles it; rows are only compared within one."""
    return f"{model}, {width}x{height}, batch {batch_size}, {steps} steps"


def ms(value: float | None) -> str:
    """Milliseconds in a table cell ("—": unknown)."""
    return "—" if value is None else f"{value:.2f}"


def one_line(exc: BaseException) -> str:
    """An exception as one line of at most ~400 characters, for a results file."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def log(prog: str, message: str) -> None:
    print(f"[{prog}] {message}", flush=True)


def earlier_entries(json_path: Path, fresh: bool, gpu: str, kinds: tuple[str, ...], prog: str) -> dict[str, list]:
    """Each kind's entries that an earlier run on the same GPU left in `json_path`, to keep beside this run's (empty
    lists where `fresh`, the file is absent, not JSON, or another GPU's)."""
    entries = {kind: [] for kind in kinds}
    if fresh or not json_path.is_file():
        return entries
    try:
        earlier = json.loads(json_path.read_text())
    except ValueError:
        log(prog, f"{json_path} is not JSON: starting afresh")
        return entries
    if earlier.get("gpu") == gpu:
        entries.update({kind: list(earlier.get(kind, [])) for kind in kinds})
    return entries
