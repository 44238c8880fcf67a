"""The configs and tools ship inside the package: a config by its name from any directory, every tools/ script with
a console-script twin running the same main, and nothing in the package that looks for the checkout."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import tomllib

from mtnlg_lightning.demo.pipeline.stages import CONSOLE_SCRIPTS
from mtnlg_lightning.errors import InputError
from mtnlg_lightning.shipped_configs import CONFIG_DIR, config_path, resolve_cli_args, shipped_names

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
REGISTERED = {"auto", "ddp", "deepspeed", "fsdp"}


def test_a_shipped_config_is_named_by_its_name_or_by_its_checkout_path_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    demo = str(CONFIG_DIR / "demo.yaml")
    tp2 = str(CONFIG_DIR / "strategy" / "tp2.yaml")
    spike = str(CONFIG_DIR / "callbacks" / "loss_spike.yaml")
    assert resolve_cli_args(["fit", "--config", "demo"], REGISTERED) == ["fit", "--config", demo]
    assert resolve_cli_args(["fit", "--config=configs/demo.yaml"], REGISTERED) == ["fit", f"--config={demo}"]
    assert resolve_cli_args(["fit", "-c", "demo.yaml"], REGISTERED) == ["fit", "-c", demo]
    for name in ("tp2", "strategy/tp2", "configs/strategy/tp2.yaml"):
        assert resolve_cli_args(["--trainer.strategy", name], REGISTERED) == ["--trainer.strategy", tp2]
    for word in ("--trainer.callbacks+=callbacks/loss_spike.yaml", "--trainer.callbacks+=loss_spike"):
        assert resolve_cli_args([word], REGISTERED) == [f"--trainer.callbacks+={spike}"]


def test_an_existing_file_wins_and_names_that_are_not_files_pass_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").write_text("trainer: {max_steps: 1}\n")  # a local file called like a shipped config
    kept = [
        "--config", "demo",
        "--trainer.strategy", "ddp",  # Lightning's own name
        "--trainer.strategy=mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy",  # a class path
        "--trainer.callbacks+=LossSpikeDetection",  # a class name
        "--trainer.callbacks.init_args.action=skip",
        "--config", "{trainer: {max_steps: 2}}",  # a config given as text
        "--model.preset", "demo",
    ]  # fmt: skip
    assert resolve_cli_args(kept, REGISTERED) == kept


def test_a_name_that_means_nothing_is_one_line_listing_what_ships(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        InputError,
        match=r"^--config nosuch: no such file, and no shipped config .*demo, demo_finetune, demo_grpo, demo_llama",
    ):
        resolve_cli_args(["fit", "--config", "nosuch"], REGISTERED)
    with pytest.raises(InputError, match=r"^--trainer.strategy tp9: neither a strategy name .*strategy/tp2,"):
        resolve_cli_args(["--trainer.strategy", "tp9"], REGISTERED)
    with pytest.raises(InputError, match=r"^--trainer.strategy strategy/tp9: neither .*shipped config \(strategy/cp2"):
        resolve_cli_args(["--trainer.strategy=strategy/tp9"], REGISTERED)
    with pytest.raises(InputError, match="no such file"):
        config_path("../../etc/passwd.yaml", "strategy")  # names stay inside the shipped folder


def test_the_checkout_links_name_the_shipped_files():
    assert (ROOT / "configs").resolve() == CONFIG_DIR.resolve()
    assert (ROOT / "callbacks").resolve() == (CONFIG_DIR / "callbacks").resolve()
    assert {"demo", "tiny", "demo_llama", "mtnlg_530b", "pipeline", "strategy/tp2", "data/mtnlg_blend"} <= set(
        shipped_names()
    )
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["mtnlg_lightning"]
    shipped = {p for pattern in patterns for p in (ROOT / "src/mtnlg_lightning").glob(pattern)}
    data_files = {
        p
        for p in (ROOT / "src/mtnlg_lightning").rglob("*")
        if p.is_file() and p.suffix not in {".py", ".pyc"} and "__pycache__" not in p.parts
    }
    assert data_files <= shipped, f"data files the wheel would lack: {sorted(map(str, data_files - shipped))}"


def _tool_main_module(path: Path) -> str:
    imports = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
    (module,) = [n.module for n in imports if any(a.name == "main" for a in n.names)]
    return module


@pytest.mark.parametrize("tool", sorted(p.name for p in (ROOT / "tools").glob("[!_]*.py")))
def test_every_tools_script_has_a_console_script_twin_running_the_same_main(tool):
    module = _tool_main_module(ROOT / "tools" / tool)
    twins = [name for name, target in SCRIPTS.items() if target == f"{module}:main"]
    assert twins, f"tools/{tool} runs {module}.main, which no [project.scripts] entry names"
    assert callable(importlib.import_module(module).main)


def test_the_pipeline_runs_console_scripts_named_in_pyproject():
    for name, module in CONSOLE_SCRIPTS.items():
        assert SCRIPTS[name] == f"{module}:main"


def test_nothing_in_the_package_looks_for_the_checkout():
    offenders = []
    for path in sorted((ROOT / "src/mtnlg_lightning").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"__file__.*(parents|parent\.parent)|os\.pardir|[\"']tools[\"']", line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
