"""The figures of docs/architecture.md (rooms, floors, arrows), its floors table and the README's repository map are
counted from the code by scripts/import_map.py, and a page that no longer matches the code fails here."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def import_map():
    return SimpleNamespace(**runpy.run_path(str(ROOT / "scripts" / "import_map.py")))


def test_the_architecture_page_and_the_readme_match_the_code(import_map, capsys):
    assert import_map.main(["--check"]) == 0, capsys.readouterr().err


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_rooms_arrows_and_floors_of_a_small_tree(import_map, tmp_path):
    package = "src/mtnlg_lightning"
    write(
        tmp_path,
        {
            f"{package}/__init__.py": "",
            f"{package}/errors.py": "",
            f"{package}/config.py": "from mtnlg_lightning.errors import E\n",
            f"{package}/train/__init__.py": "",
            f"{package}/train/cli.py": "from . import module\nfrom mtnlg_lightning import config\n",
            f"{package}/train/module.py": "def f():\n    import mtnlg_lightning.errors\n",
            f"{package}/apart.py": "import os\n",
            "tools/plan.py": "import _bootstrap\nfrom mtnlg_lightning.train.cli import main\n",
            "tools/_bootstrap.py": "",
            "tests/test_x.py": "from mtnlg_lightning import config\n",
        },
    )
    measured = import_map.measure(tmp_path)
    assert measured["arrows"] == [
        ("src/mtnlg_lightning/config.py", "src/mtnlg_lightning/errors.py"),
        ("src/mtnlg_lightning/train/", "src/mtnlg_lightning/config.py"),
        ("src/mtnlg_lightning/train/", "src/mtnlg_lightning/errors.py"),  # an import inside a function counts
        ("tools/", "src/mtnlg_lightning/train/"),
    ]  # tests/ is no room; apart.py, on no arrow, is no room either
    assert measured["rooms"] == {
        "src/mtnlg_lightning/errors.py": 1,
        "src/mtnlg_lightning/config.py": 2,
        "src/mtnlg_lightning/train/": 3,
        "tools/": 4,
    }
    assert import_map.figures(measured) == "4 rooms on 4 floors, 4 arrows, none running back up"
    write(tmp_path, {f"{package}/errors.py": "from mtnlg_lightning.train import cli\n"})  # a loop of rooms
    assert import_map.measure(tmp_path)["back_up"]


def test_a_stale_figure_an_unlisted_module_and_an_upward_import_are_named(import_map):
    measured = {
        "rooms": {"src/mtnlg_lightning/a.py": 2, "src/mtnlg_lightning/b/": 1},
        "arrows": [("src/mtnlg_lightning/a.py", "src/mtnlg_lightning/b/")],
        "floors": 2,
        "back_up": [],
    }
    architecture = (
        "2 rooms on 2 floors, 9 arrows, none running back up\n\n## The floors\n\n"
        "| floor | rooms | what |\n|---|---|---|\n| top | `b/` (`inner.py`) | b |\n| ground | `a.py` | a |\n"
    )
    readme = "## Repository map\n\n```\nsrc/mtnlg_lightning/   the package\n  a.py b/   both\ntools/   x\n```\n"
    problems = import_map.check(measured, architecture, readme, ["a.py", "b/", "c.py"], ["a.py", "b/", "c.py"])
    assert problems == [
        "docs/architecture.md says '2 rooms on 2 floors, 9 arrows, none running back up'; "
        "the code: '2 rooms on 2 floors, 1 arrows, none running back up'",
        "docs/architecture.md's floors table does not list src/mtnlg_lightning/c.py",
        "src/mtnlg_lightning/a.py imports src/mtnlg_lightning/b/, which docs/architecture.md's floors table puts "
        "above it",
        "README.md's repository map does not list src/mtnlg_lightning/c.py",
    ]
