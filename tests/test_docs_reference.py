"""The documentation's reference pages are generated from the code (scripts/docs_reference.py) and CI refuses a
page out of date with it, an undocumented flag or key, and a site with a broken link."""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def reference(tmp_path):
    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "docs" / "reference", copy)
    return copy


def test_the_committed_reference_matches_the_code(generator, capsys):
    assert generator.main(["--check"]) == 0, capsys.readouterr().err


def test_a_page_edited_by_hand_is_out_of_date(generator, reference, capsys):
    page = reference / "commands" / "mtnlg-dedup.md"
    page.write_text(page.read_text().replace("| `0.8` |", "| `0.9` |"))
    assert generator.main(["--check", "--output", str(reference)]) == 1
    assert "out of date with the code: commands/mtnlg-dedup.md " in capsys.readouterr().err


def test_a_flag_added_to_a_command_makes_its_page_out_of_date_until_regenerated(
    generator, reference, monkeypatch, capsys
):
    from mtnlg_lightning.curation import dedup_cli

    original = dedup_cli.build_parser

    def with_a_new_flag() -> argparse.ArgumentParser:
        parser = original()
        parser.add_argument("--new-flag", default=3, help="a flag the page does not know yet")
        return parser

    monkeypatch.setattr(dedup_cli, "build_parser", with_a_new_flag)
    assert generator.main(["--check", "--output", str(reference)]) == 1
    assert "commands/mtnlg-dedup.md" in capsys.readouterr().err
    assert generator.main(["--output", str(reference)]) == 0
    assert (
        "| `--new-flag NEW_FLAG` | `3` | a flag the page does not know yet (default: 3) |"
        in (reference / "commands" / "mtnlg-dedup.md").read_text()
    )
    assert generator.main(["--check", "--output", str(reference)]) == 0


def test_a_flag_or_key_without_a_meaning_stops_the_generator(generator, reference, monkeypatch, capsys):
    from mtnlg_lightning.curation import dedup_cli
    from mtnlg_lightning.train.module import MTNLGModule

    original = dedup_cli.build_parser

    def with_a_silent_flag() -> argparse.ArgumentParser:
        parser = original()
        parser.add_argument("--silent", type=int)
        return parser

    monkeypatch.setattr(dedup_cli, "build_parser", with_a_silent_flag)
    monkeypatch.setattr(MTNLGModule.__init__, "__doc__", "Args:\n    preset: the preset.\n")
    assert generator.main(["--check", "--output", str(reference)]) == 2
    err = capsys.readouterr().err
    assert "mtnlg-dedup `--silent SILENT`: no help text" in err
    assert "model.lr: no meaning in the Args: of MTNLGModule's docstrings" in err


def test_a_generated_page_missing_from_the_menu_is_refused(generator, tmp_path, monkeypatch, capsys):
    site = (ROOT / "mkdocs.yml").read_text()
    trimmed = tmp_path / "mkdocs.yml"
    trimmed.write_text(site.replace("          - reference/commands/mtnlg-plan.md\n", ""))
    assert generator.missing_from_nav(generator.generate(), trimmed) == ["reference/commands/mtnlg-plan.md"]


def test_defaults_that_depend_on_the_machine_are_shown_as_n(generator):
    page = generator.generate()["commands/mtnlg-dedup.md"]
    assert "| `--workers WORKERS` | `N` |" in page and "here N)" in page


@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="the [docs] extra is not installed")
def test_the_strict_build_fails_on_a_broken_link(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(ROOT / "docs", site / "docs")
    shutil.copy(ROOT / "mkdocs.yml", site / "mkdocs.yml")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "out")]
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}
    ok = subprocess.run(build, cwd=site, capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    home = site / "docs" / "index.md"
    home.write_text(home.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    broken = subprocess.run(build, cwd=site, capture_output=True, text=True, env=env, check=False)
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr
