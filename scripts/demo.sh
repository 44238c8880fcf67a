#!/usr/bin/env bash
# One command from a fresh clone: install what is missing, then train the demo model offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m mtnlg_lightning.train.cli fit --config configs/demo.yaml "$@"
