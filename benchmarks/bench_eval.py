#!/usr/bin/env python
"""Evaluation speed: LAMBADA documents/s of `mtnlg-eval` vs lm-evaluation-harness' HF backend, side by side.

Both score the same file (the demo's held-out cloze set, tools/make_cloze_set.py) with the same exported model (a
random GPT-2 with the demo tokenizer, saved as a Hugging Face directory), fp32, the same batch size and threads.
Models are loaded before the clock starts; each timed run reads the file, builds the requests and scores them.
Rounds alternate; medians are compared. The accuracies of both are reported too (they must be equal).

Layout runs beside them (`--layouts tp2,pp2`): the same model saved as a project checkpoint folder and scored by
`mtnlg-eval --strategy configs/strategy/<layout>.yaml --devices N`, each launched once next to a single-process
`mtnlg-eval` launch of the same file (scoring time from results.json, loading excluded): documents/s, and per rank
the fraction of its forward time its stages computed (the rest is waiting on the previous stage or TP peers). On
a small shared CPU no speed-up is expected; the busy fractions show whether the pipeline is kept fed.

    python benchmarks/bench_eval.py [--layers 6 --hidden 512 --batch-size 16 --repeats 3 --layouts tp2,pp2]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from model_shape import add_model_shape_args  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.data.gpt_dataset import split_ranges  # noqa: E402
from mtnlg_lightning.data.tokenizer import Tokenizer  # noqa: E402
from mtnlg_lightning.demo.builtin_corpus import build_demo_data  # noqa: E402
from mtnlg_lightning.demo.synthetic.cloze import cloze_passages  # noqa: E402
from mtnlg_lightning.demo.synthetic.demo_corpus import demo_dir  # noqa: E402
from mtnlg_lightning.evaluation import tasks  # noqa: E402
from mtnlg_lightning.evaluation.data import read_jsonl  # noqa: E402
from mtnlg_lightning.inference.load import load_model  # noqa: E402
from mtnlg_lightning.inference.scoring import Scorer  # noqa: E402

TASK_YAML = """task: bench_lambada
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - {{metric: perplexity, aggregation: perplexity, higher_is_better: false}}
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
"""


def make_inputs(tmp: Path, layers: int, hidden: int, heads: int, docs: int) -> tuple[Path, Path, Path]:
    """(HF model dir, cloze file, harness task dir)."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    _, tokenizer_path = build_demo_data(progress=False)
    tokenizer = Tokenizer(tokenizer_path)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=1024, n_embd=hidden, n_layer=layers, n_head=heads)
    model_dir = tmp / "model"
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    fast = PreTrainedTokenizerFast(tokenizer_file=tokenizer_path, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(model_dir)
    texts = [json.loads(line)["text"] for line in open(demo_dir() / "python_docs.jsonl", encoding="utf-8")]
    _, (start, _), (_, end) = split_ranges(len(texts), "969,30,1")
    data = tmp / "cloze.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in cloze_passages(texts[start:end], docs)))
    task_dir = tmp / "tasks"
    task_dir.mkdir()
    (task_dir / "bench_lambada.yaml").write_text(TASK_YAML.format(data=data))
    return model_dir, data, task_dir


LAYOUT_DEVICES = {"tp2": 2, "pp2": 2, "tp2_pp2_dp2": 8, "tp4": 4}


def save_checkpoint_folder(model_dir: Path, out: Path) -> Path:
    """The Hugging Face model as a project checkpoint folder (one file of model-space pieces, a manifest)."""
    from mtnlg_lightning.checkpoint.format import (
        TOKENIZER,
        Piece,
        write_carried,
        write_manifest,
        write_meta,
        write_pieces,
    )
    from mtnlg_lightning.interop.hf import read_source

    state = read_source(model_dir)
    out.mkdir(parents=True)
    pieces = [Piece(f"model/{k}", v, (0,) * v.dim(), tuple(v.shape)) for k, v in state.weights.items()]
    written = write_pieces(out, "rank-00000.safetensors", pieces)
    # the tokenizer listed and hashed, or it is not used
    tokenizer = write_carried(out, {TOKENIZER: (model_dir / "tokenizer.json").read_bytes()})
    files = [written, write_meta(out, {"hyper_parameters": {}}), *tokenizer]
    write_manifest(out, files, {"model_config": vars(state.config)})
    return out


def layout_run(checkpoint: Path, data: Path, out: Path, batch_size: int, layout: str | None) -> dict:
    """One `mtnlg-eval` launch (single process when layout is None): its results.json."""
    import subprocess

    argv = ["--checkpoint", str(checkpoint), "--task", "lambada", "--data", str(data), "--dtype", "fp32"]
    argv += ["--batch-size", str(batch_size), "--no-progress", "--output", str(out)]
    if layout is not None:
        argv += ["--strategy", str(ROOT / "configs" / "strategy" / f"{layout}.yaml")]
        argv += ["--devices", str(LAYOUT_DEVICES[layout])]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-m", "mtnlg_lightning.evaluation.cli", *argv], env=env,
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode:
        raise SystemExit(f"bench_eval: mtnlg-eval {layout or 'single'} failed: {run.stderr.strip()[-2000:]}")
    return json.loads(out.read_text())


def layout_rows(model_dir: Path, data: Path, tmp: Path, batch_size: int, layouts: list[str]) -> list[dict]:
    checkpoint = save_checkpoint_folder(model_dir, tmp / "checkpoint")
    rows = []
    for layout in [None, *layouts]:
        found = layout_run(checkpoint, data, tmp / f"{layout}.json", batch_size, layout)
        metrics = found["results"]["lambada"]["0"]
        rows.append(
            {
                "layout": layout or "single",
                "ranks": LAYOUT_DEVICES.get(layout, 1),
                "docs_per_s": metrics["examples"] / found["seconds"],
                "acc": metrics["acc"],
                "perplexity": metrics["perplexity"],
                "stage_busy_fraction": found.get("stage_busy_fraction"),
            }
        )
    return rows


def main() -> int:
    ap = benchmark_parser(__doc__)
    add_model_shape_args(ap, layers=6, hidden=512, heads=8)
    ap.add_argument("--docs", type=int, default=200, help="cloze passages at most (the held-out text holds ~120)")
    ap.add_argument("--batch-size", type=int, default=16)
    add_rounds_arg(ap, 3, "--repeats")
    ap.add_argument("--layouts", default="tp2,pp2", help=f"layout runs, of {', '.join(LAYOUT_DEVICES)} ('' for none)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (both sides)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="both sides' weights")
    args = benchmark_args(ap)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data, task_dir = make_inputs(Path(tmp), args.layers, args.hidden, args.heads, args.docs)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        ours_model, state = load_model(model_dir, args.device, dtype)
        tokenizer = Tokenizer(model_dir)
        theirs_model = HFLM(
            pretrained=str(model_dir), dtype=str(dtype)[6:], batch_size=args.batch_size, device=args.device
        )
        manager = TaskManager(include_path=str(task_dir), verbosity="ERROR")

        def ours():
            docs = [r["text"] for r in read_jsonl(data, ("text",))]
            return tasks.lambada(Scorer(ours_model, args.batch_size), tokenizer, docs, 0)

        def theirs():
            out = simple_evaluate(model=theirs_model, tasks=["bench_lambada"], task_manager=manager, verbosity="ERROR")
            return out["results"]["bench_lambada"]

        ours_s, theirs_s = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            ours_result = ours()
            ours_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs_result = theirs()
            theirs_s.append(time.perf_counter() - start)
        layouts = layout_rows(model_dir, data, Path(tmp), args.batch_size, [x for x in args.layouts.split(",") if x])
    n = ours_result["examples"]
    o, t = n / statistics.median(ours_s), n / statistics.median(theirs_s)
    result = {
        "documents": n,
        "parameters": sum(p.numel() for p in ours_model.parameters()),
        "batch_size": args.batch_size,
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "ours_docs_per_s": o,
        "lm_eval_hf_docs_per_s": t,
        "ratio": o / t,
        "ours_acc": ours_result["acc"],
        "lm_eval_acc": theirs_result["acc,none"],
        "ours_perplexity": ours_result["perplexity"],
        "lm_eval_perplexity": theirs_result["perplexity,none"],
        "layouts": layouts,
    }
    print(f"# bench_eval: {n} LAMBADA-format documents, {result['parameters'] / 1e6:.0f}M parameters, {args.dtype}")
    print(f"mtnlg-eval {o:.1f} docs/s | lm-eval hf {t:.1f} docs/s | ratio {o / t:.2f}")
    print(f"acc {result['ours_acc']:.4f} vs {result['lm_eval_acc']:.4f}; "
          f"perplexity {result['ours_perplexity']:.4f} vs {result['lm_eval_perplexity']:.4f}")  # fmt: skip
    for row in layouts:
        busy = row["stage_busy_fraction"]
        shown = f" | stages busy {', '.join(f'{b:.2f}' for b in busy)}" if busy else ""
        print(f"mtnlg-eval {row['layout']:<12} ({row['ranks']} rank(s)) {row['docs_per_s']:.1f} docs/s | "
              f"acc {row['acc']:.4f} perplexity {row['perplexity']:.4f}{shown}")  # fmt: skip
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
