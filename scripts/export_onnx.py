"""Export and optimize a model's stages to ONNX through the artifact cache.

    python scripts/export_onnx.py --model tiny --onnx-dir onnx [--stages clip,unet,vae] [--plugins all]
        [--report-json passes.json]

Prints, per stage, the node counts after each optimizer pass, what the plugin passes replaced and
skipped, and the files written; --report-json writes the plugin pass counts as
{"<stage>": {"<plugin>": {"replaced": N, "skipped": M}}}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "export_onnx"


def main(argv: list[str] | None = None) -> int:
    from demo.arguments import Parser, add_model_arguments, run_command
    from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES
    from models.plugin_set import PLUGINS_HELP

    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--onnx-dir", default="onnx")
    parser.add_argument("--stages", default=",".join(TEXT_TO_IMAGE_STAGES),
                        help=f"comma-separated subset of {', '.join(STAGE_MODELS)}")
    parser.add_argument("--force-onnx-export", action="store_true")
    parser.add_argument("--force-onnx-optimize", action="store_true")
    parser.add_argument("--plugins", default="auto", help=PLUGINS_HELP)
    parser.add_argument("--report-json", metavar="PATH", help="write what the plugin passes did per stage here")
    return run_command(PROG, lambda: export(parser.parse_args(argv)))


def export(args) -> int:
    import torch

    from core.atomic import atomic_write_bytes
    from demo.arguments import check_writable_directory, check_writable_file, parse_stages
    from core.artifacts import artifact_bytes
    from demo.logs import configure_library_logging
    from models import STAGE_MODELS
    from models.plugin_passes import format_report_line, read_pass_report
    from models.plugin_set import PLUGIN_KEYS, parse_plugin_set
    from models.source import resolve_model

    stages = parse_stages(args.stages)
    check_writable_directory("ONNX directory", Path(args.onnx_dir))
    plugins = parse_plugin_set(args.plugins)
    if args.report_json:
        check_writable_file("--report-json", Path(args.report_json))
    configure_library_logging(args.verbose)
    source = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    onnx_dir = Path(args.onnx_dir)
    print(f"plugins: {', '.join(plugins) or 'none'} (--plugins {args.plugins})")
    counts = {}
    for name in stages:
        start = time.perf_counter()
        path = STAGE_MODELS[name](source).prepare_onnx(
            onnx_dir, device, dtype, args.force_onnx_export, args.force_onnx_optimize, plugins=plugins
        )
        size = artifact_bytes(path)
        report = read_pass_report(path)
        counts[name] = {key: {"replaced": report[key]["replaced"], "skipped": report[key]["skipped"]}
                        for key in PLUGIN_KEYS}
        print(format_report_line(name, report))
        print(f"{name}: {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    if args.report_json:
        atomic_write_bytes(Path(args.report_json), json.dumps(counts, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
