#!/usr/bin/env python
"""GRPO with LoRA against TRL's GRPOTrainer with peft, in one run on the same model, prompts, reward function, group
size and lengths: steps per second, generated tokens per second, and where a step's time goes (generation, scoring,
training, the rest).

The model: a random Llama built with transformers from a fixed seed, by default in SmolLM2-135M's shape (30 layers,
hidden 576, 9 heads, 3 key/value heads, SwiGLU 1536, vocabulary 49152, tied embeddings, RoPE theta 100000), saved as
a Hugging Face directory with bench_finetune's tokenizer (the demo BPE plus ChatML's two special tokens, the ChatML
template; `build_model_dir`). The tokenizer knows only the first ~4.2k ids: the sampler still draws from the whole
vocabulary (the cost of the head is the model's), and ids beyond the tokenizer decode to nothing on both sides.
`--small` is a tiny shape for a smoke run (under a minute). `--model-dir` takes a trained model's directory instead
(e.g. the GRPO demo's fine-tuned model, `mtnlg-export-hf runs/finetune_demo/checkpoints/last.ckpt DIR`), with
`--prompts-file` (prompt records, e.g. the demo's `runs/grpo_demo/prompts.jsonl`) and `--reward` (e.g. the shipped
`accuracy`): the learning race of a trained model, each side's reward per step printed with its seconds. TRL
decodes to max_completion_length (its generation does not stop at a chat template's end-of-turn text, which ours
does): its completions are cut at the template's end marker before the reward reads them, as ours are.

Both sides, per step: the same `--prompts` chat prompts (a system turn and one question of the synthetic instruction
set, with an `answer` column; the same prompts every step), `--generations` completions each (G), at most
`--completion-length` new tokens, temperature 1.0, the same deterministic reward function with TRL's signature (the
share of a completion's ids in the lower `--reward-share` of the vocabulary, read from `completion_ids`), beta 0 (no
reference pass), one update per generated batch, every completion of the step in one micro-batch, LoRA rank/alpha on
every attention and MLP projection (dropout 0), AdamW at a constant learning rate (betas 0.9/0.999, no weight decay),
clipping at 1.0, fp32, `--threads` torch threads, `--steps` steps of which the first `--warmup` are not timed. TRL's
gradient checkpointing (on by default in GRPOConfig) is off, as ours recomputes nothing (`--variants trl_recompute`
adds a TRL run with its default). Ours: `mtnlg fit`'s machinery (MTNLGModule with objective grpo, PromptDataModule)
under Lightning's Trainer, whose model's seq_len (`--seq-len`) is by default the longest prompt + the completion
length. Ours trains a prompt's G completions as branches of one row that computes the prompt once (GRPO's
`share_prompts`, the default where no pipeline runs); `--variants ours_unshared` adds our run with a row per
completion (prompt + completion, padded to a multiple of 64), as TRL's rows are (each batch padded to its longest
prompt + longest completion). The table's note says the rows each of our runs trained.

The runs share this process (the same threads and memory), one after the other, the order rotated each round
(`--rounds`; medians compared). A step is timed from its first callback (Lightning's `on_train_batch_start`,
transformers' `on_step_begin`) to its last (`on_train_batch_end`, `on_step_end`); the rates are the measured steps'
sums over the time from the first measured step's start to the last one's end, on the wall clock and in CPU time of
the process (the machine may be shared: a wait for a core is the neighbour's cost, not the trainer's). Generated
tokens are counted from each side's completions (up to and including an end-of-turn token, as TRL's
completions/mean_length counts them).

The split of a step:
- ours: the objective's `timing/generation_s` (decoding), `timing/scoring_s` (the reward functions on the decoded
  completions, the advantages, the rows to train on; where an objective logs none, the reward call timed here) and
  `timing/training_s` (the forward and backward passes); the rest (the optimizer step, clipping, logging,
  Lightning) is the step less those;
- TRL: generation is `_generate` (chat template, `generate`, decoding), scoring `_generate_and_score_completions`
  less `_generate` (the reward functions, the advantages, the rows), training `training_step` less
  `_prepare_inputs` (the forward and backward passes), each timed here around the method; the rest (the optimizer
  step, clipping, logging) is the step less those.

    python benchmarks/bench_grpo.py [--small] [--steps 4 --warmup 1 --threads 1 --rounds 1 --json grpo.json]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: testing.*
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from bench_finetune import HF_TARGETS, build_model_dir  # noqa: E402
from model_shape import SMOLLM2_135M, add_model_shape_args  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, ratio, report, trl_training_args  # noqa: E402

from mtnlg_lightning.data.chat_template import ChatTokenizer  # noqa: E402
from mtnlg_lightning.demo.synthetic.instructions import SYSTEM, TASKS  # noqa: E402

# SmolLM2-135M's shape (its config.json): the defaults; --small replaces them.
SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=4224, rope_theta=100000.0)
# trl_recompute: TRL with GRPOConfig's default gradient checkpointing; ours_unshared: ours with a row per completion
VARIANTS = ("ours", "trl", "trl_recompute", "ours_unshared")
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]  # peft's names of a GPT-2's attention and MLP projections
REWARD = '''
def low_ids(prompts, completions, completion_ids, **kwargs):
    """The share of a completion's ids below {below} (of a {vocab}-id vocabulary)."""
    return [sum(t < {below} for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''
PHASES = ("generation", "scoring", "training")


class StepClock:
    """Every step's wall and CPU start and end, its generated tokens and the seconds of its phases."""

    def __init__(self):
        self.starts, self.ends, self.cpu_starts, self.cpu_ends = [], [], [], []
        self.tokens: list[int] = []
        self.phases: list[dict[str, float]] = []
        self.threads: list[int] = []
        self.rewards: list[float] = []  # each step's mean reward, as the trainer logged it
        self._open: dict[str, float] = {}

    def begin(self) -> None:
        self.threads.append(torch.get_num_threads())
        self._open = {}
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def end(self, tokens: int, phases: dict[str, float]) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.tokens.append(int(tokens))
        self.phases.append({name: float(seconds) for name, seconds in phases.items()})

    def timed(self, name: str, method):
        """`method` wrapped to add its wall seconds to this step's `name`."""

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._open[name] = self._open.get(name, 0.0) + time.perf_counter() - started

        return wrapper

    def taken(self, name: str) -> float:
        return self._open.get(name, 0.0)

    def as_dict(self) -> dict:
        keys = ("starts", "ends", "cpu_starts", "cpu_ends", "tokens", "phases", "threads", "rewards")
        return {key: getattr(self, key) for key in keys}


def chat_prompts(count: int, seed: int) -> list[dict]:
    """`count` prompt records in TRL's conversational form: the system turn and one question of the synthetic
    instruction set, with its answer as a column."""
    rng = random.Random(seed)
    tasks = list(TASKS.values())
    records = []
    for _ in range(count):
        question, answer = rng.choice(tasks)(rng)
        turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        records.append({"prompt": turns, "answer": answer})
    return records


# ------------------------------------------------------------------------------------------------------ ours
def run_ours(spec: dict, clock: StepClock, share_prompts: bool = True) -> dict:
    import lightning as L

    from mtnlg_lightning.data.prompts import PromptDataModule
    from mtnlg_lightning.train.module import MTNLGModule
    from testing.lightning_run import quiet_trainer

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            objective = pl_module.objective
            objective._rewards = clock.timed("scoring", objective._rewards)  # where no timing/scoring_s is logged

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            objective = pl_module.objective
            metrics = objective.metrics
            phases = {
                "generation": float(metrics["timing/generation_s"]),
                "scoring": float(metrics.get("timing/scoring_s", clock.taken("scoring"))),
                "training": float(metrics["timing/training_s"]),
            }
            clock.end(sum(len(ids) for ids in objective.completions), phases)
            clock.rewards.append(float(metrics["reward"]))
            prompts.extend(len(ids) for ids in batch["prompt_ids"])
            rows.append(list(objective.trained_rows["input_ids"].shape))

    rows: list[list[int]] = []

    prompts: list[int] = []
    L.seed_everything(spec["seed"], verbose=False)
    lr = spec["lr"]
    module = MTNLGModule(
        init_from=spec["model_dir"],
        model_overrides={"seq_len": spec["seq_len"]},
        micro_batch_size=spec["prompts"],  # every completion of the step in one micro-batch, as TRL's
        global_batch_size=spec["prompts"],
        lr=lr,
        min_lr=lr,
        warmup_tokens=0,
        decay_tokens=10**15,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        preemption=False,
        watchdog=False,
        straggler_every_n_steps=0,
        lora={"rank": spec["rank"], "alpha": spec["alpha"], "dropout": 0.0, "targets": None},
        objective="grpo",
        grpo={
            "num_generations": spec["generations"],
            "max_completion_length": spec["completion_length"],
            "temperature": spec["temperature"],
            "beta": 0.0,
            "share_prompts": share_prompts,
        },
        rewards=[spec["reward_spec"]],
    )
    data = PromptDataModule(train=spec["prompts_file"], seed=spec["seed"])
    trainer = quiet_trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=spec["steps"],
                            callbacks=[Record()])  # fmt: skip
    trainer.fit(module, data)
    return {
        "trainable_parameters": sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        "parameters": sum(p.numel() for p in module.model.parameters()),
        "mean_prompt_tokens": statistics.mean(prompts),
        "rows_trained": rows[-1],  # [rows, width] of the last step
    }


# ------------------------------------------------------------------------------------------------------ TRL
def without_stop_strings(model_dir: Path, copy: Path) -> Path:
    """`model_dir`, or where its generation_config.json names stop strings (our exports' end-of-turn text), a copy
    of it without them (links to its other files): transformers' generate needs the tokenizer for them, which TRL's
    GRPOTrainer does not pass it."""
    config_path = model_dir / "generation_config.json"
    if not config_path.exists() or "stop_strings" not in json.loads(config_path.read_text()):
        return model_dir
    copy.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.name != "generation_config.json":
            (copy / path.name).symlink_to(path.resolve())
    config = {k: v for k, v in json.loads(config_path.read_text()).items() if k != "stop_strings"}
    (copy / "generation_config.json").write_text(json.dumps(config))
    return copy


def run_trl(spec: dict, clock: StepClock, recompute: bool = False) -> dict:
    import datasets
    import peft
    import transformers
    import trl

    from mtnlg_lightning.rewards import load_rewards

    reward = load_rewards([spec["reward_spec"]]).functions[0].function  # the very function ours calls
    end_text = spec.get("end_text")
    if end_text:  # what ours hands a reward: the turn's text, up to the template's end marker
        scored = reward

        def reward(prompts, completions, completion_ids, **columns):
            def cut(text: str) -> str:
                return text.split(end_text)[0]

            completions = [
                [{**c[0], "content": cut(c[0]["content"])}] if isinstance(c, list) else cut(c) for c in completions
            ]
            return scored(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

        reward.__name__ = scored.__name__
    prompts: list[int] = []

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            phases = {
                "generation": clock.taken("generation"),
                "scoring": clock.taken("generate_and_score") - clock.taken("generation"),
                "training": clock.taken("training_step") - clock.taken("prepare"),
            }
            clock.end(generated[0], phases)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                clock.rewards.append(float(logs["reward"]))

    generated = [0]

    def counted(method):
        def generate(prompts_in):
            out = method(prompts_in)
            prompt_ids, completion_ids = out[0], out[1]
            generated[0] = sum(len(ids) for ids in completion_ids)
            prompts.extend(len(ids) for ids in prompt_ids)
            return out

        return generate

    torch.manual_seed(spec["seed"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model_dir"])
    if tokenizer.pad_token is None or tokenizer.eos_token is None:  # TRL pads and stops with them: the generation
        eos = transformers.GenerationConfig.from_pretrained(spec["model_dir"]).eos_token_id  # config's (end of text)
        eos = tokenizer.convert_ids_to_tokens(eos[0] if isinstance(eos, list) else eos)
        tokenizer.pad_token, tokenizer.eos_token = tokenizer.pad_token or eos, tokenizer.eos_token or eos
    records = [json.loads(line) for line in open(spec["prompts_file"], encoding="utf-8")]
    with tempfile.TemporaryDirectory(prefix="bench_grpo_trl_") as out:
        model_dir = without_stop_strings(Path(spec["model_dir"]), Path(out) / "model")
        config = trl.GRPOConfig(
            **trl_training_args(out, spec["steps"], spec["lr"], 0.0, (0.9, 0.999), spec["seed"]),  # bf16 off:
            per_device_train_batch_size=spec["prompts"] * spec["generations"],  # GRPOConfig's default autocasts
            num_generations=spec["generations"],
            max_completion_length=spec["completion_length"],
            temperature=spec["temperature"],
            beta=0.0,
            activation_checkpointing=recompute,  # GRPOConfig's default (gradient_checkpointing) is on
            use_cpu=True,
            report_to=[],
            logging_steps=1,
        )
        trainer = trl.GRPOTrainer(
            model=str(model_dir),
            reward_funcs=reward,
            args=config,
            train_dataset=datasets.Dataset.from_list(records),
            processing_class=tokenizer,
            peft_config=peft.LoraConfig(
                r=spec["rank"],
                lora_alpha=spec["alpha"],
                lora_dropout=0.0,
                target_modules=spec["hf_targets"],
                task_type="CAUSAL_LM",
            ),
            callbacks=[Record()],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its per-step log lines
        trainer._generate = clock.timed("generation", counted(trainer._generate))
        trainer._generate_and_score_completions = clock.timed(
            "generate_and_score", trainer._generate_and_score_completions
        )
        trainer._prepare_inputs = clock.timed("prepare", trainer._prepare_inputs)
        trainer.training_step = clock.timed("training_step", trainer.training_step)
        trainer.train()
    model = trainer.model
    return {
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "parameters": sum(p.numel() for p in model.parameters()),
        "mean_prompt_tokens": statistics.mean(prompts),
    }


# ------------------------------------------------------------------------------------------------------ figures
def rates(log: dict, warmup: int) -> dict:
    """Over the steps after `warmup`: seconds and CPU seconds per step, steps and generated tokens per second (wall
    and CPU), the mean split of a step, and the warm-up steps' own seconds."""
    n = len(log["starts"])
    measured = range(warmup, n)
    if not measured:
        raise ValueError(f"no step after the {warmup} warm-up steps ({n} steps run)")
    seconds = log["ends"][-1] - log["starts"][warmup]
    cpu_seconds = log["cpu_ends"][-1] - log["cpu_starts"][warmup]
    tokens = sum(log["tokens"][i] for i in measured)
    durations = [log["ends"][i] - log["starts"][i] for i in measured]
    cpu_durations = [log["cpu_ends"][i] - log["cpu_starts"][i] for i in measured]
    split = {name: statistics.mean(log["phases"][i][name] for i in measured) for name in PHASES}
    split["rest"] = statistics.mean(durations) - sum(split.values())
    return {
        "steps": len(measured),
        "step_s": seconds / len(measured),
        "step_cpu_s": cpu_seconds / len(measured),
        "steps_per_s": len(measured) / seconds,
        "steps_per_cpu_s": len(measured) / cpu_seconds,
        "median_step_s": statistics.median(durations),  # the figure a neighbour's burst moves least
        "median_step_cpu_s": statistics.median(cpu_durations),
        "tokens_per_step": tokens / len(measured),
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / cpu_seconds,
        "split_s": split,
        "warmup_step_s": [log["ends"][i] - log["starts"][i] for i in range(warmup)],
        "warmup_split_s": [log["phases"][i] for i in range(warmup)],
        "each_step_s": [log["ends"][i] - log["starts"][i] for i in range(n)],
        "threads": sorted(set(log["threads"])),
    }


def summarise(runs: dict[str, list[dict]], warmup: int) -> dict:
    """Per variant: the median over rounds of each figure (the split: of each phase)."""
    out = {}
    for name, logs in runs.items():
        per_round = [rates(log, warmup) for log in logs]
        scalar = [k for k, v in per_round[0].items() if isinstance(v, float)]
        figures = {key: statistics.median(r[key] for r in per_round) for key in scalar}
        figures["split_s"] = {k: statistics.median(r["split_s"][k] for r in per_round) for k in per_round[0]["split_s"]}
        figures["warmup_step_s"] = [r["warmup_step_s"] for r in per_round]
        figures["warmup_split_s"] = [r["warmup_split_s"] for r in per_round]
        figures["each_step_s"] = [r["each_step_s"] for r in per_round]
        figures["step_s_each_round"] = [r["step_s"] for r in per_round]
        figures["threads"] = sorted({t for r in per_round for t in r["threads"]})
        figures["rounds"] = len(per_round)
        figures["rewards"] = [log["rewards"] for log in logs]  # each round's reward per step
        figures["cumulative_s"] = [[end - log["starts"][0] for end in log["ends"]] for log in logs]
        figures.update(logs[-1]["extra"])
        out[name] = figures
    return out


def main() -> int:
    ap = benchmark_parser(__doc__)
    add_model_shape_args(ap, layers=SMOLLM2_135M["layers"], hidden=SMOLLM2_135M["hidden"],
                         heads=SMOLLM2_135M["heads"], vocab=SMOLLM2_135M["vocab"])  # fmt: skip
    ap.add_argument("--kv-heads", type=int, default=SMOLLM2_135M["kv_heads"], help="key/value heads (default 3)")
    ap.add_argument("--ffn", type=int, default=SMOLLM2_135M["ffn"], help="SwiGLU width (default 1536)")
    ap.add_argument("--rope-theta", type=float, default=SMOLLM2_135M["rope_theta"], help="RoPE base (default 1e5)")
    ap.add_argument(
        "--small", action="store_true", help="a tiny Llama (2 layers, hidden 64, vocabulary 4224): a smoke run"
    )
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step, the same every step (default 4)")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt, G (default 4)")
    ap.add_argument("--completion-length", type=int, default=16, help="new tokens per completion at most (default 16)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    ap.add_argument("--seq-len", type=int, default=0,
                    help="our rows' length (default 0: the longest prompt + --completion-length)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=4, help="steps per run (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run not timed (default 1)")
    add_rounds_arg(ap, 1)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--alpha", type=int, default=32, help="LoRA alpha (default 32)")
    ap.add_argument("--lr", type=float, default=1e-5, help="constant learning rate, both sides (default 1e-5)")
    ap.add_argument("--reward-share", type=float, default=0.5,
                    help="the reward: the share of a completion's ids below this fraction of the vocabulary (default "
                    "0.5; 0.125 starts near 0.13, for a learning race: --steps 16 --lr 1e-3)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every run (default 1: on a shared 2-core machine two threads per op stall "
                    "whenever another process runs)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--model-dir", default=None,
                    help="a trained model's Hugging Face directory instead of the random one (the shape flags are "
                    "then its own)")  # fmt: skip
    ap.add_argument("--prompts-file", default=None,
                    help="prompt records (JSONL: prompt, and columns for the reward) drawn --prompts a step; default: "
                    "--prompts synthetic instruction prompts, the same every step")  # fmt: skip
    ap.add_argument("--reward", default=None,
                    help="the reward function, as --model.rewards names one (accuracy, module:function, "
                    "file.py:function); default: the share of low ids (--reward-share)")  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=["ours", "trl"], choices=VARIANTS,
                    help="the runs of each round (default ours trl; trl_recompute: TRL with its default gradient "
                    "checkpointing)")  # fmt: skip
    args = benchmark_args(ap)
    if args.small:
        for key, value in SMALL.items():
            setattr(args, key, value)
    args.seq = 1024  # the directory's position limit and tokenizer length (the rows' length is --seq-len's)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as tmp:
        scratch = Path(tmp)
        if args.model_dir:
            model_dir = Path(args.model_dir)
            shape = json.loads((model_dir / "config.json").read_text())
            args.layers, args.hidden, args.heads = shape.get("n_layer"), shape.get("n_embd"), shape.get("n_head")
            args.kv_heads = args.heads
            if shape["model_type"] != "gpt2":
                args.layers, args.hidden = shape["num_hidden_layers"], shape["hidden_size"]
                args.heads, args.kv_heads = shape["num_attention_heads"], shape.get("num_key_value_heads")
            args.vocab, args.ffn = shape["vocab_size"], shape.get("intermediate_size") or shape.get("n_inner")
        else:
            model_dir = build_model_dir(scratch, args, rope_theta=args.rope_theta, tie_embeddings=True)
            shape = {"model_type": "llama"}
        chat = ChatTokenizer(model_dir)
        if args.prompts_file:
            records = [json.loads(line) for line in open(args.prompts_file, encoding="utf-8") if line.strip()]
        else:
            records = chat_prompts(args.prompts, args.seed)
        prompt_lengths = [len(chat.prompt_ids(r["prompt"])) for r in records]
        seq_len = args.seq_len or max(prompt_lengths) + args.completion_length
        prompts_file = scratch / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps(r) + "\n" for r in records))
        below = int(args.vocab * args.reward_share)
        (scratch / "grpo_reward.py").write_text(REWARD.format(vocab=args.vocab, below=below))
        end = chat.end_of_turn()
        spec = {
            "model_dir": str(model_dir),
            "prompts_file": str(prompts_file),
            "reward_spec": args.reward or f"{scratch / 'grpo_reward.py'}:low_ids",
            "end_text": end.texts[0] if end.texts else None,
            "hf_targets": GPT2_TARGETS if shape["model_type"] == "gpt2" else HF_TARGETS,
            "prompts": args.prompts,
            "generations": args.generations,
            "completion_length": args.completion_length,
            "temperature": args.temperature,
            "seq_len": seq_len,
            "steps": args.steps,
            "lr": args.lr,
            "rank": args.rank,
            "alpha": args.alpha,
            "seed": args.seed,
        }
        print(f"bench_grpo: {len(records)} prompts of {min(prompt_lengths)}-{max(prompt_lengths)} tokens, our model's "
              f"seq_len {seq_len}; {args.threads} thread(s), "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in args.variants}
        for round_ in range(args.rounds):
            turn = round_ % len(args.variants)
            for name in args.variants[turn:] + args.variants[:turn]:  # rotate who goes first
                torch.set_num_threads(args.threads)
                clock = StepClock()
                started = time.perf_counter()
                if name.startswith("ours"):
                    extra = run_ours(spec, clock, share_prompts=name == "ours")
                else:
                    extra = run_trl(spec, clock, recompute=name == "trl_recompute")
                log = {**clock.as_dict(), "extra": extra, "run_s": time.perf_counter() - started}
                runs[name].append(log)
                r = rates(log, args.warmup)
                split = ", ".join(f"{k} {v:.2f}" for k, v in r["split_s"].items())
                steps = ", ".join(f"{s:.2f}" for s in r["each_step_s"])
                print(f"round {round_ + 1}/{args.rounds} {name:<14} {r['step_s']:7.2f} s/step {r['step_cpu_s']:7.2f} "
                      f"CPU-s/step {r['tokens_per_s']:7.1f} tokens/s ({r['tokens_per_step']:.0f} tokens/step; "
                      f"{split} s; every step {steps} s; run {log['run_s']:.0f} s, load average "
                      f"{os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    figures = summarise(runs, args.warmup)
    result = {
        "device": "cpu",
        "threads": args.threads,
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "rope_theta")},
        "small": args.small,
        "prompts": args.prompts,
        "generations": args.generations,
        "completion_length": args.completion_length,
        "prompt_tokens": prompt_lengths,
        "seq_len": seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "lora": {"rank": args.rank, "alpha": args.alpha, "targets": spec["hf_targets"]},
        "model_dir": args.model_dir,
        "model_label": f"{shape['model_type']} ({'trained: ' + args.model_dir if args.model_dir else 'random'})",
        "reward": args.reward,
        "lr": args.lr,
        "reward_share": args.reward_share,
        "variants": figures,
    }
    ours = figures.get("ours", {})
    result["ratios"] = {
        f"ours_vs_{name}": {
            key: ratio(ours.get(key), figures[name].get(key))
            for key in ("steps_per_s", "steps_per_cpu_s", "tokens_per_s", "tokens_per_cpu_s")
        }
        | {
            key: ratio(figures[name].get(key), ours.get(key))  # a time: theirs / ours
            for key in ("median_step_s", "median_step_cpu_s")
        }
        for name in figures
        if name != "ours"
    }
    return report(result, args.json, print_table)


def print_table(result: dict) -> None:
    m = result["model"]
    lengths = result["prompt_tokens"]
    if len(lengths) > 8:  # a prompts file: its range
        lengths = f"{min(lengths)}-{max(lengths)} ({len(lengths)} prompts, mean {statistics.mean(lengths):.1f})"
    print(
        f"\n# bench_grpo: {result['model_label']} hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads "
        f"({m['kv_heads']} kv), "
        f"ffn {m['ffn']}, vocab {m['vocab']}, fp32; {result['prompts']} prompts x {result['generations']} "
        f"generations x <= {result['completion_length']} new tokens a step; prompts of {lengths} "
        f"tokens, our model's seq_len {result['seq_len']}; LoRA r{result['lora']['rank']} alpha "
        f"{result['lora']['alpha']}; "
        f"{result['steps']} steps ({result['warmup']} untimed), {result['rounds']} round(s), {result['threads']} "
        f"thread(s)"
    )
    print(f"{'run':<14} {'s/step':>7} {'CPU-s/step':>10} {'median s':>8} {'steps/s':>8} {'tokens/step':>11} "
          f"{'tokens/s':>9} {'tokens/CPU-s':>12} | {'generation':>10} {'scoring':>8} {'training':>8} {'rest':>6} "
          f"(s/step)")  # fmt: skip
    for name, f in result["variants"].items():
        s = f["split_s"]
        print(f"{name:<14} {f['step_s']:7.2f} {f['step_cpu_s']:10.2f} {f['median_step_s']:8.2f} "
              f"{f['steps_per_s']:8.3f} {f['tokens_per_step']:11.1f} {f['tokens_per_s']:9.1f} "
              f"{f['tokens_per_cpu_s']:12.1f} | {s['generation']:10.2f} {s['scoring']:8.3f} {s['training']:8.2f} "
              f"{s['rest']:6.2f}")  # fmt: skip
    for name, r in result["ratios"].items():
        shown = ", ".join(f"{key} {value:.2f}x" for key, value in r.items() if value is not None)
        print(f"{name}: {shown}  (target >= 1.5x; median_*: the other's median step time / ours)")
    for name, f in result["variants"].items():
        warm = "; ".join(
            f"{seconds:.2f} s ({', '.join(f'{k} {v:.2f}' for k, v in split.items())})"
            for rounds, splits in zip(f["warmup_step_s"], f["warmup_split_s"], strict=True)
            for seconds, split in zip(rounds, splits, strict=True)
        )
        trained = f" rows trained {f['rows_trained'][0]} x {f['rows_trained'][1]};" if "rows_trained" in f else ""
        print(f"{name}: warm-up step(s) {warm or 'none'}; mean prompt {f['mean_prompt_tokens']:.1f} tokens;{trained} "
              f"trainable {f['trainable_parameters']:,} of {f['parameters']:,}; threads {f['threads']}")  # fmt: skip
    for name, f in result["variants"].items():  # how fast each learns: its reward per step, on the wall clock
        for rewards, seconds in zip(f["rewards"], f["cumulative_s"], strict=True):
            if not rewards:
                continue
            head, tail = rewards[: min(5, len(rewards))], rewards[-min(5, len(rewards)) :]
            curve = " ".join(f"{r:.2f}" for r in rewards)
            print(f"{name}: reward per step {curve}; first {len(head)} steps' mean {statistics.mean(head):.3f}, last "
                  f"{len(tail)} steps' {statistics.mean(tail):.3f}, after {seconds[-1]:.0f} s")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
