#!/usr/bin/env python
"""Thin CLI: heuristic quality rules and the GPT-3 style quality classifier (see ``--help``; library:
mtnlg_lightning.crawl.quality)."""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.crawl.quality_cli import main

if __name__ == "__main__":
    sys.exit(main())
