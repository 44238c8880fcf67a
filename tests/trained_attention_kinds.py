"""Issue 62's attention kinds on trained weights, not only random ones: a random Qwen3-Next (Gated DeltaNet layers)
and a random GPT-OSS (sliding windows, sinks, biased experts) directory, each trained with `mtnlg fit` on the
built-in corpus on rows of 256 tokens, then through the public commands:

- `mtnlg-eval --task perplexity` of a text longer than the model's positions in one process, and in cp2 under
  torchrun (Gated DeltaNet passing its state between the ranks' chunks, the sinks joined after the ring);
- `mtnlg-export-hf`, then transformers' class on the export: greedy text (40 tokens) and the logits' largest gap.

    python tests/trained_attention_kinds.py [--steps 200] [--out DIR]

About 8 minutes on 2 CPU cores. Prints one line per family and writes OUT/results.json. In tests/ because it
builds its random directories with the tests' `hf_models` (benchmarks/ does not import the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # hf_models
FAMILIES = ("qwen3_next", "gpt_oss")
PROMPT = "Export a checkpoint to a Hugging Face directory"


def run(*command: str, log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(
            command,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
        )
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:3])} failed ({done.returncode}): see {log}")


def perplexity(path: Path) -> tuple[float, int, dict]:
    found = json.loads(path.read_text())
    result = found["results"]["perplexity"]["-"]
    return result["perplexity"], result["tokens"], found["settings"]["layout"]


def compare_with_transformers(directory: Path) -> dict:
    import torch
    import transformers

    from mtnlg_lightning.data.tokenizer import Tokenizer
    from mtnlg_lightning.inference.decode import generate
    from mtnlg_lightning.inference.load import load_model

    tokenizer = Tokenizer(directory / "tokenizer.json")
    ids = tokenizer.encode(PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    made = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.eod_id)
    theirs = [t for t in made[0, len(ids) :].tolist() if t != tokenizer.eod_id]
    ours = generate(load_model(directory, for_generation=True)[0], ids, 40, temperature=0, eos_id=tokenizer.eod_id)
    with torch.no_grad():
        tokens = torch.tensor([ids + theirs])
        gap = (load_model(directory)[0](tokens)[..., : hf.config.vocab_size] - hf(tokens).logits).abs().max().item()
    return {
        "class": type(hf).__name__,
        "greedy_equal": ours.tokens[0] == theirs,
        "tokens": len(theirs),
        "logit_gap": gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per family (default 200)")
    parser.add_argument("--out", type=Path, default=Path("runs/trained_attention_kinds"), help="working folder")
    args = parser.parse_args()
    from hf_models import random_attention_kind_dir

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = out / "eval.txt"  # about 5,200 tokens: 20 windows of 256
    text.write_text(((ROOT / "README.md").read_text() + (ROOT / "docs/how-to/model-families.md").read_text())[:12000])
    strategy = out / "cp2.yaml"
    strategy.write_text(
        "class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy\ninit_args: {context_parallel: 2}\n"
    )
    results = {}
    for family in FAMILIES:
        source = random_attention_kind_dir(out, family, noise=0.02)
        checkpoints, logs = out / f"ckpt_{family}", out / f"log_{family}"
        fit = [sys.executable, "-m", "mtnlg_lightning.train.cli", "fit", "--config", "configs/tiny.yaml"]
        fit += ["--model.init_from", str(source), "--model.model_overrides", "{seq_len: 256}"]
        fit += ["--trainer.max_steps", str(args.steps), "--model.decay_tokens", "600000"]
        fit += ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+=callbacks/checkpoint.yaml"]
        fit += [
            "--trainer.callbacks.dirpath",
            str(checkpoints),
            "--trainer.callbacks.every_n_train_steps",
            str(args.steps),
        ]
        fit += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(logs)]
        run(*fit, log=out / f"fit_{family}.log")
        checkpoint = checkpoints / f"step={args.steps}.ckpt"
        scored = [out / f"ppl_{family}_{layout}.json" for layout in ("one", "cp2")]
        evaluate = ["--checkpoint", str(checkpoint), "--task", "perplexity", "--data", str(text), "--stride", "128"]
        evaluate += ["--dtype", "fp32", "--no-progress"]
        run(
            sys.executable,
            "-m",
            "mtnlg_lightning.evaluation.cli",
            *evaluate,
            "--output",
            str(scored[0]),
            log=out / "eval.log",
        )
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        run(
            *torchrun,
            "-m",
            "mtnlg_lightning.evaluation.cli",
            *evaluate,
            "--strategy",
            str(strategy),
            "--output",
            str(scored[1]),
            log=out / "eval_cp2.log",
        )
        (one, tokens, _), (cp2, _, layout) = perplexity(scored[0]), perplexity(scored[1])
        exported = out / f"hf_{family}"
        run(
            sys.executable,
            "-m",
            "mtnlg_lightning.interop.export_cli",
            str(checkpoint),
            str(exported),
            "--overwrite",
            log=out / "export.log",
        )
        losses = [line for line in (logs / "lightning_logs").rglob("metrics.csv")]
        import csv

        rows = [r for path in losses for r in csv.DictReader(path.open()) if r.get("train_loss")]
        results[family] = {
            "train_loss": [float(rows[0]["train_loss"]), float(rows[-1]["train_loss"])],
            "perplexity_one_process": one,
            "perplexity_cp2": cp2,
            "perplexity_rel_gap": abs(cp2 / one - 1),
            "tokens": tokens,
            "context_parallel": layout["context_parallel"],
            **compare_with_transformers(exported),
        }
        r = results[family]
        print(
            f"{family}: train_loss {r['train_loss'][0]:.3f} -> {r['train_loss'][1]:.3f}; perplexity of {tokens} tokens "
            f"{one:.4f} alone, {cp2:.4f} in cp2 (rel {r['perplexity_rel_gap']:.1e}); export loads as {r['class']}, "
            f"greedy {r['tokens']} tokens equal: {r['greedy_equal']}, logits within {r['logit_gap']:.1e}",
            flush=True,
        )
    (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
