#!/usr/bin/env bash
# Proves the core install: a brand-new virtual environment, torch (the local CPU wheel, as scripts/install.sh
# takes it), this package with NO extras, then the core commands and the optional commands' one-line messages
# (scripts/core_install_smoke.py). Run by .ci/run before the test suite; a core path that imports an
# undeclared package fails here. Usage: bash scripts/check_core_install.sh [VENV_DIR]  (default: a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
venv=${1:-$(mktemp -d)/core-venv}
started=$(date +%s)
"$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip 2>/dev/null || true
PYTHON="$venv/bin/python" bash scripts/install.sh   # no extras
if "$venv/bin/python" -c "import transformers" 2>/dev/null || "$venv/bin/python" -c "import deepspeed" 2>/dev/null; then
  echo "check_core_install: an optional package came with the core install; the check would prove nothing" >&2
  exit 1
fi
echo "check_core_install: core install in $venv took $(( $(date +%s) - started )) s"
"$venv/bin/python" scripts/core_install_smoke.py
echo "check_core_install: done in $(( $(date +%s) - started )) s"
