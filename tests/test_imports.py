"""The package's import graph has no cycles, every module imports on its own in a fresh interpreter, no test
hook is reachable from the product code, the tests and the benchmarks do not import each other (what both use is
testing/, which imports neither), and a rank imports none of the heavy optional libraries it does not use.

The graph is read from the source (every `import`, including those inside functions, which hide a cycle from
the interpreter without removing it), so a cycle fails here even when no import order happens to trip on it."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "mtnlg_lightning"
TESTS = Path(__file__).resolve().parent
TESTING = ROOT / "testing"

# Names of the test hooks and reference paths that live in tests/, testing/ or benchmarks/ (not in the package).
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
    # (with every module between them on the way: config -> family_specs -> errors too)
    assert any({"mtnlg_lightning.config", "mtnlg_lightning.errors"} <= set(cycle) for cycle in cycles(graph))


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
    helpers = side_names("tests") | side_names("testing")
    for name, path in module_files().items():
        imported = {
            (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert not imported & helpers, f"{name} imports test code {sorted(imported & helpers)}"


# ------------------------------------------------------------------------ tests, benchmarks and what they share
def side_names(side: str) -> set[str]:
    """The names that import a top-level folder's code: the package's own and, for a script run from the folder
    (its folder first on sys.path), each file's."""
    return {side} | {path.stem for path in (ROOT / side).glob("*.py")} - {"__init__", "__main__"}


def references(path: Path) -> list[tuple[int, str, str]]:
    """(line, how, name) of what a file reaches: "import" for every module it imports (at any depth), "dotted" for
    the package of a class path in a string (`--trainer.callbacks+=testing.fault_probe.Probe`), "path" for the
    top-level folder a path in a string starts at (`ROOT / "tests"`, "tests/dist_runs.py"). Docstrings say what they
    like."""
    tree = ast.parse(path.read_text(), str(path))
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, "import", alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, "import", node.module.split(".")[0]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            dotted = re.findall(r"(?:^|[\s=])([A-Za-z_]\w*)\.\w+\.[A-Z]", node.value)
            found += [(node.lineno, "dotted", name) for name in dotted]
            found += [(node.lineno, "path", name) for name in re.findall(r"^(\w+)(?:/|$)", node.value)]
    return found


def reaches(side: str, other: str, commands: bool = False) -> list[str]:
    """Where code of `side` reaches code of `other`: imports it (by its package or, as a script in its folder
    would, by a file's name), names a class of it, or a path into it. With `commands`, a path to one of its files
    is not counted: a test that runs a benchmark as its user would (`python benchmarks/gpu_check.py`)."""
    names = side_names(other)
    return [
        f"{path.relative_to(ROOT)}:{line} reaches {other}/ ({how} {name})"
        for path in sorted((ROOT / side).rglob("*.py"))
        for line, how, name in references(path)
        if (name in names if how == "import" else name == other) and not (commands and how == "path")
    ]


def test_tests_and_benchmarks_do_not_import_each_other_and_testing_imports_neither():
    found = reaches("tests", "benchmarks", commands=True) + reaches("benchmarks", "tests")
    found += reaches("testing", "tests") + reaches("testing", "benchmarks")
    assert not found, "\n".join(found)


def test_the_scan_sees_every_way_of_reaching_another_folder(tmp_path):
    source = tmp_path / "sample.py"
    sample = (  # OTHER: a folder's name, put in below (this file's own strings would read as reaching it)
        '"""Docstring: tests/x.py and OTHER.fault_probe.Probe."""\nimport os\nfrom OTHER.suite import SUITE\n'
        "def f():\n    import local_ranks\n"
        'ARGS = ["--trainer.callbacks+=OTHER.fault_probe.Probe", str(ROOT / "tests"), "tests/dist_runs.py"]\n'
    )
    source.write_text(sample.replace("OTHER", "benchmarks"))
    assert references(source) == [
        (2, "import", "os"), (3, "import", "benchmarks"), (5, "import", "local_ranks"), (6, "dotted", "benchmarks"),
        (6, "path", "tests"), (6, "path", "tests"),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------ what a rank imports
# A fresh interpreter imports a command's modules and reports which of `watched` are loaded, every import of one
# the package makes itself, and the modules on the stack when each was first loaded (the carrier).
RANK_PROBE = r"""
import builtins, importlib, json, sys
watched = set(sys.argv[2].split(","))
report = {"ours": [], "carriers": {}}
real_import, real_import_module = builtins.__import__, importlib.import_module

def note(name, importer):
    top = name.split(".")[0]
    if top not in watched:
        return
    if importer.startswith("mtnlg_lightning"):
        report["ours"].append(f"{importer} imports {name}")
    if top not in sys.modules and top not in report["carriers"]:
        frame, stack = sys._getframe(2), []
        while frame is not None:
            stack.append(frame.f_globals.get("__name__", "?").split(".")[0])
            frame = frame.f_back
        report["carriers"][top] = sorted(set(stack) - {"importlib", "__main__", top})

def watching_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0:
        note(name, (globals or {}).get("__name__") or "?")
    return real_import(name, globals, locals, fromlist, level)

def watching_import_module(name, package=None):
    if not name.startswith("."):
        note(name, sys._getframe(1).f_globals.get("__name__") or "?")
    return real_import_module(name, package)

builtins.__import__, importlib.import_module = watching_import, watching_import_module
for module in sys.argv[1].split(","):
    importlib.import_module(module)
report["loaded"] = sorted({name.split(".")[0] for name in sys.modules} & watched)
print(json.dumps(report))
"""
# Libraries no rank of these commands uses (DeepSpeed: only ZeRO, in the strategy's setup; transformers: an HF
# export; matplotlib: --plot; scipy: curation); the package imports each where it is used.
UNUSED_BY_A_RANK = ("deepspeed", "transformers", "matplotlib", "scipy")
# torchmetrics, which Lightning imports whole, imports every optional library of its metrics it finds installed
# (`__init__.py`: scipy.signal; `functional/text/bert.py`: transformers; `utilities/plot.py`: matplotlib), decided
# from the package metadata with no setting to turn it off: in a training rank these come with Lightning (~1.1 s of
# its ~3 s import on the 2-core CI machine), unless the environment lacks them.
CARRIED_BY_TORCHMETRICS = {"transformers", "matplotlib", "scipy"}


def rank_imports(modules: list[str], watched: set[str]) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", RANK_PROBE, ",".join(modules), ",".join(sorted(watched))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_a_training_rank_imports_deepspeed_only_for_zero_and_the_rest_only_through_lightning():
    seen = rank_imports(["mtnlg_lightning.train.cli"], set(UNUSED_BY_A_RANK))
    assert "deepspeed" not in seen["loaded"], seen["carriers"].get("deepspeed")
    assert not seen["ours"], seen["ours"]
    assert set(seen["loaded"]) <= CARRIED_BY_TORCHMETRICS
    brought = {name: carriers for name, carriers in seen["carriers"].items() if "torchmetrics" not in carriers}
    assert not brought, f"not brought by torchmetrics (the importers on the stack): {brought}"


def test_an_inference_rank_imports_neither_lightning_nor_a_library_it_does_not_use():
    """`mtnlg-generate` and `mtnlg-eval` ranks run the model without Lightning (~1 s to import, not ~3 s)."""
    watched = {*UNUSED_BY_A_RANK, "lightning", "torchmetrics"}
    seen = rank_imports(["mtnlg_lightning.inference.generate_cli", "mtnlg_lightning.evaluation.cli"], watched)
    assert not seen["loaded"], seen["carriers"]
