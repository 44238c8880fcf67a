"""The paper's evaluations on a `Scorer`: LAMBADA (zero/one/few-shot), HANS (in-context examples), perplexity.

Metric names are lm-evaluation-harness': `acc`, `perplexity`, `word_perplexity`, `byte_perplexity`,
`bits_per_byte`.

Prompts (k = number of shots; examples are drawn with a seeded generator, never the item under test):
- lambada: context = all words of the passage but the last, target = " " + last word (harness `lambada_openai`);
  k-shot prefixes k other whole passages, each followed by a blank line.
- hans: "{sentence1}\\nQuestion: {sentence2} True or False?\\nAnswer:" scored against " True" (entailment) and
  " False" (non-entailment); k-shot prefixes k answered examples, each followed by a blank line.
"""

from __future__ import annotations

import math
import random
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation.data import read_documents, read_records
from mtnlg_lightning.inference.requests import encode_pair, pair_request, rolling_requests
from mtnlg_lightning.inference.scoring import Scorer

SHOT_SEPARATOR = "\n\n"
HANS_TEMPLATE = "{sentence1}\nQuestion: {sentence2} True or False?\nAnswer:"
HANS_ANSWERS = {"entailment": " True", "non-entailment": " False"}


def pick_shots(pool: list, k: int, exclude: int | None, rng: random.Random) -> list:
    """k examples of `pool` (not pool[exclude], the item under test when the pool is the test file)."""
    candidates = [i for i in range(len(pool)) if i != exclude]
    if k > len(candidates):
        raise MTNLGError(f"{k} shots asked, but only {len(candidates)} other examples are available")
    return [pool[i] for i in rng.sample(candidates, k)]


def lambada_split(text: str) -> tuple[str, str]:
    words = text.strip().split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def lambada_prompts(docs: list[str], shots: int, fewshot: list[str] | None, seed: int) -> list[tuple[str, str]]:
    """(context, target) per passage; k-shot contexts start with k other passages."""
    rng = random.Random(seed)
    out = []
    for i, text in enumerate(docs):
        context, target = lambada_split(text)
        pool, exclude = (fewshot, None) if fewshot is not None else (docs, i)
        examples = pick_shots(pool, shots, exclude, rng) if shots else []
        out.append(("".join(e.strip() + SHOT_SEPARATOR for e in examples) + context, target))
    return out


def lambada(scorer: Scorer, tokenizer, docs: list[str], shots: int, fewshot=None, seed: int = 1234) -> dict:
    prompts = lambada_prompts(docs, shots, fewshot, seed)
    requests = [pair_request(*encode_pair(tokenizer, c, t), scorer.max_len) for c, t in prompts]
    scores = scorer.score(requests, desc=f"lambada {shots}-shot")
    loglik = sum(s for s, _ in scores) / len(scores)
    return {"acc": sum(g for _, g in scores) / len(scores), "perplexity": math.exp(-loglik), "examples": len(docs)}


def hans_prompt(record: dict) -> str:
    return HANS_TEMPLATE.format(sentence1=record["sentence1"].strip(), sentence2=record["sentence2"].strip())


def hans_prompts(records: list[dict], shots: int, fewshot: list[dict] | None, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i, record in enumerate(records):
        pool, exclude = (fewshot, None) if fewshot is not None else (records, i)
        examples = pick_shots(pool, shots, exclude, rng) if shots else []
        prefix = "".join(hans_prompt(e) + HANS_ANSWERS[e["gold_label"]] + SHOT_SEPARATOR for e in examples)
        out.append(prefix + hans_prompt(record))
    return out


def check_hans(records: list[dict], path) -> None:
    for number, record in enumerate(records, start=1):
        if record.get("gold_label") not in HANS_ANSWERS:
            raise MTNLGError(
                f"{path}: record {number}: gold_label {record.get('gold_label')!r} is not one of "
                f"{', '.join(HANS_ANSWERS)}"
            )


def hans(scorer: Scorer, tokenizer, records: list[dict], shots: int, fewshot=None, seed: int = 1234) -> dict:
    """Accuracy of the likelier answer, overall and per heuristic (lexical_overlap, subsequence, constituent)."""
    prompts = hans_prompts(records, shots, fewshot, seed)
    answers = list(HANS_ANSWERS.values())
    pairs = [encode_pair(tokenizer, prompt, answer) for prompt in prompts for answer in answers]
    requests = [pair_request(context, answer, scorer.max_len) for context, answer in pairs]
    scores = scorer.score(requests, desc=f"hans {shots}-shot")
    per_heuristic: dict[str, list[bool]] = defaultdict(list)
    for i, record in enumerate(records):
        pair = scores[i * len(answers) : (i + 1) * len(answers)]
        chosen = max(range(len(answers)), key=lambda j: pair[j][0])
        per_heuristic[record.get("heuristic", "all")].append(answers[chosen] == HANS_ANSWERS[record["gold_label"]])
    correct = [c for cs in per_heuristic.values() for c in cs]
    result = {"acc": sum(correct) / len(correct), "examples": len(records)}
    for name, cs in sorted(per_heuristic.items()):
        result[f"acc_{name}"] = sum(cs) / len(cs)
    return result


def rolling_loglik(scorer: Scorer, token_docs: list[list[int]], prefix: int | None, stride: int | None = None):
    """(total log-likelihood, tokens scored) of every token of every token list, in rolling windows."""
    windows = [r for tokens in token_docs for r in rolling_requests(tokens, prefix, scorer.max_len, stride)]
    scores = scorer.score(windows, desc="perplexity")
    return sum(s for s, _ in scores), sum(len(r.targets) for r in windows)


def perplexity(scorer: Scorer, tokenizer, docs: list[str], stride: int | None = None) -> dict:
    """Rolling log-likelihood of every token of every document (the first predicted from <|endoftext|>, as the
    harness): token-level loss and perplexity, and the harness' word/byte perplexity and bits per byte."""
    loglik, tokens = rolling_loglik(scorer, [tokenizer.encode(d) for d in docs], tokenizer.eod_id, stride)
    words = sum(len(re.split(r"\s+", d)) for d in docs)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    return {
        "loss": -loglik / tokens,
        "perplexity": math.exp(-loglik / tokens),
        "word_perplexity": math.exp(-loglik / words),
        "byte_perplexity": math.exp(-loglik / nbytes),
        "bits_per_byte": -loglik / nbytes / math.log(2),
        "tokens": tokens,
        "documents": len(docs),
    }


# ------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Task:
    """A task of `mtnlg-eval --task` and `DownstreamEval`: the JSONL fields of its file (none: documents, a text
    file or JSONL {text}), how one setting is scored, the check its records must pass, and the names its metrics
    are logged under during training (a `_{k}shot` suffix is added for k > 0)."""

    fields: tuple[str, ...]
    evaluate: Callable  # (scorer, tokenizer, items, shots, fewshot items, seed, stride) -> metrics
    logged: Callable[[dict], dict[str, float]]
    check: Callable[[list[dict], str], None] | None = None


def _lambada(scorer, tokenizer, records, shots, fewshot, seed, stride) -> dict:
    pool = [r["text"] for r in fewshot] if fewshot is not None else None
    return lambada(scorer, tokenizer, [r["text"] for r in records], shots, pool, seed)


def _hans(scorer, tokenizer, records, shots, fewshot, seed, stride) -> dict:
    return hans(scorer, tokenizer, records, shots, fewshot, seed)


def _perplexity(scorer, tokenizer, docs, shots, fewshot, seed, stride) -> dict:
    return perplexity(scorer, tokenizer, docs, stride)


TASKS = {
    "lambada": Task(("text",), _lambada, lambda m: {"lambada_acc": m["acc"], "lambada_ppl": m["perplexity"]}),
    "hans": Task(
        ("sentence1", "sentence2", "gold_label"),
        _hans,
        lambda m: {f"hans_{name}": v for name, v in m.items() if name.startswith("acc")},
        check_hans,
    ),
    "perplexity": Task((), _perplexity, lambda m: {"perplexity_loss": m["loss"], "perplexity_ppl": m["perplexity"]}),
}


def check_task(name: str) -> Task:
    if name not in TASKS:
        raise MTNLGError(f"unknown task {name!r}; the known tasks are {', '.join(TASKS)}")
    return TASKS[name]


def run_task(
    name: str,
    scorer: Scorer,
    tokenizer,
    data: str,
    shots: list[int] = (0,),
    fewshot_data: str | None = None,
    seed: int = 1234,
    limit: int | None = None,
    stride: int | None = None,
) -> dict:
    """The task's metrics per setting: {k: metrics} per number of shots, or {"-": metrics} for documents."""
    task = check_task(name)
    if not task.fields:
        return {"-": task.evaluate(scorer, tokenizer, read_documents(data)[:limit], 0, None, seed, stride)}
    records = read_records(data, task.fields)[:limit]
    fewshot = read_records(fewshot_data, task.fields) if fewshot_data else None
    if task.check is not None:
        task.check(records, data)
        if fewshot is not None:
            task.check(fewshot, fewshot_data)
    return {k: task.evaluate(scorer, tokenizer, records, k, fewshot, seed, stride) for k in shots}


def logged_metrics(name: str, results: dict) -> dict[str, float]:
    """`run_task`'s results as the metrics `DownstreamEval` logs (e.g. lambada_acc, lambada_ppl_1shot)."""
    out = {}
    for setting, metrics in results.items():
        suffix = f"_{setting}shot" if setting not in ("-", 0) else ""
        out |= {key + suffix: value for key, value in TASKS[name].logged(metrics).items()}
    return out
