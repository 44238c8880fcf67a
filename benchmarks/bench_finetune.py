#!/usr/bin/env python
"""LoRA fine-tuning speed against TRL's SFTTrainer (with peft) and litgpt's finetune_lora, in one run on the same
model, data and row length; the useful-token share with and without packing; peak memory and model-state bytes of
LoRA against full fine-tuning.

The model: a random Llama built with transformers from a fixed seed (default hidden 384, 4 layers, 6 heads, 2
key/value heads, SwiGLU 1024, vocabulary 4224; `--preset smollm2-135m`: SmolLM2-135M's shape, 30 layers, hidden 576,
9 heads, 3 key/value heads, SwiGLU 1536, vocabulary 49152, tied embeddings, RoPE theta 1e5, where the output layer
and the depth cost what a real model's do), saved as a Hugging Face directory with the demo BPE tokenizer plus
ChatML's two special tokens and the ChatML template (with `{% generation %}` tags: TRL's `assistant_only_loss` and
our assistant mask read the same marks). The data: chat records from the synthetic instruction set
(`synthetic.instructions`), each a system turn, one user turn asking 1-16 of its questions and one assistant turn
answering them (single-turn, so litgpt can train on the very same records; 40-250 tokens).

Every trainer runs the same recipe: LoRA rank/alpha on every attention and MLP projection, dropout 0, AdamW (lr,
betas, weight decay), `--micro-batch` rows per step (one micro-batch per step), `--steps` steps of which the first
`--warmup` are not timed, rows of `--seq` tokens, each `--precision` (fp32; bf16: autocast over fp32 weights, ours
bf16-mixed and the Trainer's bf16; litgpt runs fp32 only), `--threads` threads, each run in its own process (fresh
memory: its peak is its own). The compared runs (ours, TRL packed, litgpt) alternate for `--rounds` rounds, each
round in a rotated order; medians are compared. TRL without packing, ours without packing and our full fine-tuning
run once, in the first round (`--variants`, `--once` choose).

What a token is (both reported):
- ours packs examples into rows of --seq by best-fit decreasing and pads each row's tail; the model computes on
  rows x seq positions; without packing, one example a row, each micro-batch cut to its longest row (rounded up to
  8);
- TRL with `packing=True` packs by best-fit decreasing too, then flattens the step's rows into one padding-free
  sequence (no padding computed); TRL without packing (its default) and litgpt (which cannot pack) pad each batch
  to its longest example.
So "positions/s" (what the model computed on) flatters whoever pads; "tokens/s" (the documents' own tokens, the
work that moves through the data set) is the fair figure and the headline; "trained tokens/s" counts the labelled
(assistant) positions; "examples/s" the documents (a packed row holds several). Seconds are CPU seconds of each
run's process on a CPU (the machine may be shared: waiting for a core is not the trainer's cost; one torch thread
each) and wall seconds on a GPU (`--clock`); both kinds are in the JSON (`finetune_steps.py`).

Useful-token share: the documents' tokens / positions, and the trained tokens / positions, of our rows over the
whole record set, packed and one example per row (padded to --seq), and of each trainer's measured batches.

Peak memory: `torch.cuda.max_memory_allocated` on a GPU, peak RSS on a CPU (`train.peak_memory`), over the training
steps. Model-state bytes (parameters, gradients, optimizer moments) from the live objects (`state_bytes.py`).

litgpt runs in its own virtual environment (`--litgpt-python`, default /work/venv-litgpt/bin/python: its pins of
huggingface_hub and jsonargparse conflict with this project's); without one, its rows say why.

    python benchmarks/bench_finetune.py [--hidden 384 --layers 4 --seq 256 --micro-batch 4 --steps 6 --rounds 2]
    python benchmarks/bench_finetune.py --preset smollm2-135m --precision fp32 bf16 --clock cpu --rounds 3 \
        --steps 4 --warmup 1 --most-questions 4 --micro-batch 2 --unpacked-micro-batch 7 --accumulate 4 \
        --variants ours_lora trl_lora ours_lora_unpacked trl_lora_unpacked --once
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from finetune_steps import rates  # noqa: E402
from model_shape import SMOLLM2_135M, add_model_shape_args, shape_fields  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, ratio, report  # noqa: E402

from mtnlg_lightning.config import get_config  # noqa: E402
from mtnlg_lightning.data.chat_template import NAMED_TEMPLATES, ChatTokenizer  # noqa: E402
from mtnlg_lightning.data.finetune import encode_split  # noqa: E402
from mtnlg_lightning.data.packing import Rows  # noqa: E402
from mtnlg_lightning.demo.builtin_corpus import build_demo_data  # noqa: E402
from mtnlg_lightning.demo.synthetic.instructions import SYSTEM, TASKS  # noqa: E402
from mtnlg_lightning.interop.llama_mapping import hf_config  # noqa: E402
from mtnlg_lightning.loss import IGNORE_INDEX  # noqa: E402

HERE = Path(__file__).resolve().parent
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (worker, LoRA, packed)
VARIANTS = {
    "ours_lora": ("ours", True, True),
    "trl_lora": ("trl", True, True),
    "trl_lora_unpacked": ("trl", True, False),
    "litgpt_lora": ("litgpt", True, False),
    "ours_lora_unpacked": ("ours", True, False),
    "ours_full": ("ours", False, True),
}
COMPARED = ["ours_lora", "trl_lora", "litgpt_lora"]  # the speed comparison: every round
# One run each: TRL's default (no packing), our rows unpacked, full fine-tuning (memory against LoRA).
ONCE = ["trl_lora_unpacked", "ours_lora_unpacked", "ours_full"]
DEFAULT_LITGPT_PYTHON = "/work/venv-litgpt/bin/python"
UNITS = {"cpu": "cpu_s", "wall": "s"}  # the clock -> the suffix of the per-second figures (finetune_steps.rates)
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "rope_theta", "tie_embeddings")
PRESETS = {  # --preset -> the model's shape (the options' defaults; an option given wins)
    "default": dict(layers=4, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=4224, rope_theta=10000.0),
    "smollm2-135m": {**SMOLLM2_135M, "tie_embeddings": True},
}
PRECISIONS = ("fp32", "bf16")


def chat_records(count: int, seed: int, most_questions: int) -> list[dict]:
    """`count` single-turn chats: the system turn, 1..most_questions questions of the instruction set in one user
    turn, their answers in one assistant turn (deterministic in `seed`)."""
    rng = random.Random(seed)
    tasks = list(TASKS.values())
    records = []
    for _ in range(count):
        pairs = [rng.choice(tasks)(rng) for _ in range(rng.randint(1, most_questions))]
        records.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "\n".join(q for q, _ in pairs)},
                    {"role": "assistant", "content": "\n".join(a for _, a in pairs)},
                ]
            }
        )
    return records


def build_model_dir(directory: Path, args, **fields) -> Path:
    """The random Llama (fixed seed) with the demo tokenizer + ChatML tokens and template, as a Hugging Face
    directory every trainer loads; `fields`: ModelConfig fields over the shape's (bench_grpo: rope_theta,
    tie_embeddings)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(build_demo_data(progress=False)[1])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_TOKENS])
    if tokenizer.get_vocab_size() > args.vocab:
        raise SystemExit(f"bench_finetune: --vocab {args.vocab} < the tokenizer's {tokenizer.get_vocab_size()}")
    plain_rope = {"rope_theta": 10000.0, "rope_scaling": None}  # litgpt's converter is given no RoPE scaling
    shape = get_config("demo-llama", **shape_fields(args), num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn,
                       max_position_embeddings=max(1024, args.seq), **{**plain_rope, **fields})  # fmt: skip
    config = hf_config(transformers, shape, args.vocab, None, "float32")
    config.eos_token_id = tokenizer.token_to_id("<|im_end|>")
    config.pad_token_id = tokenizer.token_to_id("<|endoftext|>")
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config)
    out = directory / "llama"
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "model_max_length": args.seq,
                "chat_template": NAMED_TEMPLATES["chatml"],
            }
        )
    )
    return out


def write_records(directory: Path, records: list[dict], chat: ChatTokenizer) -> tuple[Path, Path]:
    """The records as `messages` JSON lines (ours, TRL) and in litgpt's single-turn form: the template's rendering
    of everything before the answer as `instruction`, the answer as `output`."""
    messages = directory / "chat.jsonl"
    messages.write_text("".join(json.dumps(r) + "\n" for r in records))
    single_turn = [
        {
            "instruction": chat.render(r["messages"][:-1], add_generation_prompt=True),
            "input": "",
            "output": r["messages"][-1]["content"],
        }
        for r in records
    ]
    litgpt = directory / "chat_litgpt.json"
    litgpt.write_text(json.dumps(single_turn))
    return messages, litgpt


def row_shares(chat: ChatTokenizer, records: Path, seq_len: int) -> dict:
    """Our rows over the whole record set, packed and one example per row: documents' tokens / positions and
    trained tokens / positions."""
    split = encode_split(str(records), chat, seq_len, "assistant")
    tokens = sum(len(e) for e in split.examples)
    trained = sum(int((e.labels != IGNORE_INDEX).sum()) for e in split.examples)
    out = {"examples": len(split.examples), "dropped": sum(split.dropped.values()), "tokens": tokens}
    out["mean_example_tokens"] = tokens / len(split.examples)
    for name, build in (("packed", Rows.packed), ("unpacked", Rows.one_per_row)):
        rows = build(split.examples, seq_len, chat.pad_id)
        positions = len(rows) * seq_len
        out[name] = {"rows": len(rows), "token_share": tokens / positions, "trained_share": trained / positions}
    return out


def worker_env(spec: dict) -> tuple[dict, dict]:
    """The environment and spec of a worker: offline, its threads, a chosen GPU (cuda:N) as its only one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    env.update(OMP_NUM_THREADS=str(spec["threads"]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if spec["device"].startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = spec["device"].partition(":")[2]
        spec = {**spec, "device": "cuda"}
    return env, spec


def run_worker(name: str, spec: dict, scratch: Path, litgpt_python: str | None) -> dict:
    """One variant's run in its own process, in `spec["precision"]`: its StepLog."""
    worker, lora, packed = VARIANTS[name]
    env, spec = worker_env({**spec, "pack": packed, "lora": spec["lora"] if lora else None})
    label = labelled_run(name, spec["precision"])
    spec_path, out = scratch / f"{label}.spec.json", scratch / f"{label}.out.json"
    spec_path.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    if worker == "litgpt":
        command = [litgpt_python, str(HERE / "finetune_litgpt.py"), "run", str(spec_path), str(out)]
    else:
        command = [sys.executable, str(HERE / "finetune_workers.py"), worker, str(spec_path), str(out)]
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        tail = (proc.stdout + proc.stderr).strip()[-3000:]
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{tail}")
    log = json.loads(out.read_text())
    log["process_s"] = time.perf_counter() - started
    return log


def labelled_run(name: str, precision: str) -> str:
    """A run's name in the results: the variant's, `_bf16` added in bf16."""
    return name if precision == "fp32" else f"{name}_{precision}"


def litgpt_setup(python: str, model_dir: Path, scratch: Path) -> tuple[Path | None, dict]:
    """litgpt's converted copy of the model (None and the reason when litgpt cannot run here)."""
    if not python or not Path(python).exists():
        return None, {"unavailable": f"no litgpt environment at {python} (see the docstring)"}
    out = scratch / "litgpt_convert.json"
    command = [python, str(HERE / "finetune_litgpt.py"), "convert", str(model_dir), str(scratch / "litgpt"), str(out)]
    env, _ = worker_env({"threads": torch.get_num_threads(), "device": "cpu"})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=scratch)
    if proc.returncode or not out.exists():
        return None, {"unavailable": f"litgpt's conversion failed: {(proc.stdout + proc.stderr).strip()[-500:]}"}
    check = json.loads(out.read_text())
    if check["max_logit_difference"] > 1e-3:
        return None, {"unavailable": f"litgpt's converted model differs from transformers' ({check})"}
    return scratch / "litgpt", check


def summarise(runs: dict[str, list[dict]], warmup: int) -> dict:
    """Per variant: the median over rounds of each per-second figure, shares, peak memory, state bytes."""
    out = {}
    for name, logs in runs.items():
        per_round = [rates(log, warmup) for log in logs]
        figures = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
        figures["rounds"] = len(per_round)
        figures["tokens_per_s_each_round"] = [r["tokens_per_s"] for r in per_round]
        figures["tokens_per_cpu_s_each_round"] = [r["tokens_per_cpu_s"] for r in per_round]
        figures["peak_memory_bytes"] = statistics.median(log["peak_memory_bytes"] for log in logs)
        figures["memory_at_start_bytes"] = statistics.median(log["memory_at_start_bytes"] for log in logs)
        figures["process_s"] = statistics.median(log["process_s"] for log in logs)
        figures.update({k: v for k, v in logs[-1]["extra"].items()})
        out[name] = figures
    return out


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--preset", choices=list(PRESETS), default="default",
                    help="the model's shape: default (a small Llama) or smollm2-135m (SmolLM2-135M's); the shape "
                    "options below change it")  # fmt: skip
    add_model_shape_args(ap, layers=4, hidden=384, heads=6, vocab=4224, seq=256)
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    ap.add_argument("--ffn", type=int, default=1024, help="SwiGLU width (default 1024)")
    ap.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base (default 1e4)")
    ap.add_argument("--tie-embeddings", action="store_true", help="tie the input and output embeddings")
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=PRECISIONS,
                    help="each run in each: fp32, bf16 (autocast over fp32 weights) (default fp32)")  # fmt: skip
    ap.add_argument("--micro-batch", type=int, default=4, help="rows per step, every trainer (default 4)")
    ap.add_argument("--unpacked-micro-batch", type=int,
                    help="rows per step of the unpacked runs (default --micro-batch): a packed row holds several "
                    "examples, so as many examples a step as the packed runs takes more unpacked rows")  # fmt: skip
    ap.add_argument("--accumulate", type=int, default=1,
                    help="our runs' micro-batches per step (default 1), where unpacked rows are grouped by length "
                    "across them; TRL and litgpt always run one")  # fmt: skip
    ap.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run not timed (default 2)")
    add_rounds_arg(ap, 2)
    ap.add_argument("--records", type=int, default=400, help="chat records (default 400)")
    ap.add_argument("--most-questions", type=int, default=16, help="questions per record at most (default 16)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every run (default 1)")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1 ...")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--clock", default="auto", choices=["auto", "cpu", "wall"],
                    help="the headline's time: CPU time of each run's process (auto on a CPU: the machine may be "
                    "shared) or wall time (auto on a GPU)")  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=COMPARED, choices=list(VARIANTS), help="run every round")
    ap.add_argument("--once", nargs="*", default=ONCE, choices=list(VARIANTS), help="run in the first round only")
    ap.add_argument("--litgpt-python", default=DEFAULT_LITGPT_PYTHON, help="the Python of litgpt's environment")
    known, _ = ap.parse_known_args()
    ap.set_defaults(**PRESETS[known.preset])  # the preset's shape; an option given on the command line wins
    args = benchmark_args(ap)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as tmp:
        scratch = Path(tmp)
        model_dir = build_model_dir(scratch, args, rope_theta=args.rope_theta, tie_embeddings=args.tie_embeddings)
        chat = ChatTokenizer(model_dir)
        records = chat_records(args.records, args.seed, args.most_questions)
        messages, litgpt_records = write_records(scratch, records, chat)
        shares = row_shares(chat, messages, args.seq)
        litgpt_dir, litgpt_check = (None, {"unavailable": "not asked for"})
        variants = list(args.variants)
        once = [name for name in args.once if name not in variants]
        if "litgpt_lora" in variants + once:
            litgpt_dir, litgpt_check = litgpt_setup(args.litgpt_python, model_dir, scratch)
            if litgpt_dir is None:
                print(f"litgpt: {litgpt_check['unavailable']}", flush=True)
                variants, once = [v for v in variants if v != "litgpt_lora"], [v for v in once if v != "litgpt_lora"]
        spec = {
            "model_dir": str(model_dir),
            "records": str(messages),
            "litgpt_dir": str(litgpt_dir),
            "litgpt_records": str(litgpt_records),
            "scratch": str(scratch),
            "seq_len": args.seq,
            "micro_batch": args.micro_batch,
            "accumulate": args.accumulate,
            "steps": args.steps,
            "lr": args.lr,
            "betas": [0.9, 0.95],
            "weight_decay": 0.1,
            "threads": args.threads,
            "device": device,
            "seed": args.seed,
            "lora": {"rank": args.rank, "alpha": args.alpha, "targets": None, "hf_targets": HF_TARGETS},
        }
        runs: dict[str, list[dict]] = {}
        unpacked_rows = args.unpacked_micro_batch or args.micro_batch
        for round_ in range(args.rounds):
            turn = round_ % max(1, len(variants))
            order = variants[turn:] + variants[:turn]  # rotate who goes first
            for name in order + (once if round_ == 0 else []):
                for precision in args.precision:
                    if VARIANTS[name][0] == "litgpt" and precision != "fp32":
                        continue  # its worker trains in fp32 only
                    label = labelled_run(name, precision)
                    rows = spec["micro_batch"] if VARIANTS[name][2] else unpacked_rows
                    log = run_worker(name, {**spec, "precision": precision, "micro_batch": rows}, scratch,
                                     args.litgpt_python)  # fmt: skip
                    runs.setdefault(label, []).append(log)
                    r = rates(log, args.warmup)
                    peak = log["peak_memory_bytes"] / 2**20
                    print(f"round {round_ + 1}/{args.rounds} {label:<25} {r['examples_per_s']:6.2f} examples/s "
                          f"{r['tokens_per_s']:6.0f} tokens/s {r['tokens_per_cpu_s']:6.0f} tokens/CPU-s "
                          f"{r['step_s']:6.3f} s/step {r['step_cpu_s']:6.3f} CPU-s/step  peak {peak:.0f} MiB  "
                          f"({log['process_s']:.0f} s)", flush=True)  # fmt: skip
    figures = summarise(runs, args.warmup)
    clock = ("cpu" if device == "cpu" else "wall") if args.clock == "auto" else args.clock
    result = {
        "device": device,
        "clock": clock,
        "unit": UNITS[clock],
        "threads": args.threads,
        "preset": args.preset,
        "precisions": list(args.precision),
        "model": {k: getattr(args, k) for k in SHAPE},
        "seq_len": args.seq,
        "micro_batch": args.micro_batch,
        "unpacked_micro_batch": args.unpacked_micro_batch or args.micro_batch,
        "accumulate": args.accumulate,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "lora": {"rank": args.rank, "alpha": args.alpha, "targets": HF_TARGETS},
        "records": args.records,
        "row_shares": shares,
        "litgpt": litgpt_check,
        "variants": figures,
    }
    result["ratios"], result["unpacked_vs_packed"] = {}, {}
    for precision in args.precision:
        ours_name = labelled_run("ours_lora", precision)
        same = [name for name in figures if name.endswith("_bf16") == (precision == "bf16")]
        result["ratios"] |= {
            f"{ours_name}_vs_{name}": rates_ratio(figures.get(ours_name, {}), figures[name])
            for name in same
            if name != ours_name
        }
        for trainer in ("ours", "trl"):
            packed, unpacked = (labelled_run(f"{trainer}_lora{kind}", precision) for kind in ("", "_unpacked"))
            if packed in figures and unpacked in figures:
                result["unpacked_vs_packed"][unpacked] = rates_ratio(figures[unpacked], figures[packed])
    return report(result, args.json, print_table)


def rates_ratio(a: dict, b: dict) -> dict:
    """a's per-second figures over b's, per kind and clock."""
    kinds = ("examples", "tokens", "trained", "positions")
    return {f"{k}_per_{u}": ratio(a.get(f"{k}_per_{u}"), b.get(f"{k}_per_{u}")) for u in UNITS.values() for k in kinds}


def print_table(result: dict) -> None:
    v = result["variants"]
    m = result["model"]
    tied = ", tied embeddings" if m.get("tie_embeddings") else ""
    print(
        f"\n# bench_finetune ({result.get('preset', 'default')}): Llama hidden {m['hidden']}, {m['layers']} layers, "
        f"{m['heads']} heads ({m['kv_heads']} kv), ffn {m['ffn']}, vocab {m['vocab']}{tied}; seq {result['seq_len']}, "
        f"{result['micro_batch']} rows/micro-batch ({result.get('unpacked_micro_batch', result['micro_batch'])} "
        f"unpacked), ours {result.get('accumulate', 1)} micro-batch(es)/step, "
        f"{result['steps']} steps ({result['warmup']} untimed), "
        f"{result['rounds']} rounds, {result['device']}, {result['threads']} thread(s) every run, "
        f"{' and '.join(result.get('precisions', ['fp32']))}; LoRA r{result['lora']['rank']} alpha "
        f"{result['lora']['alpha']} on {', '.join(result['lora']['targets'])}"
    )
    unit = result["unit"]
    per = "/CPU-s" if unit == "cpu_s" else "/s"
    print(f"per second of {'CPU time of each process' if unit == 'cpu_s' else 'wall time'}; "
          f"{'--clock wall' if unit == 'cpu_s' else '--clock cpu'} heads the table with the other clock (both in "
          "the JSON); s/step is wall time, CPU-s/step the process's")  # fmt: skip
    print(f"{'run':<25} {'examples' + per:>15} {'tokens' + per:>13} {'trained' + per:>14} {'positions' + per:>16} "
          f"{'s/step':>7} {'CPU-s/step':>10} {'token sh.':>9} {'peak MiB':>9} {'trainable':>10}")  # fmt: skip
    for name, f in v.items():
        print(f"{name:<25} {f.get(f'examples_per_{unit}', 0):15.2f} {f[f'tokens_per_{unit}']:13.0f} "
              f"{f[f'trained_per_{unit}']:14.0f} {f[f'positions_per_{unit}']:16.0f} {f['step_s']:7.3f} "
              f"{f['step_cpu_s']:10.3f} {f['token_share']:9.3f} {f['peak_memory_bytes'] / 2**20:9.0f} "
              f"{f.get('trainable_parameters', 0):10,}")  # fmt: skip
    kinds = ("examples", "tokens", "trained", "positions")
    for title, table in (("", result["ratios"]), ("unpacked over packed: ", result.get("unpacked_vs_packed", {}))):
        for name, r in table.items():
            shown = ", ".join(f"{k} {r[f'{k}_per_{unit}']:.2f}x" for k in kinds if r.get(f"{k}_per_{unit}"))
            print(f"{title}{name}: {shown}")
    if "unavailable" in result["litgpt"]:
        print(f"litgpt: not run: {result['litgpt']['unavailable']}")
    else:
        print(f"litgpt: converted by its own converter, logits within {result['litgpt']['max_logit_difference']:.1e}")
    s = result["row_shares"]
    print(
        f"useful-token share of our rows over the {s['examples']} examples (mean {s['mean_example_tokens']:.0f} "
        f"tokens): packed {s['packed']['token_share']:.3f} (trained {s['packed']['trained_share']:.3f}, "
        f"{s['packed']['rows']} rows) | one per row {s['unpacked']['token_share']:.3f} (trained "
        f"{s['unpacked']['trained_share']:.3f}, {s['unpacked']['rows']} rows)"
    )
    if "ours_full" in v and "ours_lora" in v:
        lora, full = v["ours_lora"], v["ours_full"]
        a, b = lora["peak_memory_bytes"], full["peak_memory_bytes"]
        print(f"peak memory, ours LoRA vs full: {a / 2**20:.0f} vs {b / 2**20:.0f} MiB ({a / b:.2f}x)")
        a, b = a - lora["memory_at_start_bytes"], b - full["memory_at_start_bytes"]
        print(f"  above what the process held at the first step: {a / 2**20:.0f} vs {b / 2**20:.0f} MiB ({a / b:.2f}x)")
        for key in ("params", "grads", "moments", "total"):
            a, b = lora["state_bytes"][key], full["state_bytes"][key]
            print(f"  model state {key:<8} LoRA {a / 2**20:8.2f} MiB | full {b / 2**20:8.2f} MiB")


if __name__ == "__main__":
    sys.exit(main())
