#!/usr/bin/env bash
# One command from a fresh clone: install what is missing (with test extras), then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
export WANDB_MODE=offline
exec "${PYTHON:-python3}" -m pytest -q -ra --durations=25 "$@"
