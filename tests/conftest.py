import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")


def run_cli(*args: str, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    """Run a console entry point as a user would (`mtnlg ...`), capturing output."""
    full_env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mtnlg_lightning.cli", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def demo_data():
    """(prefix, tokenizer path) of the built-in corpus, built once and cached."""
    from mtnlg_lightning.data.builtin_corpus import build_demo_data

    return build_demo_data(progress=False)


def pytest_collection_modifyitems(config, items):
    """Every multi-process test is also slow, so the fast lane is one marker: -m "not slow"."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
