"""The end-to-end pipeline (scripts/pipeline.sh -> tools/pipeline.py): the corpus it plants, and the reduced run of
every real tool in order, whose report must reconcile its own counts."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from corpus_layouts import read_records

from mtnlg_lightning.corpora import detect
from mtnlg_lightning.curation.shingles import ShingleSpec, jaccard_strings, shingle_strings
from mtnlg_lightning.demo.pipeline.crawl import score_extraction, score_language, score_quality
from mtnlg_lightning.demo.synthetic.planted_corpus import CorpusSpec, build_corpus, ngram_set
from mtnlg_lightning.demo.synthetic.planted_crawl import CrawlSpec, build_crawl, read_truth

REPO = Path(__file__).resolve().parents[1]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def smoke_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    return out, build_corpus(out, CorpusSpec.smoke())


def test_planted_passages_are_in_their_host_documents_and_control_passages_nowhere(smoke_corpus):
    out, summary = smoke_corpus
    docs = {d["id"]: d["text"] for d in read_jsonl(out / "raw" / "web.jsonl")}
    truth = json.loads((out / "raw" / "ground_truth.json").read_text())
    planted = [r["text"] for r in read_jsonl(out / "eval" / "planted.jsonl")]
    control = [r["text"] for r in read_jsonl(out / "eval" / "control.jsonl")]
    assert len(planted) == len(control) == 8 and summary["planted_copies"] == 8 * 4
    assert truth["planted_passages"] == planted
    for host, hits in truth["plants"].items():
        for hit in hits:
            passage = planted[hit["passage"]]
            if hit["edited"]:  # the tail (with the cloze target) is intact; the opening is not
                assert " ".join(passage.split()[-12:]) in docs[host]
            else:
                assert passage in docs[host]
    corpus_ngrams = set().union(*(ngram_set(t) for t in docs.values()))
    assert all(not ngram_set(c) & corpus_ngrams for c in control)
    evalset = read_jsonl(out / "eval" / "evalset.jsonl")
    assert [r["text"] for r in evalset] == planted + control


def test_planted_duplicates_are_exact_copies_or_above_the_dedup_threshold(smoke_corpus):
    out, summary = smoke_corpus
    docs = {d["id"]: d["text"] for d in read_jsonl(out / "raw" / "web.jsonl")}
    truth = json.loads((out / "raw" / "ground_truth.json").read_text())
    assert summary["exact_duplicates"] == 8 and summary["near_duplicates"] == 8
    spec = ShingleSpec("word", 5)
    for dup in truth["duplicates"]:
        assert dup["of"] not in truth["plants"]  # copies never multiply the planted text
        jaccard = jaccard_strings(shingle_strings(docs[dup["id"]], spec), shingle_strings(docs[dup["of"]], spec))
        assert jaccard == pytest.approx(dup["jaccard"], abs=1e-4)
        assert (docs[dup["id"]] == docs[dup["of"]]) == (dup["kind"] == "exact")
        assert jaccard > 0.8


def test_the_crawl_serves_every_corpus_document_as_one_english_page_among_foreign_junk_and_broken_records(
    smoke_corpus,
):
    out, summary = smoke_corpus
    crawl = build_crawl(out, CrawlSpec.smoke(), seed=1)
    truth = read_truth(out)
    docs = {d["id"]: d["text"] for d in read_jsonl(out / "raw" / "web.jsonl")}
    pages = {t["id"]: t for t in truth if t["kind"] == "page" and "id" in t}
    assert sorted(pages) == sorted(docs) and all(pages[i]["language"] == "en" for i in pages)
    for doc_id, text in docs.items():  # the page's body is the document's paragraphs
        assert " ".join(" ".join(pages[doc_id]["body"]).split()) == " ".join(text.split())
    kinds = Counter(t["kind"] for t in truth)
    assert kinds["junk"] == round(0.15 * len(docs)) and kinds["broken"] == 5
    assert {t["language"] for t in truth if t["kind"] == "page"} >= {"en", "de", "fr", "es"}
    assert crawl["records"] == len(truth) and (out / "raw" / "crawl.warc.gz").stat().st_size == crawl["bytes"]
    assert len(read_jsonl(out / "quality" / "train" / "positive.jsonl")) == CrawlSpec.smoke().classifier_documents


def test_crawl_scores_count_what_they_say():
    truth = [
        {"url": "p1", "kind": "page", "language": "en", "title": "T", "body": ["a b c d"], "boilerplate": "x y"},
        {"url": "p2", "kind": "page", "language": "en", "title": "T", "body": ["e f"], "boilerplate": "x y"},
        {"url": "p3", "kind": "page", "language": "de", "title": "T", "body": ["g h"], "boilerplate": "x y"},
        {"url": "j1", "kind": "junk"},
        {"url": "j2", "kind": "junk"},
    ]
    extracted = [
        {"url": "p1", "text": "T a b c x", "language": "en"},  # 3 of 4 body words, 1 boilerplate word of 2
        {"url": "p3", "text": "g h", "language": "en"},  # named wrongly
        {"url": "j1", "text": "buy", "language": "en"},
    ]
    ex = score_extraction(truth, extracted)
    assert ex["documents"] == {"precision": round(2 / 3, 4), "recall": round(2 / 3, 4), "selected": 3, "relevant": 3}
    assert ex["body_words"] == {"precision": round(5 / 6, 4), "recall": round(5 / 6, 4)}  # p1 4 words out, p3 2
    assert ex["boilerplate_words_left"] == round(1 / 4, 4)
    lang = score_language(truth, extracted, extracted)  # everything named en kept
    assert lang["english_pages"]["precision"] == 0.5 and lang["english_pages"]["recall"] == 1.0
    assert lang["identification_accuracy"] == 0.5 and lang["junk_passed"] == 1
    q = score_quality(truth, extracted, extracted[:1])
    assert q["pages_kept"]["precision"] == 1.0 and q["pages_kept"]["recall"] == 0.5
    assert q["junk_dropped"]["recall"] == 1.0 and q["junk_dropped"]["precision"] == 0.5


def test_no_crawl_starts_dedup_at_the_raw_jsonl_and_the_crawl_at_the_quality_filter(tmp_path):
    from mtnlg_lightning.demo.pipeline.run import Pipeline, PipelineSettings

    plain = Pipeline(PipelineSettings.for_run(tmp_path, smoke=True, crawl=False))
    assert plain.s.crawl is None and plain.curated == tmp_path / "raw" / "web.jsonl"
    crawled = Pipeline(PipelineSettings.for_run(tmp_path, smoke=True))
    assert crawled.s.crawl == CrawlSpec.smoke() and crawled.curated == tmp_path / "quality" / "kept" / "crawl.jsonl"
    assert (plain.zst, crawled.zst) == ("web.jsonl.zst", "crawl.jsonl.zst")


def planted_removal_check(tmp_path, docs_in, kept, duplicates):
    """The dedup check on planted text, run on hand-made dedup files (no crawl: ids are the corpus ids)."""
    from mtnlg_lightning.demo.pipeline.run import Pipeline, PipelineSettings

    pipeline = Pipeline(PipelineSettings.for_run(tmp_path, smoke=True, crawl=False))
    passages = [" ".join(f"p{k}w{i}" for i in range(20)) for k in range(2)]
    texts = {
        "host-a": f"intro one\n\n{passages[0]}",
        "host-a-near": f"intro two\n\n{passages[0]}",
        "host-b": f"other page\n\n{passages[1]}",
        "clean": " ".join(f"c{i}" for i in range(30)),
    }
    dedup = tmp_path / "dedup"
    dedup.mkdir(parents=True, exist_ok=True)
    for path, ids in ((pipeline.curated, docs_in), (dedup / pipeline.zst, kept)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"id": i, "text": texts[i]}) + "\n" for i in ids))
    lines = [json.dumps({"id": d, "duplicate_of": k}) + "\n" for d, k in duplicates]
    (dedup / "duplicates.jsonl").write_text("".join(lines))
    truth = {"planted_passages": passages, "plants": {"host-a": [], "host-a-near": [], "host-b": []}}
    pipeline.check_planted_removals(dedup, truth, set(docs_in))
    (check,) = pipeline.checks
    return check.ok, pipeline.planted_duplicates


def test_dedup_may_remove_planted_text_only_as_a_duplicate_of_a_kept_copy_of_the_same_passages(tmp_path):
    docs = ["host-a", "host-a-near", "host-b", "clean"]
    # the near copy of a host goes, its keeper holds the same passage: nothing planted leaves the corpus
    assert planted_removal_check(tmp_path / "1", docs, ["host-a", "host-b", "clean"], [("host-a-near", "host-a")]) == (
        True,
        1,
    )
    assert planted_removal_check(tmp_path / "2", docs, docs, []) == (True, 0)
    # removed as a duplicate of a document without its passage, of one not kept, or not listed as a duplicate
    assert not planted_removal_check(tmp_path / "3", docs, ["host-a", "host-a-near", "clean"], [("host-b", "clean")])[0]
    assert not planted_removal_check(tmp_path / "4", docs, ["host-b", "clean"], [("host-a-near", "host-a")])[0]
    assert not planted_removal_check(tmp_path / "5", docs, ["host-a", "host-a-near", "clean"], [])[0]


def test_a_non_empty_output_directory_is_refused_in_one_line(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "pipeline.py"), str(tmp_path), "--smoke"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--overwrite" in proc.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_reduced_pipeline_runs_every_tool_and_its_report_reconciles(tmp_path):
    out = tmp_path / "pipeline"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "pipeline.py"), str(out), "--smoke"],
        capture_output=True,
        text=True,
        timeout=1500,  # ~1.5 min alone on 2 cores; a shared machine's load stretches it several times
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    names = [s["name"] for s in report["stages"]]
    assert names == [
        "corpus",
        "crawl",
        "extract",
        "language",
        "quality-train",
        "quality-score",
        "quality",
        "dedup",
        "decontaminate",
        "tokenizer",
        "preprocess-contaminated",
        "preprocess-decontaminated",
        "train-contaminated",
        "train-decontaminated",
        "eval-contaminated-planted",
        "eval-contaminated-control",
        "eval-decontaminated-planted",
        "eval-decontaminated-control",
        "export-hf",
        "generate",
        "bias",
    ]
    # one summary line per stage on stdout, in that order
    lines = [line.split()[0] for line in proc.stdout.splitlines() if line.split() and line.split()[0] in names]
    assert lines == names
    assert report["ok"] and all(c["ok"] for c in report["checks"]) and len(report["checks"]) >= 15
    stages = {s["name"]: s for s in report["stages"]}
    # documents out of one stage = documents into the next, re-read here from the files themselves
    for stage, folder in (("extract", "extract"), ("language", "language"), ("quality", "quality/kept")):
        assert stages[stage]["documents_out"] == len(read_jsonl(out / folder / "crawl.jsonl"))
    assert stages["language"]["documents_in"] == stages["extract"]["documents_out"]
    assert stages["quality"]["documents_in"] == stages["language"]["documents_out"]
    assert stages["dedup"]["documents_in"] == stages["quality"]["documents_out"]
    # from dedup on the corpus travels as zstd JSON lines (each tool keeps its input's format)
    for stage in ("dedup", "decontaminate"):
        assert detect(str(out / stage / "crawl.jsonl.zst")).compression == "zstd"
        assert stages[stage]["documents_out"] == len(read_records(out / stage / "crawl.jsonl.zst"))
    # the crawl stages scored against the planted truth, re-derived here from the files for the language filter
    truth = read_jsonl(out / "raw" / "crawl.warc.gz.truth.jsonl")
    assert sum(t["kind"] == "page" for t in truth) > stages["corpus"]["documents_out"]  # and foreign pages
    english = {t["url"] for t in truth if t["kind"] == "page" and t["language"] == "en"}
    extracted = {d["url"] for d in read_jsonl(out / "extract" / "crawl.jsonl")}
    kept = {d["url"] for d in read_jsonl(out / "language" / "crawl.jsonl")} & {
        t["url"] for t in truth if t["kind"] == "page"
    }
    scores = report["crawl_scores"]
    assert scores["language"]["english_pages"]["precision"] == pytest.approx(len(kept & english) / len(kept), abs=1e-4)
    assert scores["language"]["english_pages"]["recall"] == pytest.approx(
        len(kept & english) / len(english & extracted), abs=1e-4
    )
    assert scores["extract"]["boilerplate_words_left"] <= 0.1 and scores["extract"]["body_words"]["precision"] >= 0.9
    assert scores["language"]["english_pages"]["recall"] >= 0.95
    assert scores["quality"]["pages_kept"]["precision"] >= 0.9 and scores["quality"]["junk_dropped"]["recall"] >= 0.9
    assert "## The crawl stages against the planted truth" in (out / "report.md").read_text()
    assert stages["decontaminate"]["documents_in"] == stages["dedup"]["documents_out"]
    assert stages["preprocess-decontaminated"]["documents_out"] == stages["decontaminate"]["documents_out"]
    assert stages["preprocess-contaminated"]["documents_out"] == stages["dedup"]["documents_out"]
    for run in ("contaminated", "decontaminated"):
        train = stages[f"train-{run}"]
        assert train["tokens"] == 20 * 8 * 64  # steps x global batch x seq_len of the tiny model
        for eval_set in ("planted", "control"):
            metrics = report["experiment"][run][eval_set]
            assert 0.0 <= metrics["acc"] <= 1.0 and metrics["perplexity"] > 1.0 and metrics["examples"] == 8
        assert len(report["experiment"][run]["loss_curve"]) == 20
    assert report["experiment"]["decontaminated"]["documents_with_planted_text"] == 0
    assert report["experiment"]["contaminated"]["documents_with_planted_text"] > 0
    assert (out / "report.md").read_text().count("PASS") == len(report["checks"])
    assert (out / "report.png").stat().st_size > 10_000
    # the bias study of B: every task's result, its tables in the report, its figure
    assert set(report["bias"]) == {"gender-occupation", "cooccurrence", "sentiment"}
    assert report["bias"]["gender-occupation"]["summary"]["occupations"] >= 300
    assert "## The bias study" in (out / "report.md").read_text() and (out / "bias.png").stat().st_size > 10_000
    assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == "gpt2"
    assert report["generation"]["text"].startswith("The file is opened")
