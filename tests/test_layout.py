"""The project's shape, as issue 17 fixed it: an installable package with console commands, thin entry points,
one plugin contract, no code reading results/, and a README that covers every flag and links every doc page."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.conftest import ROOT

PACKAGES = ("core", "plugins", "models", "demo", "bench")
# The commands run as files; each may put the checkout on sys.path (under `if __name__ == "__main__"`), as may
# the fault tests' runner.
COMMAND_FILES = sorted([ROOT / "demo" / "demo_diffusion.py", *(ROOT / "scripts").glob("*.py")])
ENTRY_POINTS = [*COMMAND_FILES, ROOT / "tests" / "paused.py"]


def package_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                  if p != ROOT / "demo" / "demo_diffusion.py")


def python_sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not {".venv", "build", ".git"} & set(p.relative_to(ROOT).parts))


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_packages_never_edit_sys_path():
    offenders = [str(p.relative_to(ROOT)) for p in package_modules() if "sys.path" in p.read_text()]
    assert offenders == []


def test_entry_points_edit_sys_path_only_when_run_as_programs():
    for path in ENTRY_POINTS:
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: only inside `if __name__ == "__main__":`
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                continue
            assert "sys.path" not in ast.unparse(node), f"{path.relative_to(ROOT)}: {ast.unparse(node)[:80]}"


def test_no_module_imports_a_script():
    assert not (ROOT / "scripts" / "__init__.py").exists(), "scripts/ is not a package"
    importers = [str(p.relative_to(ROOT)) for p in python_sources()
                 if re.search(r"^\s*(from scripts\b|import scripts\b)", p.read_text(), re.M)]
    assert importers == []


def test_console_commands_are_package_functions():
    scripts = pyproject()["project"]["scripts"]
    assert set(scripts) == {"demo-diffusion", "build-engines", "export-onnx", "compare-backends", "sd-benchmark",
                            "sd-ablation", "report-gpus", "sd-serve"}
    for command, target in scripts.items():
        module, function = target.split(":")
        source = (ROOT / Path(*module.split("."))).with_suffix(".py")
        assert re.search(rf"^def {function}\(argv", source.read_text(), re.M), f"{command}: {target}"


@pytest.mark.parametrize("entry", COMMAND_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_file_answers_help_from_anywhere(entry, tmp_path):
    """Run as a file from another folder (no install needed, no GPU): --help prints usage and exits 0."""
    result = subprocess.run([sys.executable, str(entry), "--help"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:200]


def test_installed_console_command_runs_where_installed(tmp_path):
    """`pip install .` puts demo-diffusion beside the interpreter; where it is, it answers --help."""
    command = Path(sys.executable).parent / "demo-diffusion"
    if not command.exists():
        pytest.skip(f"the project is not installed in {Path(sys.executable).parent.parent} (pip install -e .)")
    result = subprocess.run([str(command), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("usage: demo-diffusion"), result.stderr[-2000:]


def test_no_code_reads_results():
    """results/ is an archive: tuned defaults live in plugins/tuned_defaults.json."""
    readers = [str(p.relative_to(ROOT)) for p in package_modules()
               if re.search(r"""["']results["']\s*/|/\s*["']results["']|results/\w+\.json""", p.read_text())]
    assert readers == []
    assert not (ROOT / "results" / "plugins_auto.json").exists()
    assert not (ROOT / "results" / "torch_defaults.json").exists()


def test_the_plugin_contract_is_written_once():
    """The plugin keys, the plugin namespace and the head-size limits appear as literals only in plugins/contract.py."""
    contract = ROOT / "plugins" / "contract.py"
    patterns = {"the plugin key list": r'"fMHA",\s*"fMHCA"', "the namespace": r'"sdplugins"',
                "the head-size limit": r"MAX_HEAD_SIZE\s*(,\s*\w+\s*)?=\s*\d"}
    for what, pattern in patterns.items():
        places = [str(p.relative_to(ROOT)) for p in package_modules() if re.search(pattern, p.read_text())]
        assert places == [str(contract.relative_to(ROOT))], f"{what}: {places}"


def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_is_short_and_starts_with_the_quickstart():
    text = readme()
    assert len(text.splitlines()) <= 250
    assert text.startswith("## Quickstart\n")
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert len(block) == 2 and "demo-diffusion" in block[0] and "pytest" in block[1]


def test_readme_flag_table_has_every_demo_flag():
    import dataclasses

    from demo.cli.generate import build_parser
    from demo.settings import option_name

    fields = [item for group in build_parser().flag_groups for item in dataclasses.fields(group)]
    options = [option_name(item) for item in fields if not item.metadata["positional"]]
    assert len(options) > 25
    missing = [option for option in options if f"`{option}" not in readme()]
    assert missing == []


def test_readme_links_every_doc_page():
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    assert [page for page in pages if f"({page})" not in readme()] == []


def test_ruff_finds_nothing():
    """The lint rules in pyproject.toml ([tool.ruff]) hold everywhere (ruff comes with the test extra)."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    result = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
