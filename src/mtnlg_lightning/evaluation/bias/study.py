"""The bias study as `mtnlg-eval` tasks, in any layout: `--task gender-occupation cooccurrence sentiment`.

gender-occupation is scored with the `Scorer` (every rank gets every score); cooccurrence and sentiment read the same
sampled continuations (sampled once when both run), which every rank gets from the decoding loop; rank 0 tags, scores
and reports. Everything that needs no weights (the word lists, the sampling settings, the extras) is checked first.
"""

from __future__ import annotations

from mtnlg_lightning.config import fields_from
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation.bias.continuations import Sampling, sample_continuations
from mtnlg_lightning.evaluation.bias.cooccurrence import cooccurrence
from mtnlg_lightning.evaluation.bias.gender_occupation import gender_occupation
from mtnlg_lightning.evaluation.bias.sentiment import sentiment
from mtnlg_lightning.evaluation.bias.wordlists import Study, read_study
from mtnlg_lightning.extras import require_extra

BIAS_TASKS = ("gender-occupation", "cooccurrence", "sentiment")
SAMPLED = ("cooccurrence", "sentiment")


def sampling_of(args) -> Sampling:
    return fields_from(Sampling, args, continuations=args.num_continuations)


def check_study(args, tasks: list[str]) -> Study:
    """The study's word lists for `tasks`, the sampling settings and the extras, checked (one line each)."""
    unknown = [t for t in tasks if t not in BIAS_TASKS]
    if unknown:
        raise MTNLGError(
            f"several --task names run together only for the bias study ({', '.join(BIAS_TASKS)}); "
            f"{', '.join(unknown)} takes its own run"
        )
    if any(t in SAMPLED for t in tasks):
        sampling_of(args).check()
        require_extra("bias", f"--task {' '.join(t for t in tasks if t in SAMPLED)}")
    if args.plot:
        require_extra("plot", "--plot")
    return read_study(args.data, tasks)


def run_study(args, model, tokenizer, scorer, tasks: list[str]) -> dict:
    """{task: result} on rank 0 (the other ranks take part in scoring and sampling and return {})."""
    study = read_study(args.data, tasks)
    results: dict[str, dict] = {}
    if "gender-occupation" in tasks:
        results["gender-occupation"] = gender_occupation(scorer, tokenizer, study)
    sampled = [t for t in tasks if t in SAMPLED]
    if sampled:
        sampling = sampling_of(args)
        wanted = study.sentiment_categories if sampled == ["sentiment"] else None
        prompts = [p for p in study.prompts if wanted is None or p.category in wanted]
        texts = sample_continuations(model, tokenizer, prompts, sampling, progress=not args.no_progress)
        if model.groups.rank != 0:
            return {}
        examples = {f"{p.category}/{p.group}: {p.text}": samples[:3] for p, samples in zip(prompts, texts, strict=True)}
        if "cooccurrence" in tasks:
            groups = cooccurrence(prompts, texts, study.stop_words)
            results["cooccurrence"] = {"sampling": sampling.describe(), "groups": groups, "examples": examples}
        if "sentiment" in tasks:
            categories = sentiment(prompts, texts, study.sentiment_categories)
            results["sentiment"] = {"sampling": sampling.describe(), "categories": categories}
    return results if model.groups.rank == 0 else {}
