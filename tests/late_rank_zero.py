"""``python tests/late_rank_zero.py SECONDS ARGS...`` is ``mtnlg ARGS...`` with rank 0 starting SECONDS late, so the
other ranks reach a configuration error first, as they do when rank 0's node is the slow one."""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(float(sys.argv[1]))
    from mtnlg_lightning.train.cli import main

    sys.exit(main(sys.argv[2:]))  # main returns the exit status (2: a configuration error)
