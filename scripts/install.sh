#!/usr/bin/env bash
# Installs what is missing into the current Python: torch (the CPU 2.13.0 wheel where none is present; GPU
# users install their CUDA build of torch first and it is kept), then this package with its extras.
# Usage: bash scripts/install.sh [extras]   e.g. "dev" for the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi
extras=${1:-}
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"$PYTHON" -m pip install -q -e "$spec"
