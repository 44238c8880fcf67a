"""Checkpoint writes held open for a while, so that the crash tests and the fault drill can kill a job in
the middle of a save.

`slowed(save_file, seconds)` wraps the function `checkpoint/format.py` writes every rank's tensor file with: the
file stays unpublished `seconds` longer after it is written, and a background writer (not the training thread)
also waits `seconds` before writing, while training goes on. Run as a script,
``python testing/slow_checkpoint_writes.py SECONDS ARGS...`` is ``mtnlg ARGS...`` with its writes slowed; Lightning
starts the other ranks with the same command, so every rank is slowed alike.
"""

from __future__ import annotations

import functools
import sys
import threading
import time

from mtnlg_lightning.checkpoint import format as checkpoint_format


def slowed(save_file, seconds: float):
    @functools.wraps(save_file)
    def slow_save_file(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)  # a slow background write: training goes on meanwhile
        result = save_file(*args, **kwargs)
        time.sleep(seconds)  # written, not yet in the manifest: the window a crash test kills in
        return result

    return slow_save_file


if __name__ == "__main__":
    checkpoint_format.save_file = slowed(checkpoint_format.save_file, float(sys.argv[1]))
    from mtnlg_lightning.train.cli import main

    sys.exit(main(sys.argv[2:]))  # sys.argv itself stays whole: Lightning starts the other ranks with it
