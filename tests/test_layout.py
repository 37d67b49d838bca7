"""The project's shape: an installable package with console commands, thin entry points, one plugin contract, no code
reading results/, a README that covers every flag and links every doc page; and the layering (issue 38): no import
cycle, each layer importing only those below it, project imports at module top except where a face defers the
runtime (and so torch) until its command runs."""

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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


def test_console_commands_are_entry_points_that_run_their_command():
    """Each console script is an entry function (demo.cli.entry, bench.entry) that runs a command module's
    main(argv) under the command's own name."""
    scripts = pyproject()["project"]["scripts"]
    assert set(scripts) == {"demo-diffusion", "build-engines", "export-onnx", "compare-backends", "sd-benchmark",
                            "sd-ablation", "report-gpus", "sd-serve", "sd-quality", "sd-loadgen",
                            "sd-throughput"}
    for command, target in scripts.items():
        module, function = target.split(":")
        source = (ROOT / Path(*module.split("."))).with_suffix(".py").read_text()
        runs = re.search(rf'^def {function}\(\) -> int:\n    return run_main\("([^"]+)", "([^"]+)"\)$', source, re.M)
        assert runs and runs.group(1) == command, f"{command}: {target}"
        command_source = (ROOT / Path(*runs.group(2).split("."))).with_suffix(".py").read_text()
        assert re.search(r"^def main\(argv", command_source, re.M) and f'PROG = "{command}"' in command_source


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

    from demo.cli.flags import option_name
    from demo.cli.generate import build_parser

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


# ---- layering ---------------------------------------------------------------------------------------------------

def imports(path: Path, known: set[str], type_only: bool = False) -> list[tuple[str, bool]]:
    """The project modules `path` imports (those in `known`, or the package a name is imported from), with whether
    the import runs at module level; imports under `if TYPE_CHECKING:` are left out (they never run) unless
    `type_only`."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_only else {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                                       and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level or node.module is None:
                continue
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                       for alias in node.names]
        found += [(target, id(node) in top_level) for target in targets if target in known]
    return found


def import_graph(module_level_only: bool = False, type_only: bool = False) -> dict[str, set[str]]:
    paths = {module_name(path): path for path in package_modules()}
    known = set(paths)
    return {name: {target for target, top in imports(path, known, type_only) if top or not module_level_only}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_anywhere_in_the_packages():
    """Not at module level, nor through the imports a function makes when it runs, nor through imports made for type
    annotations alone (a module that needs another's type and is imported by it takes a Protocol instead)."""
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))
    graph = import_graph(type_only=True)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# Each layer and what it must never import (deferred imports included): the request, the pipelines and the backends
# know nothing of the runtime or its faces; the runtime nothing of its faces; the server nothing of the CLI.
FORBIDDEN = {
    "core": ("plugins", "models", "demo", "bench"),
    "plugins": ("models", "demo", "bench"),
    "models": ("demo", "bench"),
    "demo.request": ("demo.pipelines", "demo.backends", "demo.runtime", "demo.cli", "demo.serve", "bench"),
    "demo.schedulers": ("demo.pipelines", "demo.backends", "demo.runtime", "demo.cli", "demo.serve", "bench"),
    "demo.pipelines": ("demo.runtime", "demo.cli", "demo.serve", "bench"),
    "demo.backends": ("demo.pipelines", "demo.runtime", "demo.cli", "demo.serve", "bench"),
    "demo.runtime": ("demo.cli", "demo.serve", "bench"),
    "demo.serve": ("demo.cli", "bench"),
    "demo.cli": ("bench",),
}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    def within(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return [f"{module} imports {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
            for layer, forbidden in FORBIDDEN.items() if within(module, layer)
            for other in forbidden if within(target, other)]


def test_each_layer_imports_only_those_below_it():
    assert layer_violations(import_graph()) == []


def test_the_layering_test_fails_when_a_forbidden_import_is_added():
    graph = import_graph()
    graph["demo.pipelines.text_to_image"] = {*graph["demo.pipelines.text_to_image"], "demo.runtime.loader"}
    graph["demo.runtime.loader"] = {*graph["demo.runtime.loader"], "demo.cli.flags"}
    graph["demo.serve.server"] = {*graph["demo.serve.server"], "demo.cli.to_spec"}
    assert layer_violations(graph) == ["demo.pipelines.text_to_image imports demo.runtime.loader",
                                       "demo.runtime.loader imports demo.cli.flags",
                                       "demo.serve.server imports demo.cli.to_spec"]
    graph["demo.request"] = {*graph["demo.request"], "demo.pipelines.batch"}  # batch imports demo.request
    assert find_cycle(graph) is not None


# Where a project import may wait until a function runs: the faces defer the runtime (and so torch) until their
# command runs, so that --help and the flags' own errors answer without it; plugins' package reports on its torch ops
# without importing them; demo's package exports the Python API on first use.
DEFERRING = ("demo.cli", "bench", "plugins", "demo.demo_diffusion")


def test_project_imports_are_at_module_top_except_where_a_face_defers_the_runtime():
    known = {module_name(path) for path in package_modules()}
    deferred = [f"{module_name(path)} imports {target} in a function" for path in package_modules()
                for target, top in imports(path, known) if not top
                and not any(module_name(path) == face or module_name(path).startswith(face + ".")
                            for face in DEFERRING)]
    assert deferred == []


# ---- family facts --------------------------------------------------------------------------------------------------

# What tells one model family from another, read anywhere but in models/families/ (issue 54's rule): an `is_xl`
# flag, the tests of a config that decide a family or its guidance (SDXL's added text-time embedding, LCM's guidance
# embedding width, SDXL's VAE upcast), the denoiser's config found by the name "unet", and diffusers' SDXL pipelines
# named. Data that merely sets them (a built-in's config dict) is no read.
FAMILY_FACTS = {
    "an is_xl flag": r"\bis_xl\w*\b",
    "the added-embedding test": r"(\.addition_embed_type\b|get\(\s*[\"']addition_embed_type"
                                r"|config\w*\s*\[\s*[\"']addition_embed_type|==\s*[\"']text_time)",
    "the guidance-embedding test": r"time_cond_proj_dim",
    "the VAE upcast test": r"[\"']force_upcast[\"']\s*[,)\]]",
    "the denoiser found by name": r"config\(\s*[\"']unet[\"']\s*\)",
    "an SDXL pipeline named": r"StableDiffusionXL\w*Pipeline",
}


def code_of(text: str) -> str:
    """A module's code without its comments and docstrings (which may name what the code must not read)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def family_fact_readers(sources: dict[str, str]) -> list[str]:
    """'<module>: <fact>' for each module outside models/families/ whose code reads a family fact."""
    return [f"{name}: {fact}" for name, text in sorted(sources.items()) if not name.startswith("models/families/")
            for fact, pattern in FAMILY_FACTS.items() if re.search(pattern, code_of(text))]


def test_only_the_families_read_family_facts():
    sources = {str(path.relative_to(ROOT)): path.read_text() for path in package_modules()}
    assert family_fact_readers(sources) == []
    planted = {"models/vae.py": 'if config.get("force_upcast", True):\n    pass',
               "demo/pipelines/sdxl.py": '"""is_xl in a docstring is no read."""\nif source.is_xl:\n    pass',
               "bench/runner.py": 'source.config("unet")  # a comment: StableDiffusionXLPipeline'}
    assert family_fact_readers(planted) == ["bench/runner.py: the denoiser found by name",
                                            "demo/pipelines/sdxl.py: an is_xl flag",
                                            "models/vae.py: the VAE upcast test"]
