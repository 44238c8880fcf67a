#!/usr/bin/env bash
# The GPU acceptance run in one command: installs what is missing, then benchmarks/gpu_check.py runs the
# equivalence subset on CUDA (NCCL layouts with 2+ GPUs), measures gpt3-1.3b bf16 training (eager / compiled,
# with / without activation checkpointing: tokens/s, TFLOP/s, MFU), generation vs transformers, evaluation vs
# lm-eval and Gated DeltaNet's fused kernels vs its torch path (skipped unless the [linear-attention-kernels] extra
# is installed: not installed here), and writes one JSON (default gpu_check.json). About 10 minutes on one
# H100/H200-class GPU.
#   bash scripts/gpu_check.sh [--output FILE] [--stages equivalence training ...]
#   bash scripts/gpu_check.sh --dry-run     # every stage at tiny sizes on CPU, no CUDA (the test suite runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import mtnlg_lightning, deepspeed, transformers, lm_eval" 2>/dev/null; then
  if [[ " $* " == *" --dry-run "* ]]; then
    echo "gpu_check.sh: error: dependencies missing (the dry run installs nothing): bash scripts/install.sh dev" >&2
    exit 2
  fi
  echo "gpu_check.sh: installing the missing dependencies (scripts/install.sh deepspeed,hf,eval)" >&2
  bash scripts/install.sh "deepspeed,hf,eval"
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
