"""refit-names: how TensorRT names a refittable engine's weights, against the provenance of the optimized ONNX it was
built from: every LoRA-targetable initializer must be refittable by its name. Needs a GPU.

    python scripts/refit_names.py engine/unet.engine onnx/unet.opt.onnx --plugin-convention sdplugins --dry-refit

Exit status 0 when they all are (and, with --dry-refit, a refit with the ONNX's own values succeeds), else 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from demo.cli.flags import summary
from plugins.contract import CONVENTIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("engine", type=Path, help="a refittable engine (built with --build-enable-refit)")
    parser.add_argument("onnx", type=Path, help="the optimized ONNX it was built from (its .provenance.json beside)")
    parser.add_argument("--backend", default="tensorrt", help="TensorRT flavour (default: %(default)s)")
    parser.add_argument("--plugin-convention", choices=CONVENTIONS, help="whose plugins the engine holds (default: "
                                                                         "none)")
    parser.add_argument("--dry-refit", action="store_true", help="refit every weight with its own values, timed")
    args = parser.parse_args(argv)
    from demo.backends.tensorrt.refit import refit_names  # loads torch and TensorRT: --help answers without them

    lines, ok = refit_names(args.engine, args.onnx, args.backend, args.plugin_convention, args.dry_refit)
    print("\n".join(lines))
    return 0 if ok else 1
