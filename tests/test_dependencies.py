"""Every third-party module the package imports is declared: core paths in the core dependencies, the rest in
an extra whose one-line "install the extra" message names it (`mtnlg_lightning.extras`).

The static half of the check; `.ci/run` also installs the package with no extras into a new virtual environment
and runs the core commands there (`scripts/check_core_install.sh`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from mtnlg_lightning.extras import EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"mtnlg_lightning", "_bootstrap", "benchmarks"}
# Modules whose distribution is named otherwise, for those not installed here (installed, the metadata says)
NAMED_OTHERWISE = {"fla": {"flash-linear-attention", "fla-core"}}
# Extras [dev] leaves out: GPU kernels the CPU suite cannot build (causal-conv1d compiles against CUDA at install)
NOT_IN_DEV = {"linear-attention-kernels"}

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the project supports 3.10, the check needs a TOML reader)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def core_distributions() -> set[str]:
    return {_normalise(Requirement(r).name) for r in _pyproject()["project"]["dependencies"]}


def extra_distributions() -> dict[str, set[str]]:
    extras = _pyproject()["project"]["optional-dependencies"]
    return {name: {_normalise(Requirement(r).name) for r in reqs} for name, reqs in extras.items()}


def _module_distributions() -> dict[str, set[str]]:
    return {
        module: {_normalise(d) for d in dists} for module, dists in importlib.metadata.packages_distributions().items()
    }


def distributions_of(module: str, known: dict[str, set[str]]) -> set[str]:
    # not installed here: the usual module == project name, unless NAMED_OTHERWISE says
    return known.get(module, NAMED_OTHERWISE.get(module, {_normalise(module)}))


def third_party_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module, line, at module level?) for every absolute import of a non-stdlib, non-project module.
    Imports under `if TYPE_CHECKING:` never run and are left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            else:
                names = []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    found.append((top, child.lineno, not in_function))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(tree, False)
    return found


def package_files() -> list[Path]:
    return sorted((ROOT / "src" / "mtnlg_lightning").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))


def test_module_level_imports_are_core_dependencies():
    """A module-level import runs whenever its module is imported, so it must come with the core install."""
    core, known = core_distributions(), _module_distributions()
    undeclared = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in package_files()
        for module, line, module_level in third_party_imports(path)
        if module_level and not distributions_of(module, known) & core
    ]
    assert not undeclared, "add these to [project] dependencies or import them lazily behind require_extra:\n" + (
        "\n".join(undeclared)
    )


def test_lazy_imports_are_declared_in_core_or_an_extra():
    core, known = core_distributions(), _module_distributions()
    optional = set().union(*(d for name, d in extra_distributions().items() if name != "dev"))
    undeclared = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in package_files()
        for module, line, module_level in third_party_imports(path)
        if not module_level and not distributions_of(module, known) & (core | optional)
    ]
    assert not undeclared, "declare these in pyproject.toml:\n" + "\n".join(undeclared)


def test_every_extra_named_by_require_extra_ships_its_modules():
    """`require_extra("hf", ...)` tells the user to install `[hf]`: that extra must bring the modules checked."""
    extras, known = extra_distributions(), _module_distributions()
    for extra, modules in EXTRA_MODULES.items():
        assert extra in extras, f"extras.py names [{extra}], which pyproject.toml does not define"
        for module in modules:
            assert distributions_of(module, known) & extras[extra], f"[{extra}] does not install {module}"


def test_the_dev_extra_brings_every_other_extra():
    dev = _pyproject()["project"]["optional-dependencies"]["dev"]
    named = {
        extra
        for req in dev
        for extra in Requirement(req).extras
        if _normalise(Requirement(req).name) == "mtnlg-lightning"
    }
    expected = set(extra_distributions()) - {"dev"} - NOT_IN_DEV
    assert named >= expected, "scripts/test.sh installs [dev]: it must include every extra"
    assert not named & NOT_IN_DEV


def test_the_scan_sees_imports_at_every_depth(tmp_path):
    """The checker itself: module level, inside functions and methods, and TYPE_CHECKING blocks left out."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import os\nimport numpy as np\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ray\n"
        "class A:\n    def f(self):\n        from transformers import AutoModel\n"
        "def g():\n    import mtnlg_lightning.extras\n"
    )
    assert third_party_imports(source) == [("numpy", 2, True), ("transformers", 8, False)]
