#!/usr/bin/env python
"""`mtnlg-dry-run` from a checkout (the console script of `pip install`).

The code is mtnlg_lightning.planning.dry_run_cli."""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.planning.dry_run_cli import main

if __name__ == "__main__":
    sys.exit(main())
