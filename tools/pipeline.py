#!/usr/bin/env python
"""`mtnlg-pipeline` from a checkout (the console script of `pip install`; the code is mtnlg_lightning.pipeline.cli)."""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
