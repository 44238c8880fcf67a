#!/usr/bin/env python
"""Thin CLI: export a checkpoint to a Hugging Face GPT-2 directory (see ``--help``; same as mtnlg-export-hf)."""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.interop.export_cli import main

if __name__ == "__main__":
    sys.exit(main())
