#!/usr/bin/env python
"""The shape of the code counted from its imports: the figures of docs/architecture.md, and a check that the pages
describing the package (docs/architecture.md, README.md) still match it.

A room is one entry of the package (`src/mtnlg_lightning/X/` or `src/mtnlg_lightning/X.py`) or one top-level folder
of Python code beside it (`tools/`, `benchmarks/`, `scripts/`, ...; `tests/` and `docs/` are not rooms). An arrow
A -> B: some file of A imports a file of B (every `import`, inside functions too; what `importlib` loads by name is
not read); a room on no arrow is not counted. A room's floor: 1 when it imports no other room, else one above the
highest room it imports. An arrow runs back up when a room imports one on its own floor or above it, which only a
loop of rooms makes.

    python scripts/import_map.py            # the figures, then each floor's rooms, top floor first
    python scripts/import_map.py --check    # exit 1 naming what docs/architecture.md or README.md says otherwise

`--check` holds, against the code of the checkout:
- docs/architecture.md's figures ("N rooms on F floors, A arrows, none running back up");
- its floors table lists every entry of the package that holds code, once, and no room imports one from a row of
  the table above its own;
- README.md's repository map lists every entry of the package under `src/mtnlg_lightning/`, and nothing else.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "mtnlg_lightning"
NOT_ROOMS = {"tests", "docs", "src", "site", "build", "dist"}  # src/: its package's entries are the rooms
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
FIGURES = re.compile(r"\d+\s+rooms\s+on\s+\d+\s+floors,\s+\d+\s+arrows,\s+(none|\d+)\s+running\s+back\s+up")


def package_entries(package: Path = PACKAGE, code_only: bool = False) -> list[str]:
    """`X/` for each folder of the package (`code_only`: each holding Python code), `X.py` for each module beside
    `__init__.py`."""
    entries = []
    for path in sorted(package.iterdir()):
        if path.is_dir() and path.name != "__pycache__" and not path.name.startswith("."):
            if not code_only or any(path.rglob("*.py")):
                entries.append(path.name + "/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            entries.append(path.name)
    return entries


def room_of(path: Path, root: Path = ROOT) -> str | None:
    """The room holding `path` (a path relative to `root`, `X/` for a folder), or None outside every room."""
    parts = path.relative_to(root).parts
    if parts[:2] == ("src", "mtnlg_lightning") and len(parts) > 2:
        if parts[2] == "__init__.py":
            return None  # the package's own face: hands names on
        return f"src/mtnlg_lightning/{parts[2]}" + ("/" if len(parts) > 3 else "")
    if len(parts) > 1 and parts[0] not in NOT_ROOMS and not parts[0].startswith("."):
        return parts[0] + "/"
    return None


def python_files(root: Path = ROOT) -> list[Path]:
    """The tree's Python files that lie in a room (no hidden folder, build output or virtual environment)."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part.startswith(".") or part in ("__pycache__", "site-packages") for part in parts):
            continue
        if parts[0].endswith(".egg-info") or (root / parts[0] / "pyvenv.cfg").exists():
            continue
        if room_of(path, root) is not None:
            files.append(path)
    return files


def resolve(name: str, places: list[Path]) -> Path | None:
    """The file of module `name` under the first of `places` that has it."""
    for place in places:
        base = place.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def imported_files(path: Path, root: Path = ROOT) -> set[Path]:
    """The files of the tree that `path` imports: modules found from src/, from the root (`benchmarks.x`) or beside
    the file (a script's sibling); `from m import n` counts the submodule `m.n` where there is one, else `m`."""
    places = [root / "src", root, path.parent]
    package = path.parent
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's package up
                base = package
                for _ in range(node.level - 1):
                    base = base.parent
                module = ".".join(base.relative_to(root / "src" if base.is_relative_to(root / "src") else root).parts)
                module = ".".join(part for part in (module, node.module or "") if part)
            else:
                module = node.module or ""
            for alias in node.names:
                if resolve(f"{module}.{alias.name}", places):
                    names.append(f"{module}.{alias.name}")
                else:
                    names.append(module)
        for name in names:
            target = resolve(name, places)
            if target is not None and target != path:
                found.add(target)
    return found


def measure(root: Path = ROOT) -> dict:
    """Rooms, arrows and floors of the tree at `root`."""
    arrows: set[tuple[str, str]] = set()
    rooms: set[str] = set()
    for path in python_files(root):
        here = room_of(path, root)
        rooms.add(here)
        for target in imported_files(path, root):
            there = room_of(target, root)
            if there is not None and there != here:
                arrows.add((here, there))
    rooms = {room for room in rooms if any(room in arrow for arrow in arrows)}  # a room on no arrow is apart
    uses = {room: {b for a, b in arrows if a == room} for room in rooms}
    floors: dict[str, int] = {}
    visiting: set[str] = set()
    loops: set[tuple[str, str]] = set()

    def floor(room: str) -> int:
        if room not in floors:
            visiting.add(room)
            below = []
            for other in uses[room]:
                if other in visiting:
                    loops.add((room, other))  # a loop of rooms: this arrow cannot run down
                else:
                    below.append(floor(other))
            visiting.discard(room)
            floors[room] = 1 + max(below, default=0)
        return floors[room]

    for room in sorted(rooms):
        floor(room)
    back_up = sorted({(a, b) for a, b in arrows if floors[a] <= floors[b]} | loops)
    return {"rooms": floors, "arrows": sorted(arrows), "floors": max(floors.values(), default=0), "back_up": back_up}


def figures(measured: dict) -> str:
    rooms, floors, arrows = len(measured["rooms"]), measured["floors"], len(measured["arrows"])
    back = f"{len(measured['back_up'])} running back up" if measured["back_up"] else "none running back up"
    return f"{rooms} rooms on {floors} floors, {arrows} arrows, {back}"


def floors_table(text: str) -> list[list[str]]:
    """The rooms column of the table under "## The floors", row by row: the backquoted names outside parentheses."""
    section = text.split("## The floors", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("floor", "") or set(cells[0]) <= {"-", ":"}:
            continue
        depth, names = 0, []
        for token in re.findall(r"`[^`]*`|[()]", cells[1]):
            depth += {"(": 1, ")": -1}.get(token, 0)
            if token.startswith("`") and depth == 0:
                names.append(token.strip("`"))
        rows.append(names)
    return rows


def readme_map(text: str) -> list[str]:
    """The entries listed under `src/mtnlg_lightning/` in the README's repository map: the leading names (ending in
    `/` or `.py`) of its indented lines."""
    block = text.split("## Repository map", 1)[1].split("```", 2)[1]
    names, inside = [], False
    for line in block.splitlines():
        if line.startswith("src/mtnlg_lightning/"):
            inside = True
            continue
        if inside and not line.startswith(" "):
            break
        if inside:
            for word in line.split():
                if not word.endswith(("/", ".py")):
                    break
                names.append(word)
    return names


def check(measured: dict, architecture: str, readme: str, entries: list[str], code: list[str]) -> list[str]:
    """What the pages say otherwise: `entries` are the package's, `code` those of them that hold Python code."""
    problems = []
    found = FIGURES.search(architecture)
    said = " ".join(found.group(0).split()) if found else "no figures"
    if said != figures(measured):
        problems.append(f"docs/architecture.md says {said!r}; the code: {figures(measured)!r}")
    rows = floors_table(architecture)
    listed = [name for row in rows for name in row]
    for name in sorted(set(code) - set(listed)):
        problems.append(f"docs/architecture.md's floors table does not list src/mtnlg_lightning/{name}")
    for name in sorted({name for name in listed if name not in code}):
        problems.append(f"docs/architecture.md's floors table lists {name}, which is no code of src/mtnlg_lightning/")
    for name in sorted({name for name in listed if listed.count(name) > 1}):
        problems.append(f"docs/architecture.md's floors table lists {name} more than once")
    row_of = {f"src/mtnlg_lightning/{name}": index for index, row in enumerate(rows) for name in row}
    for a, b in measured["arrows"]:
        if a in row_of and b in row_of and row_of[b] < row_of[a]:
            problems.append(f"{a} imports {b}, which docs/architecture.md's floors table puts above it")
    mapped = readme_map(readme)
    for name in sorted(set(entries) - set(mapped)):
        problems.append(f"README.md's repository map does not list src/mtnlg_lightning/{name}")
    for name in sorted(set(mapped) - set(entries)):
        problems.append(f"README.md's repository map lists {name}, which src/mtnlg_lightning/ does not hold")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 naming what the pages say otherwise")
    args = parser.parse_args(argv)
    measured = measure()
    if args.check:
        architecture, readme = ARCHITECTURE.read_text(encoding="utf-8"), README.read_text(encoding="utf-8")
        problems = check(measured, architecture, readme, package_entries(), package_entries(code_only=True))
        for problem in problems:
            print(f"import_map.py: {problem}", file=sys.stderr)
        return 1 if problems else 0
    print(figures(measured))
    for level in range(measured["floors"], 0, -1):
        print(f"floor {level:2d}  " + "  ".join(sorted(r for r, f in measured["rooms"].items() if f == level)))
    for a, b in measured["back_up"]:
        print(f"back up: {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
