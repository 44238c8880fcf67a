#!/usr/bin/env python
"""Thin CLI: labelled near-duplicate corpus generator (``--help``; library: mtnlg_lightning.demo.synthetic)."""

import os
import sys

try:
    import mtnlg_lightning.demo.synthetic.near_duplicates_cli  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))

from mtnlg_lightning.demo.synthetic.near_duplicates_cli import main

if __name__ == "__main__":
    sys.exit(main())
