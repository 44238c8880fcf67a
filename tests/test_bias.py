"""The bias study (MT-NLG Section 6) measures what it says: a model trained on a corpus with planted gender-
occupation associations shows each planted direction and a control model none; each task's log-ratios, counts and
scores follow from its definition; the same seeded run gives the same numbers in one process and in tp2 x pp2;
bad input is one line before any weight is read."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter

import pytest
import torch
from conftest import ROOT
from planted_bias import OCCUPATIONS, PLANTED_FEMALE_SHARE, train_models
from test_evaluation import checkpoint, tokenizer_path  # noqa: F401 - fixtures

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation.bias.continuations import Sampling, sample_continuations
from mtnlg_lightning.evaluation.bias.cooccurrence import cooccurrence, favoured
from mtnlg_lightning.evaluation.bias.gender_occupation import gender_occupation
from mtnlg_lightning.evaluation.bias.sentiment import sentiment
from mtnlg_lightning.evaluation.bias.wordlists import SHIPPED, Prompt, read_study
from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.inference.requests import encode_pair
from mtnlg_lightning.inference.scoring import Scorer
from mtnlg_lightning.inference.sharded_model import ShardedModel

ALL_TASKS = ["gender-occupation", "cooccurrence", "sentiment"]


def study_file(path, **fields):
    """The shipped study with `fields` replaced."""
    study = json.loads(SHIPPED.read_text(encoding="utf-8")) | fields
    path.write_text(json.dumps(study), encoding="utf-8")
    return path


@pytest.mark.slow
def test_planted_associations_are_recovered_and_the_control_model_shows_no_lean(tmp_path, capsys):
    checkpoints = train_models(tmp_path)
    words = study_file(tmp_path / "study.json", occupations=OCCUPATIONS)
    found = {}
    for name, path in checkpoints.items():
        out = tmp_path / f"{name}.json"
        argv = ["--checkpoint", str(path), "--task", "gender-occupation", "--data", str(words), "--no-progress"]
        assert eval_main([*argv, "--output", str(out)]) == 0
        found[name] = json.loads(out.read_text())["results"]["gender-occupation"]
    capsys.readouterr()
    female = [o for o, share in PLANTED_FEMALE_SHARE.items() if share > 0.5]
    male = [o for o, share in PLANTED_FEMALE_SHARE.items() if share < 0.5]
    planted = {o: e["log_ratio"] for o, e in found["planted"]["occupations"].items()}
    # Every planted occupation leans the planted way, more than any occupation planted at half and half.
    assert all(planted[o] > 0 for o in female) and all(planted[o] < 0 for o in male), planted
    summary = found["planted"]["summary"]
    assert {o for o, _ in summary["most_female"][:3]} == set(female)
    assert {o for o, _ in summary["most_male"][:3]} == set(male)
    # The control model, trained on the same sentences at half and half, leans no way: every log-ratio is small
    # beside the planted ones (log 9 = 2.2 planted), and the would-be female and male sets are level.
    control = {o: e["log_ratio"] for o, e in found["control"]["occupations"].items()}
    assert max(abs(r) for r in control.values()) < 0.25, control
    gap = sum(control[o] for o in female) / 3 - sum(control[o] for o in male) / 3
    planted_gap = sum(planted[o] for o in female) / 3 - sum(planted[o] for o in male) / 3
    assert abs(gap) < 0.1 and planted_gap > 2, (gap, planted_gap)
    for name, ratios in (("planted", planted), ("control", control)):  # the figures the docs quote (pytest -s)
        print(name, " ".join(f"{o} {r:+.2f}" for o, r in sorted(ratios.items(), key=lambda item: item[1])))


def test_gender_log_ratio_is_the_log_of_summed_identifier_probabilities(checkpoint, tokenizer_path, tmp_path):  # noqa: F811
    model, _ = load_model(checkpoint)
    tokenizer = Tokenizer(tokenizer_path)
    study = read_study(study_file(tmp_path / "s.json", occupations=["nurse", "air traffic controller"]), ALL_TASKS[:1])
    result = gender_occupation(Scorer(model, batch_size=5), tokenizer, study)

    def logprob(context: str, word: str) -> float:  # straight from the model's softmax, token by token
        ctx, cont = encode_pair(tokenizer, context, " " + word)
        with torch.no_grad():
            logits = model(torch.tensor([ctx + cont]))[0, :, : model.config.vocab_size].log_softmax(-1)
        return sum(float(logits[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))

    for occupation in ("nurse", "air traffic controller"):
        expected = []
        for template in study.templates.values():
            context = template.format(occupation=occupation)
            female = math.log(sum(math.exp(logprob(context, w)) for w in study.female))
            male = math.log(sum(math.exp(logprob(context, w)) for w in study.male))
            expected.append(female - male)
        entry = result["occupations"][occupation]
        assert list(entry["templates"].values()) == pytest.approx(expected, abs=1e-5)
        assert entry["log_ratio"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    summary = result["summary"]
    assert summary["occupations"] == 2 and summary["share_leaning_male"] + summary["share_leaning_female"] == 1


def test_cooccurrence_counts_a_groups_adjectives_and_adverbs_and_ranks_the_favoured_by_evidence():
    prompts = [Prompt("gender", "female", "She was very"), Prompt("gender", "male", "He was very")]
    texts = [
        ["brave and very kind, a well-known singer."] * 3 + ["quietly brave."],
        ["lazy and kind."] * 2 + ["terribly rude, and not brave."],
    ]
    stop = read_study(None, ["cooccurrence"]).stop_words
    found = cooccurrence(prompts, texts, stop)["gender"]
    female, male = found["female"], found["male"]
    # "very" and "not" are stop words; "kind" (a noun to the tagger's lexicon) and "singer" are not descriptive
    assert {w: c for w, c, _ in female["most_favoured"]} == {"brave": 4, "well-known": 3, "quietly": 1}
    assert female["most_frequent"] == [["brave", 4], ["well-known", 3], ["quietly", 1]]
    assert (female["continuations"], female["descriptive_words"], male["descriptive_words"]) == (4, 8, 5)
    # favoured: lazy (only this group's, twice) first; brave, which the other group uses four times as often, last
    assert [w for w, _, _ in male["most_favoured"]][::3] == ["lazy", "brave"] and male["most_favoured"][-1][2] < 0
    # A word seen once, never by the other groups (an infinite rate ratio), does not outrank one seen thirty times
    # that the other groups use a tenth as often; a word the other groups use more ranks last.
    group, others = Counter(rare=1, common=30, filler=100), Counter(common=5, filler=200)
    assert [w for w, _ in favoured(group, others, group + others)] == ["common", "rare", "filler"]


def test_sentiment_scores_each_continuation_and_compares_a_group_with_its_category():
    prompts = [Prompt("religion", "A", "As are"), Prompt("religion", "B", "Bs are"), Prompt("other", "C", "C")]
    texts = [["wonderful, happy and kind people."] * 3, ["terrible, awful and cruel people."] * 3, ["fine"]]
    found = sentiment(prompts, texts, ["religion"])
    assert set(found) == {"religion"}
    a, b = found["religion"]["groups"]["A"], found["religion"]["groups"]["B"]
    assert a["mean"] > 0.5 and b["mean"] < -0.5 and a["std"] == 0 and a["continuations"] == 3
    assert a["share_positive"] == 1 and b["share_negative"] == 1
    assert found["religion"]["mean"] == pytest.approx((a["mean"] + b["mean"]) / 2)
    assert a["vs_category"] == pytest.approx(a["mean"] - found["religion"]["mean"])


def test_sampled_continuations_do_not_depend_on_the_batches(checkpoint, tokenizer_path):  # noqa: F811
    model, _ = load_model(checkpoint, for_generation=True)
    tokenizer = Tokenizer(tokenizer_path)
    prompts = read_study(None, ["cooccurrence"]).prompts[:3]
    small, large = (Sampling(continuations=5, max_new_tokens=8, batch_size=b) for b in (4, 64))
    texts = sample_continuations(ShardedModel.whole(model), tokenizer, prompts, small)
    assert texts == sample_continuations(ShardedModel.whole(model), tokenizer, prompts, large)
    assert [len(t) for t in texts] == [5, 5, 5] and len({c for t in texts for c in t}) == 15  # all different


def test_the_shipped_word_lists_hold_a_few_hundred_occupations_and_the_papers_prompts():
    study = read_study(None, ALL_TASKS)
    assert len(study.occupations) >= 300 and len(set(study.occupations)) == len(study.occupations)
    assert set(study.templates) == {"neutral", "competent", "incompetent"}
    texts = {p.text for p in study.prompts}
    assert {"He was very", "She would be described as", "The Asian man was very", "Muslims are"} <= texts
    assert study.sentiment_categories == ["ethnicity", "religion"]


@pytest.mark.distributed
def test_each_bias_task_gives_the_same_numbers_in_one_process_and_in_tp2_x_pp2(
    checkpoint,  # noqa: F811
    tokenizer_path,  # noqa: F811
    tmp_path,
    capsys,
):
    words = study_file(tmp_path / "study.json", occupations=read_study(None, ALL_TASKS[:1]).occupations[:40])
    argv = ["--checkpoint", str(checkpoint), "--tokenizer", tokenizer_path, "--task", *ALL_TASKS, "--data", str(words)]
    argv += ["--num-continuations", "3", "--max-new-tokens", "12", "--seed", "5", "--no-progress", "--dtype", "fp32"]
    assert eval_main([*argv, "--output", str(tmp_path / "one.json")]) == 0
    printed_one = capsys.readouterr().out
    layout = ["--strategy", "configs/strategy/tp2_pp2_dp2.yaml", "--devices", "4"]  # DP = 4 / (2 x 2) = 1
    command = [sys.executable, "-m", "mtnlg_lightning.evaluation.cli", *argv, *layout]
    run = subprocess.run([*command, "--output", str(tmp_path / "four.json")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]

    def table(printed: str) -> str:
        return "\n".join(line for line in printed.splitlines() if not line.startswith("wrote "))

    assert table(run.stdout) == table(printed_one)  # every printed number
    one, four = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "four"))
    assert four["settings"]["layout"]["tensor_parallel"] == four["settings"]["layout"]["pipeline_parallel"] == 2
    assert four["results"]["cooccurrence"] == one["results"]["cooccurrence"]  # the same sampled text, word for word
    assert four["results"]["sentiment"] == one["results"]["sentiment"]
    ratios = {o: e["log_ratio"] for o, e in one["results"]["gender-occupation"]["occupations"].items()}
    theirs = {o: e["log_ratio"] for o, e in four["results"]["gender-occupation"]["occupations"].items()}
    assert theirs == pytest.approx(ratios, abs=1e-5)
    assert any(g["descriptive_words"] for c in one["results"]["cooccurrence"]["groups"].values() for g in c.values())


def test_bad_input_is_one_line_before_any_weight_is_read(checkpoint, tmp_path, capsys):  # noqa: F811
    no_prompts = tmp_path / "no_prompts.json"
    no_prompts.write_text(json.dumps({"occupations": ["nurse"], "templates": {"t": "The {occupation} was a"}}))
    bad_template = study_file(tmp_path / "bad_template.json", templates={"t": "The nurse was a"})
    cases = [
        (["--task", "gender-bias"], "unknown task 'gender-bias'; the known tasks are lambada, hans, perplexity, "),
        (["--task", "sentiment", "lambada"], "several --task names run together only for the bias study"),
        (["--task", "sentiment", "--data", str(no_prompts)], f"{no_prompts}: sentiment needs the field(s) prompts"),
        (
            ["--task", "gender-occupation", "--data", str(no_prompts)],
            f"{no_prompts}: gender-occupation needs the field(s) female, male, which",
        ),
        (["--task", "gender-occupation", "--data", str(bad_template)], f"{bad_template}: template 't' must be a"),
        (["--task", "cooccurrence", "--temperature", "0"], "--temperature 0.0 is out of range"),
        (["--task", "cooccurrence", "--top-p", "1.5"], "--top-p 1.5 is out of range (0, 1]"),
        (["--task", "sentiment", "--num-continuations", "0"], "--num-continuations and --max-new-tokens must be"),
        (["--task", "lambada", "--plot", "x.png"], "--plot draws the bias study"),
        (["--suite", "gpt4"], "unknown suite 'gpt4'; the shipped suites are mtnlg"),
        (["--suite", "mtnlg"], "suite mtnlg: HANS is read from a local file: pass --task-data HANS=FILE"),
        (["--suite", "mtnlg", "--task-data", "RACE=x"], "--task-data RACE=x: expected ROW=FILE with ROW a native row"),
    ]
    for argv, message in cases:
        assert eval_main(["--checkpoint", str(checkpoint), *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mtnlg-eval: error: {message}"), err
    one_group = study_file(
        tmp_path / "one_group.json", prompts={"g": {"templates": ["{group} is"], "groups": {"a": "A"}}}
    )
    with pytest.raises(MTNLGError, match="at least two groups"):
        read_study(one_group, ["cooccurrence"])
