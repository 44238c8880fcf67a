"""Evaluation agrees with the tool the field trusts: LAMBADA through `mtnlg-eval`, through our lm-eval adapter and
through `lm_eval --model hf` on the exported model give the same numbers; perplexity equals the trainer's val_loss on
the same tokens; few-shot prompts never leak the passage under test; HANS per heuristic; bad input is one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import ROOT, run_cli
from tiny_runs import cloze_file, downstream_eval_arg, tiny_fit_args, tiny_run
from tiny_runs import tiny_checkpoint as trained_tiny_checkpoint

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.inference.scoring import Scorer
from mtnlg_lightning.interop.export_cli import main as export_main

HANS = ROOT / "tests" / "data" / "hans_sample.jsonl"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer_path():
    return build_demo_data(progress=False)[1]


@pytest.fixture(scope="module")
def cloze(tmp_path_factory):
    return cloze_file(tmp_path_factory)


def harness_task_dir(directory, data):
    """The local lm-eval task of ../shared/design/interop_and_eval.md (lambada_openai's definitions)."""
    directory.mkdir(exist_ok=True)
    (directory / "cloze_lambada.yaml").write_text(
        "task: cloze_lambada\n"
        "dataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {data}}}}}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
        "metric_list:\n"
        "  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
    )
    return directory


@pytest.mark.slow
def test_lambada_equals_lm_eval_hf_on_the_exported_model_and_our_harness_adapter(
    checkpoint, tokenizer_path, cloze, tmp_path, capsys
):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    exported, task_dir = tmp_path / "hf", harness_task_dir(tmp_path / "tasks", cloze)
    assert export_main([str(checkpoint), str(exported), "--tokenizer", tokenizer_path]) == 0
    base = ["--checkpoint", str(checkpoint), "--tokenizer", tokenizer_path, "--no-progress", "--dtype", "fp32"]
    assert eval_main([*base, "--task", "lambada", "--data", str(cloze), "--output", str(tmp_path / "r.json")]) == 0
    ours = json.loads((tmp_path / "r.json").read_text())["results"]["lambada"]["0"]
    assert 0 < ours["acc"] < 1  # a non-trivial accuracy, so equality below means something
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={exported},dtype=float32",
        tasks=["cloze_lambada"],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=8,
        device="cpu",
    )["results"]["cloze_lambada"]
    assert ours["acc"] == theirs["acc,none"]
    assert ours["perplexity"] == pytest.approx(theirs["perplexity,none"], rel=1e-4)
    # The adapter runs the same harness task on the project checkpoint, without exporting.
    argv = [*base, "--harness-tasks", "cloze_lambada", "--include-path", str(task_dir), "--output", str(tmp_path / "h")]
    assert eval_main(argv) == 0
    adapter = json.loads((tmp_path / "h").read_text())["results"]["cloze_lambada"]["-"]
    assert adapter["acc"] == theirs["acc,none"]
    assert adapter["perplexity"] == pytest.approx(theirs["perplexity,none"], rel=1e-4)
    capsys.readouterr()


def test_shots_0_1_3_are_printed_and_written(checkpoint, tokenizer_path, cloze, tmp_path, capsys):
    out = tmp_path / "shots.json"
    argv = ["--checkpoint", str(checkpoint), "--tokenizer", tokenizer_path, "--task", "lambada", "--data", str(cloze)]
    assert eval_main([*argv, "--shots", "0", "1", "3", "--limit", "10", "--no-progress", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    for k in (0, 1, 3):
        assert f"lambada {k}-shot" in printed
    results = json.loads(out.read_text())
    assert sorted(results["results"]["lambada"]) == ["0", "1", "3"]
    assert results["settings"]["shots"] == [0, 1, 3] and results["settings"]["seed"] == 1234


def test_k_shot_prompt_never_contains_its_own_passage_and_is_seeded():
    docs = [f"passage number {i} ends with word{i}" for i in range(6)]
    prompts = tasks.lambada_prompts(docs, 5, None, seed=7)  # 5 shots of 6 passages: all the others, always
    for i, (context, target) in enumerate(prompts):
        assert target == f" word{i}"
        shots = context.split(tasks.SHOT_SEPARATOR)
        assert len(shots) == 6 and shots[-1] == f"passage number {i} ends with"
        assert docs[i] not in shots[:-1] and sorted(shots[:-1]) == sorted(d for j, d in enumerate(docs) if j != i)
    assert tasks.lambada_prompts(docs, 2, None, seed=7) == tasks.lambada_prompts(docs, 2, None, seed=7)
    with pytest.raises(MTNLGError, match="^6 shots asked, but only 5 other examples are available$"):
        tasks.lambada_prompts(docs, 6, None, seed=7)


def test_hans_reports_accuracy_per_heuristic_and_shots_prepend_answered_examples(checkpoint, tokenizer_path):
    from mtnlg_lightning.evaluation.data import read_jsonl

    records = read_jsonl(HANS, ("sentence1", "sentence2", "gold_label"))
    zero, two = tasks.hans_prompts(records, 0, None, 1), tasks.hans_prompts(records, 2, None, 1)
    assert zero[0] == "The doctor saw the lawyer.\nQuestion: The lawyer saw the doctor. True or False?\nAnswer:"
    examples = two[0].split(tasks.SHOT_SEPARATOR)
    assert len(examples) == 3 and examples[-1] == zero[0]
    assert all(e.endswith(("Answer: True", "Answer: False")) and e not in zero[0] for e in examples[:2])
    model, _ = load_model(checkpoint)
    result = tasks.hans(Scorer(model), Tokenizer(tokenizer_path), records, 2)
    assert set(result) == {"acc", "examples", "acc_constituent", "acc_lexical_overlap", "acc_subsequence"}
    assert result["acc"] == pytest.approx(
        sum(result[f"acc_{h}"] for h in ("constituent", "lexical_overlap", "subsequence")) / 3
    )  # 4 examples per heuristic


def test_perplexity_token_loss_equals_the_trainers_val_loss_on_the_same_tokens(checkpoint, tmp_path):
    import csv

    from mtnlg_lightning.data.datamodule import GPTDataModule
    from mtnlg_lightning.train.module import MTNLGModule

    out = run_cli(
        "validate",
        "--config",
        "configs/tiny.yaml",
        "--ckpt_path",
        str(checkpoint),
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (metrics,) = tmp_path.rglob("metrics.csv")
    val_loss = float(next(r for r in csv.DictReader(metrics.open()) if r.get("val_loss"))["val_loss"])
    # The same samples the trainer validated on: tiny.yaml's 2 batches of 8 from the start of the valid split.
    module = MTNLGModule(preset="tiny", global_batch_size=8)
    data = GPTDataModule(builtin_corpus="python-docs", seed=1234)
    data.trainer = SimpleNamespace(lightning_module=module, max_steps=10, strategy=None, global_rank=0, world_size=1)
    data.setup("validate")
    samples = [data.blends["valid"][i].tolist() for i in range(16)]
    model, _ = load_model(checkpoint)
    loglik, tokens = tasks.rolling_loglik(Scorer(model, batch_size=4), samples, prefix=None)
    assert tokens == 16 * 64
    assert -loglik / tokens == pytest.approx(val_loss, rel=1e-4)


def test_perplexity_cli_reports_token_word_and_byte_metrics(checkpoint, tokenizer_path, tmp_path, capsys):
    text = tmp_path / "valid.txt"
    text.write_text("\n\n".join(json.loads(line)["sentence1"] for line in open(HANS)) + "\nThe end of the file.\n")
    out = tmp_path / "ppl.json"
    argv = ["--checkpoint", str(checkpoint), "--tokenizer", tokenizer_path, "--task", "perplexity"]
    assert eval_main([*argv, "--data", str(text), "--stride", "32", "--no-progress", "--output", str(out)]) == 0
    found = json.loads(out.read_text())["results"]["perplexity"]["-"]
    assert found["tokens"] == len(Tokenizer(tokenizer_path).encode(text.read_text()))
    assert found["perplexity"] > 1 and found["word_perplexity"] > found["perplexity"]  # several tokens per word
    capsys.readouterr()


def test_bad_input_is_one_line(checkpoint, tokenizer_path, tmp_path, capsys):
    base = ["--checkpoint", str(checkpoint), "--tokenizer", tokenizer_path]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine passage here"}\n{"text": broken\n')
    cases = [
        (["--task", "lambada", "--data", str(bad)], f"{bad}:2: not valid JSON"),
        (["--task", "squad", "--data", str(bad)], "unknown task 'squad'; the known tasks are lambada, hans"),
        (["--task", "hans", "--data", str(HANS), "--shots", "12"], "12 shots asked, but only 11 other examples"),
    ]
    for argv, message in cases:
        assert eval_main([*base, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mtnlg-eval: error: {message}"), err


@pytest.mark.distributed
def test_downstream_eval_callback_logs_equal_values_under_tp2_pp2_dp2_and_in_one_process_within_its_memory(
    cloze, tokenizer_path, tmp_path, tmp_path_factory
):
    import csv

    # One process with the callback here; the 8-rank run with the same callback is the session's (tiny_runs.py).
    single = tmp_path / "single"
    out = run_cli(*tiny_fit_args(single), downstream_eval_arg(cloze, tokenizer_path))
    assert out.returncode == 0, out.stderr[-3000:]
    parallel = tiny_run(tmp_path_factory, "tp2xpp2xdp2")

    def logged(run):
        rows = csv.DictReader(next(run.rglob("metrics.csv")).open())
        found = [r for r in rows if r.get("lambada_acc")]
        return [(int(r["step"]), float(r["lambada_acc"]), float(r["lambada_ppl"])) for r in found]

    single_logged, parallel_logged = logged(single), logged(parallel)
    assert len({round(p, 3) for _, _, p in single_logged}) == 2  # two evaluations: after optimizer steps 2 and 4
    assert [(s, a) for s, a, _ in parallel_logged] == [(s, a) for s, a, _ in single_logged]
    assert [p for _, _, p in parallel_logged] == pytest.approx([p for _, _, p in single_logged], rel=1e-5)
    # Scored in the layout (no rank gathers the model): the evaluation's peak memory (max over ranks) stays within
    # the training steps' peak.
    rows = list(csv.DictReader(next(parallel.rglob("metrics.csv")).open()))
    train_peak = max(float(r["peak_memory_mib"]) for r in rows if r.get("peak_memory_mib"))
    eval_peaks = [float(r["downstream_eval_peak_memory_mib"]) for r in rows if r.get("downstream_eval_peak_memory_mib")]
    assert eval_peaks and max(eval_peaks) <= 1.1 * train_peak, (eval_peaks, train_peak)


def test_hans_reads_its_own_tab_separated_release_format(tmp_path):
    from mtnlg_lightning.evaluation.data import read_records

    rows = [json.loads(line) for line in open(HANS)]
    columns = ["gold_label", "sentence1", "sentence2", "pairID", "heuristic", "subcase"]
    tsv = tmp_path / "heuristics_evaluation_set.txt"
    lines = ["\t".join(columns)] + ["\t".join(r[c] for c in columns) for r in rows]
    tsv.write_text("\n".join(lines) + "\n")
    fields = ("sentence1", "sentence2", "gold_label")
    assert [{c: r[c] for c in columns} for r in read_records(tsv, fields)] == [{c: r[c] for c in columns} for r in rows]
