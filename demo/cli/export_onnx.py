"""Export and optimize a model's stages to ONNX through the artifact cache.

    export-onnx --model tiny --onnx-dir onnx [--stages clip,unet,vae] [--plugins all]
        [--report-json passes.json]

Prints, per stage, the node counts after each optimizer pass, what the plugin passes replaced and
skipped, and the files written; --report-json writes the plugin pass counts as
{"<stage>": {"<plugin>": {"replaced": N, "skipped": M}}}.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from core.artifacts import artifact_bytes
from core.atomic import check_writable_directory, check_writable_file, save_file
from demo.cli.build_engines import BuildFlags
from demo.cli.command import run_command
from demo.cli.flags import EngineFlags, ModelFlags, Parser, add_flags, flag, parse_flags, same_as, summary
from models import check_stage_names
from plugins.contract import PLUGIN_KEYS

PROG = "export-onnx"


@dataclass(frozen=True)
class ExportFlags:
    onnx_dir: str = same_as(EngineFlags, "onnx_dir")
    stages: str = same_as(BuildFlags, "stages")
    force_onnx_export: bool = same_as(EngineFlags, "force_onnx_export")
    force_onnx_optimize: bool = same_as(EngineFlags, "force_onnx_optimize")
    plugins: str = same_as(EngineFlags, "plugins")
    report_json: str | None = flag("write what the plugin passes did per stage here", metavar="PATH")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=PROG, description=summary(__doc__))
    add_flags(parser, ModelFlags)
    add_flags(parser, ExportFlags)
    return run_command(PROG, lambda: export(parse_flags(parser, argv)))


def export(flags) -> int:
    model, export_flags = flags[ModelFlags], flags[ExportFlags]
    stages = [name for name in (export_flags.stages or "").split(",") if name]
    if export_flags.stages is not None:
        check_stage_names(stages)
    check_writable_directory("ONNX directory", Path(export_flags.onnx_dir))
    if export_flags.report_json:
        check_writable_file("--report-json", Path(export_flags.report_json))
    # Models and the passes load torch (seconds): the flags' own errors are answered above, without it.
    import torch

    from demo.runtime.logs import configure_library_logging
    from models.plugin_passes import format_report_line, read_pass_report
    from models.plugin_set import parse_plugin_set
    from models.source import resolve_model
    from models.stages import STAGE_MODELS, check_model_stages, text_to_image_stages

    configure_library_logging(model.verbose)
    source = resolve_model(model.model, vae=model.vae, config=model.model_config,
                           prediction_type=model.prediction_type, vae_precision=model.vae_precision)
    check_model_stages(source, stages)
    stages = stages or text_to_image_stages(source)
    plugins = parse_plugin_set(export_flags.plugins, family=source.family.tuned_key)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    onnx_dir = Path(export_flags.onnx_dir)
    print(f"plugins: {', '.join(plugins) or 'none'} (--plugins {export_flags.plugins})")
    counts = {}
    for name in stages:
        start = time.perf_counter()
        stage = STAGE_MODELS[name](source)
        path = stage.prepare_onnx(onnx_dir, device, stage.stage_dtype(dtype), export_flags.force_onnx_export,
                                  export_flags.force_onnx_optimize, plugins=plugins)  # in what the stage runs in
        size = artifact_bytes(path)
        report = read_pass_report(path)
        counts[name] = {key: {"replaced": report[key]["replaced"], "skipped": report[key]["skipped"]}
                        for key in PLUGIN_KEYS}
        print(format_report_line(name, report))
        print(f"{name}: {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    if export_flags.report_json:
        save_file("--report-json", Path(export_flags.report_json), json.dumps(counts, indent=1).encode())
    return 0


if __name__ == "__main__":  # python -m demo.cli.export_onnx: answered as the console command is, signals too
    from demo.cli.entry import export_onnx

    sys.exit(export_onnx())
