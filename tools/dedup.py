#!/usr/bin/env python
"""Thin CLI: fuzzy deduplication of JSONL corpora (see ``--help``; library: mtnlg_lightning.curation.dedup)."""

import os
import sys

try:
    import mtnlg_lightning.curation.dedup_cli  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))

from mtnlg_lightning.curation.dedup_cli import main

if __name__ == "__main__":
    sys.exit(main())
