"""Where a benchmark's figures go: `--json PATH`, written atomically so a killed run leaves no half-written file."""

from __future__ import annotations

import os
import sys
from typing import Any

try:
    import mtnlg_lightning  # noqa: F401
except ImportError:  # a benchmark run from a plain checkout: the package is in ../src
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from mtnlg_lightning.outputs import write_json  # noqa: E402


def write_result(path: str | os.PathLike | None, result: Any, **dump_options) -> None:
    """The benchmark's figures as JSON at `path` (indent 1 unless `dump_options` say otherwise); no path, no file."""
    if path:
        write_json(path, result, **dump_options)
