"""Optional extras: which command needs which, checked before any work starts.

The core install (`pip install mtnlg-lightning`) trains with checkpoints, resumes, consolidates, generates and
evaluates from a project checkpoint, and runs the curation tools and preprocessing. Everything else lives in an
extra of pyproject.toml; a command that needs one calls `require_extra` first, so a missing package is one line
naming the extra, not a traceback an hour into a run. `importlib.util.find_spec` looks without importing, so the
check costs milliseconds even for heavy packages.
"""

from __future__ import annotations

import importlib.util

from mtnlg_lightning.errors import MTNLGError

# extra -> the top-level modules it provides (the distributions are listed in pyproject.toml's extras;
# tests/test_dependencies.py checks that the two agree)
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "deepspeed": ("deepspeed",),
    "hf": ("transformers",),
    "eval": ("lm_eval", "transformers"),
    "ray": ("ray",),
    "plot": ("matplotlib",),
    "crawl": ("warcio", "justext", "pycld2", "lxml_html_clean", "sklearn"),
    "trafilatura": ("trafilatura",),
    "corpora": ("zstandard", "pyarrow"),
    "cloud": ("fsspec", "s3fs"),
    "bias": ("textblob", "vaderSentiment"),
}


def missing_modules(extra: str) -> list[str]:
    return [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]


def install_hint(extra: str) -> str:
    return f"pip install 'mtnlg-lightning[{extra}]'"


def require_extra(extra: str, purpose: str) -> None:
    """Raise one `MTNLGError` line naming the extra when a module of ``extra`` is not installed."""
    missing = missing_modules(extra)
    if missing:
        raise MTNLGError(f"{purpose} needs {', '.join(missing)}: {install_hint(extra)}")
