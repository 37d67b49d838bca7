"""The entry points of demo/'s commands (console scripts, scripts/*.py): each answers Ctrl-C from its first moment,
before the command's imports (core.interrupts.run_main)."""

from core.interrupts import run_main


def demo_diffusion() -> int:
    return run_main("demo-diffusion", "demo.cli.generate")


def build_engines() -> int:
    return run_main("build-engines", "demo.cli.build_engines")


def export_onnx() -> int:
    return run_main("export-onnx", "demo.cli.export_onnx")


def compare_backends() -> int:
    return run_main("compare-backends", "demo.cli.compare_backends")


def sd_serve() -> int:
    return run_main("sd-serve", "demo.cli.serve")


def client() -> int:
    return run_main("client", "demo.cli.client")


def refit_names() -> int:
    return run_main("refit_names", "demo.cli.refit_names")
