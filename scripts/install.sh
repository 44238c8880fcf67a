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
if [ "$extras" = dev ]; then
  # In a fresh environment pip's resolver backtracks for many minutes (measured: > 6 min) between moto's boto3, which
  # wants the newest botocore, and s3fs's aiobotocore, which pins botocore narrowly. Settle botocore with the cloud
  # extra first, then hold it while the rest resolves (~1 min).
  "$PYTHON" -m pip install -q -e ".[cloud]"
  held=$(mktemp)
  trap 'rm -f "$held"' EXIT
  "$PYTHON" -m pip freeze | grep -i '^botocore==' > "$held" || true
  "$PYTHON" -m pip install -q -e "$spec" -c "$held"
else
  "$PYTHON" -m pip install -q -e "$spec"
fi
