#!/usr/bin/env bash
# The fine-tuning demo, offline on a few CPU cores: the model `--config demo` trains (trained first if missing) is
# asked held-out questions of the shipped synthetic instruction set, fine-tuned with LoRA on that set
# (`--config lora --config demo_finetune`), and asked again; the answers before and after, and each one's accuracy,
# are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PYTHON=${PYTHON:-python3}
out=runs/finetune_demo
base=runs/demo/checkpoints/last.ckpt
if [ ! -e "$base" ]; then
  echo "== no $base yet: training the demo model first (mtnlg fit --config demo)"
  "$PYTHON" -m mtnlg_lightning.train.cli fit --config demo
fi
"$PYTHON" -m mtnlg_lightning.demo.synthetic.instructions write "$out"
ask() {  # ask CHECKPOINT OUTPUT: greedy answers to every held-out question, as the training turns put them
  "$PYTHON" -m mtnlg_lightning.inference.generate_cli --checkpoint "$1" --chat --chat-template chatml \
    --system "You are a careful assistant. Answer with the result only." --temperature 0 --max-new-tokens 12 \
    --prompt - < "$out/questions.txt" > "$2"
}
echo "== answers of the base model"
ask "$base" "$out/answers_before.txt"
echo "== LoRA fine-tuning on the instruction set"
"$PYTHON" -m mtnlg_lightning.train.cli fit --config lora --config demo_finetune "$@"
echo "== answers of the fine-tuned model"
ask "$out/checkpoints/last.ckpt" "$out/answers_after.txt"
"$PYTHON" -m mtnlg_lightning.demo.synthetic.instructions score "$out/questions.txt" \
  before="$out/answers_before.txt" after="$out/answers_after.txt"
