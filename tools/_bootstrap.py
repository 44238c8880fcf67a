"""Lets `python tools/X.py` run from a source checkout before `pip install -e .`."""

import os
import sys

try:
    import mtnlg_lightning  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))
