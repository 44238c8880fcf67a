"""A small synthetic instruction set for the fine-tuning demo: chat examples a tiny model can learn in minutes on a
CPU, each answer a function of its question (so "before and after" shows whether fine-tuning took).

The tasks: adding two numbers below 50, reversing a word, upper-casing a word, counting the letters of a word,
naming the next letter of the alphabet. The same `seed` gives the same examples on every machine (no file, no
download); `write_instructions` writes them as OpenAI-style `messages` JSON lines, the form `--data.train` reads.
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path

from mtnlg_lightning.outputs import atomic_write, write_json_lines

WORDS = (
    "apple river stone cloud green tiger paper light music ocean bread chair plant smile table water "
    "house dream north south glass honey lemon mouse piano queen robot sugar train violin whale zebra"
).split()
SYSTEM = "You are a careful assistant. Answer with the result only."


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(50), rng.randrange(50)
    return f"What is {a} + {b}?", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the word {word}.", word[::-1]


def _upper(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Write {word} in capital letters.", word.upper()


def _length(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in {word}?", str(len(word))


def _next_letter(rng: random.Random) -> tuple[str, str]:
    letter = chr(ord("a") + rng.randrange(25))
    return f"Which letter comes after {letter}?", chr(ord(letter) + 1)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "reverse": _reverse,
    "upper": _upper,
    "length": _length,
    "next_letter": _next_letter,
}


def instruction_examples(count: int = 400, seed: int = 0, system: bool = True, tasks=None) -> list[dict]:
    """`count` chat records (`messages`: an optional system turn, a user question, the assistant's answer), the
    tasks (all, or those named in `tasks`) in turn, deterministic in `seed`."""
    rng = random.Random(seed)
    names = list(tasks or TASKS)
    records = []
    for index in range(count):
        question, answer = TASKS[names[index % len(names)]](rng)
        turns = [{"role": "system", "content": SYSTEM}] if system else []
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"messages": turns})
    return records


def answer_of(question: str) -> str | None:
    """The right answer to one of the set's questions (None for any other text): the demo's scorer."""
    text = question.strip()
    if text.startswith("What is ") and text.endswith("?") and "+" in text:
        left, right = text[len("What is ") : -1].split("+")
        return str(int(left) + int(right))
    if text.startswith("Reverse the word ") and text.endswith("."):
        return text[len("Reverse the word ") : -1][::-1]
    if text.startswith("Write ") and text.endswith(" in capital letters."):
        return text[len("Write ") : -len(" in capital letters.")].upper()
    if text.startswith("How many letters are in ") and text.endswith("?"):
        return str(len(text[len("How many letters are in ") : -1]))
    if text.startswith("Which letter comes after ") and text.endswith("?"):
        return chr(ord(text[len("Which letter comes after ") : -1]) + 1)
    return None


def prompt_records(count: int, seed: int, tasks=None) -> list[dict]:
    """The set's questions (of every task, or of those named in `tasks`) as GRPO prompts in TRL's conversational
    form: `prompt` (the system and user turns) and the `answer` column the shipped `accuracy` reward reads."""
    return [
        {"prompt": record["messages"][:-1], "answer": record["messages"][-1]["content"]}
        for record in instruction_examples(count, seed, tasks=tasks)
    ]


def write_instructions(path: str | Path, count: int = 400, seed: int = 0) -> Path:
    """The set as JSON lines at `path` (written atomically)."""
    return write_json_lines(path, instruction_examples(count, seed))


# `mtnlg-generate --chat` prints each answer of several prompts under this line
_ANSWER_HEADER = re.compile(r"^--- prompt (\d+) sample 1 ---$", re.MULTILINE)


def write_demo_files(directory: str | Path, train: int = 2000, questions: int = 100) -> dict[str, Path]:
    """The fine-tuning demo's files: training and validation records, and held-out questions one a line (drawn with
    another seed; the word tasks share their 32 words with training, the sums mostly not)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    held_out = [r["messages"][-2]["content"] for r in instruction_examples(questions, seed=2)]
    paths = {
        "train": write_instructions(directory / "train.jsonl", train, seed=0),
        "valid": write_instructions(directory / "valid.jsonl", 128, seed=1),
        "questions": directory / "questions.txt",
    }
    with atomic_write(paths["questions"], "w") as handle:
        handle.write("\n".join(held_out) + "\n")
    return paths


def read_answers(text: str, count: int) -> list[str]:
    """The answers of `mtnlg-generate --chat` to `count` prompts, from its output."""
    parts = _ANSWER_HEADER.split(text)
    answers = {int(parts[i]): parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}
    return [answers.get(n + 1, "") for n in range(count)]


def score(questions: list[str], runs: dict[str, list[str]], shown: int = 10) -> str:
    """A table of the first `shown` questions with each run's answer and the right one, and each run's accuracy."""
    names = list(runs)
    lines = [" | ".join(["question", *names, "right answer"]), " | ".join(["---"] * (len(names) + 2))]
    for n, question in enumerate(questions[:shown]):
        cells = [runs[name][n].replace("\n", " ")[:28] or "(nothing)" for name in names]
        lines.append(" | ".join([question, *cells, answer_of(question) or "?"]))
    lines.append("")
    for name in names:
        right = sum(answer.strip() == answer_of(q) for q, answer in zip(questions, runs[name], strict=True))
        lines.append(f"{name}: {right} of {len(questions)} right ({100 * right / len(questions):.0f}%)")
    return "\n".join(lines)


def reward_curve(run_directory: str | Path, window: int = 5) -> str:
    """The mean reward of each step of the newest GRPO run under `run_directory` (its CSV metrics), and the mean of
    the first and last `window` steps."""
    found = sorted(Path(run_directory).rglob("metrics.csv"), key=lambda path: path.stat().st_mtime)
    if not found:
        raise SystemExit(f"no metrics.csv under {run_directory}: run the GRPO demo first")
    with open(found[-1], encoding="utf-8") as handle:
        rewards = [float(row["reward"]) for row in csv.DictReader(handle) if row.get("reward")]
    if not rewards:
        raise SystemExit(f"{found[-1]} logs no reward")
    steps = " ".join(f"{value:.2f}" for value in rewards)
    first, last = sum(rewards[:window]) / len(rewards[:window]), sum(rewards[-window:]) / len(rewards[-window:])
    return f"reward by step: {steps}\nfirst {window} steps {first:.3f} -> last {window} steps {last:.3f} ({found[-1]})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mtnlg_lightning.demo.synthetic.instructions",
        description="The synthetic instruction set of the fine-tuning and GRPO demos (scripts/finetune_demo.sh, "
        "scripts/grpo_demo.sh): write its files or the GRPO prompts, score the answers mtnlg-generate --chat gave to "
        "its held-out questions, or print a GRPO run's reward curve.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write train.jsonl, valid.jsonl and questions.txt into DIR")
    write.add_argument("directory", help="the folder to write into (created if missing)")
    write.add_argument("--train", type=int, default=2000, help="training records")
    write.add_argument("--questions", type=int, default=100, help="held-out questions")
    prompts = commands.add_parser(
        "prompts", help="write the GRPO demo's prompts.jsonl and valid_prompts.jsonl into DIR"
    )
    prompts.add_argument("directory", help="the folder to write into (created if missing)")
    prompts.add_argument("--count", type=int, default=512, help="training prompts (seed 3: not the SFT set's)")
    prompts.add_argument(
        "--tasks", nargs="+", choices=list(TASKS), default=None, help="only these tasks' questions (default: all)"
    )
    curve = commands.add_parser("curve", help="the reward of each step of the newest GRPO run under DIR")
    curve.add_argument("directory", help="the run's folder (e.g. runs/grpo_demo)")
    scorer = commands.add_parser("score", help="a before/after table and each run's accuracy")
    scorer.add_argument("questions", help="questions.txt, one question a line")
    scorer.add_argument("answers", nargs="+", metavar="NAME=FILE", help="a run's name and its mtnlg-generate output")
    args = parser.parse_args(argv)
    if args.command == "write":
        paths = write_demo_files(args.directory, args.train, args.questions)
        counts = {"train": args.train, "valid": 128, "questions": args.questions}
        print("wrote " + ", ".join(f"{paths[name]} ({count})" for name, count in counts.items()))
        return 0
    if args.command == "curve":
        print(reward_curve(args.directory))
        return 0
    if args.command == "prompts":
        directory = Path(args.directory)
        train = write_json_lines(directory / "prompts.jsonl", prompt_records(args.count, seed=3, tasks=args.tasks))
        valid = write_json_lines(directory / "valid_prompts.jsonl", prompt_records(64, seed=4, tasks=args.tasks))
        print(f"wrote {train} ({args.count}), {valid} (64)")
        return 0
    questions = Path(args.questions).read_text(encoding="utf-8").splitlines()
    runs = {}
    for item in args.answers:
        name, _, path = item.partition("=")
        runs[name] = read_answers(Path(path).read_text(encoding="utf-8"), len(questions))
    print(score(questions, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
