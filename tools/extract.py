#!/usr/bin/env python
"""Thin CLI: WARC/WET files to JSON lines of text with their language (see ``--help``; library:
mtnlg_lightning.crawl.extract)."""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.crawl.extract_cli import main

if __name__ == "__main__":
    sys.exit(main())
