"""Which start of the group this is, and why it restarted: what the launcher (or torchrun, or SLURM) tells the
workers in their environment."""

from __future__ import annotations

import os

RESTART_CAUSE_ENV = "MTNLG_RESTART_CAUSE"  # set by resilience/launch.py for the workers it restarts
# Set by resilience/launch.py, agreed by the launchers of every node: how many times the group started before this
# start (membership changes included, which torchrun's restart count leaves out), and an id unique to this start.
ATTEMPT_ENV, ATTEMPT_ID_ENV = "MTNLG_ATTEMPT", "MTNLG_ATTEMPT_ID"


def restart_count() -> int:
    """0 on the first run; k on the k-th restart of the group (torchrun's count, or the launcher's, which includes
    restarts for nodes that joined or left) or SLURM's k-th requeue of the job."""
    for name in (ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def restart_cause() -> str:
    if os.environ.get(RESTART_CAUSE_ENV):
        return os.environ[RESTART_CAUSE_ENV]
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return "cause not reported by plain torchrun; mtnlg_lightning.resilience.launch reports it"
    return "requeued by SLURM"
