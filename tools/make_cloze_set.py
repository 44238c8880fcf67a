#!/usr/bin/env python
"""`mtnlg-make-cloze-set` from a checkout (the console script of `pip install`).

The code is mtnlg_lightning.demo.cloze_cli."""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.demo.cloze_cli import main

if __name__ == "__main__":
    sys.exit(main())
