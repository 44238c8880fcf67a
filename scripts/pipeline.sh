#!/usr/bin/env bash
# End to end, offline: raw text -> dedup -> decontaminate -> tokenize -> train (twice: the contamination
# experiment) -> evaluate -> export -> generate -> the bias study of the model trained. Installs what is missing,
# then runs tools/pipeline.py.
# Usage: bash scripts/pipeline.sh [OUT_DIR] [--overwrite] [--smoke] ...   (python tools/pipeline.py --help)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh deepspeed,hf,plot,bias
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1
exec "${PYTHON:-python3}" tools/pipeline.py "$@"
