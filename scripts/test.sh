#!/usr/bin/env bash
# One command from a fresh clone: install what is missing (with test extras), then run the test suite.
# The suite runs on MTNLG_TEST_WORKERS pytest-xdist workers (default 2, one per core of the CI machine; 0: in this
# process), one test module per worker at a time, so a module's shared launches run once. Extra arguments go to
# pytest, e.g. -m "not slow" for the fast lane.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
export WANDB_MODE=offline
exec "${PYTHON:-python3}" -m pytest -q -ra --durations=25 -n "${MTNLG_TEST_WORKERS:-2}" --dist loadfile "$@"
