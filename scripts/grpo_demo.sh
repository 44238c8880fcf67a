#!/usr/bin/env bash
# The GRPO demo, offline on a few CPU cores: the model `--config demo` trains is taught the synthetic instruction set
# by LoRA fine-tuning (`--config lora --config demo_finetune`; each trained first if missing), then learns from its own
# attempts with GRPO (`--config grpo --config demo_grpo`) on the set's letter-count questions: 8 sampled answers a
# question, the shipped accuracy reward, 40 steps. The reward curve (the mean reward of each step) is printed at the
# end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PYTHON=${PYTHON:-python3}
base=runs/demo/checkpoints/last.ckpt
sft=runs/finetune_demo/checkpoints/last.ckpt
if [ ! -e "$base" ]; then
  echo "== no $base yet: training the demo model first (mtnlg fit --config demo)"
  "$PYTHON" -m mtnlg_lightning.train.cli fit --config demo
fi
if [ ! -e "$sft" ]; then
  echo "== no $sft yet: LoRA fine-tuning on the instruction set first (mtnlg fit --config lora --config demo_finetune)"
  "$PYTHON" -m mtnlg_lightning.demo.synthetic.instructions write runs/finetune_demo
  "$PYTHON" -m mtnlg_lightning.train.cli fit --config lora --config demo_finetune
fi
"$PYTHON" -m mtnlg_lightning.demo.synthetic.instructions prompts runs/grpo_demo --tasks length
echo "== GRPO on the instruction set's letter-count questions (reward: accuracy)"
"$PYTHON" -m mtnlg_lightning.train.cli fit --config grpo --config demo_grpo "$@"
"$PYTHON" -m mtnlg_lightning.demo.synthetic.instructions curve runs/grpo_demo
