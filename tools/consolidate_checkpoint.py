#!/usr/bin/env python
"""Write a checkpoint of any layout as one model-space safetensors file (for inspection and export).

python tools/consolidate_checkpoint.py runs/demo/checkpoints/last.ckpt model.safetensors [--optimizer]
"""

import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.checkpoint.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
