"""The package's import graph has no cycles, every module imports on its own in a fresh interpreter, and no
test hook is reachable from the product code.

The graph is read from the source (every `import`, including those inside functions, which hide a cycle from
the interpreter without removing it), so a cycle fails here even when no import order happens to trip on it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mtnlg_lightning"
TESTS = Path(__file__).resolve().parent

# Names of the test hooks and reference paths that live in tests/ or benchmarks/ (not in the package).
TEST_HOOKS = (
    "Faults",
    "SimulatedCrash",
    "KillWorkerOnce",
    "CRASH_ENV",
    "datasketch_minhash",
    "datasketch_candidate_pairs",
    "to_lean",
    "shingle_string_hash",
    "estimated_jaccard",
    "optimizer_state_bytes",
    "StateBytesProbe",
    "tflops_from_time",
    "_pause_for_tests",
)
# Environment variables only tests set: the product reads none of them.
TEST_VARIABLES = ("MTNLG_TEST_", "MTNLG_CURATION_CRASH_AT")


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("mtnlg_lightning",) + path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (a `from package import module` counts
    the module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
            base = base if node.level else node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a set of modules importing each other."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_inside_functions():
    graph = {name: set(targets) for name, targets in import_graph().items()}
    # a module imported only inside a function is an edge like any other
    assert "mtnlg_lightning.parallel.pipeline" in graph["mtnlg_lightning.planning.inference_plan"]
    graph["mtnlg_lightning.errors"].add("mtnlg_lightning.config")  # config imports errors: a cycle, once added
    assert ["mtnlg_lightning.config", "mtnlg_lightning.errors"] in cycles(graph)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    report = [
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
        for c in found
    ]
    assert not found, "modules that import each other:\n" + "\n".join(report)


def test_the_demo_part_of_the_house_is_imported_by_nothing_outside_it():
    """The demo corpus, the corpora made on purpose and the end-to-end experiment stand on the trainer; the trainer
    finds the demo corpus by its entry-point name (data.builtin_corpora), never by import."""
    demo = "mtnlg_lightning.demo"
    arrows = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if not module.startswith(demo)
        for target in targets
        if target == demo or target.startswith(demo + ".")
    ]
    assert not arrows, "\n".join(arrows)


@pytest.mark.slow  # ~18 s: every optional extra's library is imported
def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(module_files())
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_no_test_hook_is_importable_from_the_package():
    """Fault injection and reference implementations live in tests/; the product neither defines nor imports them."""
    for name, path in module_files().items():
        tree = ast.parse(path.read_text(), str(path))
        defined = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        defined |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        defined |= {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert not defined & set(TEST_HOOKS), (
            f"{name} defines or imports test hooks {sorted(defined & set(TEST_HOOKS))}"
        )
    helpers = {path.stem for path in TESTS.glob("*.py")}
    for name, path in module_files().items():
        imported = {
            (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert not imported & (helpers | {"tests"}), f"{name} imports test code {sorted(imported & helpers)}"
