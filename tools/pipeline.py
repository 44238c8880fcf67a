#!/usr/bin/env python
"""`mtnlg-pipeline` from a checkout (code: mtnlg_lightning.demo.pipeline.cli; the console script of pip install)."""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.demo.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
