"""From Common Crawl to training text: `mtnlg-extract` on a crawl made offline (real prose in real boilerplate, seven
other languages, junk, non-HTML payloads, broken records; the truth written beside it) and `mtnlg-quality`
(heuristic rules whose counts add up, the GPT-3 classifier separating junk from prose on held-out pages)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

for module in ("warcio", "trafilatura", "justext", "pycld2", "lxml_html_clean", "sklearn"):
    pytest.importorskip(module)

from mtnlg_lightning.crawl import extract_cli, quality_cli  # noqa: E402
from mtnlg_lightning.crawl.heuristics import measure  # noqa: E402
from mtnlg_lightning.demo.synthetic.warc import (  # noqa: E402
    CrawlSpec,
    english_paragraphs,
    junk_documents,
    score_extraction,
    write_synthetic_warc,
)

ROOT = Path(__file__).resolve().parents[1]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def crawl(tmp_path_factory):
    """The synthetic crawl and mtnlg-extract's output of it (one worker), shared by the extraction tests."""
    root = tmp_path_factory.mktemp("crawl")
    warc = root / "crawl.warc.gz"
    truth = write_synthetic_warc(warc, CrawlSpec(english_pages=40, pages_per_language=4, junk_pages=12, seed=3))
    assert extract_cli.main([str(warc), "-o", str(root / "out"), "--workers", "1", "-q"]) == 0
    return {
        "warc": warc,
        "truth": truth,
        "docs": read_jsonl(root / "out" / "crawl.jsonl"),
        "report": json.loads((root / "out" / "extract_report.json").read_text()),
        "root": root,
    }


# --- mtnlg-extract -----------------------------------------------------------------------------------------------


def test_extraction_keeps_body_drops_boilerplate_and_names_the_language(crawl):
    score = score_extraction(crawl["truth"], crawl["docs"])
    assert score["pages"] == 68  # 40 English pages, 4 in each of 7 other languages
    assert score["missing"] == []  # every good page extracted
    assert score["body_words_kept"] >= 0.90
    assert score["boilerplate_words_left"] <= 0.10
    assert score["language_accuracy"] >= 0.95, score["wrong_language"]
    for doc in crawl["docs"]:
        assert set(doc) == {"id", "url", "date", "text", "language", "language_score"}
        assert doc["id"].startswith("<urn:uuid:") and doc["date"].startswith("20") and doc["url"].startswith("https")
        assert len(doc["language"]) == 2 and 0.0 <= doc["language_score"] <= 1.0


def test_c4_policy_lines_take_the_cookie_consent_jusText_keeps(crawl, tmp_path):
    """Half the English pages carry a long consent banner that reads like prose: jusText keeps it; C4's line rule
    (on by default) removes it, and only it. (trafilatura, the default extractor, leaves the banner out itself.)"""
    justext = [str(crawl["warc"]), "--extractor", "justext", "-q"]
    assert extract_cli.main([*justext, "-o", str(tmp_path / "rule")]) == 0
    assert json.loads((tmp_path / "rule" / "extract_report.json").read_text())["policy_lines_removed"] > 0
    assert extract_cli.main([*justext, "-o", str(tmp_path / "kept"), "--keep-policy-lines"]) == 0
    kept = score_extraction(crawl["truth"], read_jsonl(tmp_path / "kept" / "crawl.jsonl"))
    assert kept["boilerplate_words_left"] > 0.10 and kept["body_words_kept"] == pytest.approx(
        score_extraction(crawl["truth"], read_jsonl(tmp_path / "rule" / "crawl.jsonl"))["body_words_kept"]
    )


def test_the_justext_extractor_meets_the_same_targets(crawl, tmp_path):
    assert extract_cli.main([str(crawl["warc"]), "-o", str(tmp_path), "--extractor", "justext", "-q"]) == 0
    score = score_extraction(crawl["truth"], read_jsonl(tmp_path / "crawl.jsonl"))
    assert score["missing"] == [] and score["language_accuracy"] >= 0.95
    assert score["body_words_kept"] >= 0.90 and score["boilerplate_words_left"] <= 0.10


def test_every_bad_record_is_counted_by_its_reason(crawl):
    report, truth = crawl["report"], crawl["truth"]
    expected = Counter(t["reason"] for t in truth if t["kind"] not in ("page", "junk"))
    assert expected == Counter(
        {"not_html": 4, "http_status_not_2xx": 2, "bad_http_headers": 1, "content_decoding": 1, "undecodable": 1}
        | {"empty_payload": 1, "unreadable_record": 1}
    )
    for reason, n in expected.items():
        assert report["outcomes"].get(reason) == n, (reason, report["outcomes"])
    # every record is accounted for once: written, dropped for a reason, or a non-page record (warcinfo)
    assert sum(report["outcomes"].values()) == report["records"] == len(truth) + 1
    assert report["outcomes"]["ok"] == report["documents"] == len(crawl["docs"])
    assert report["outcomes"]["skipped_warcinfo"] == 1
    junk = {t["url"] for t in truth if t["kind"] == "junk"}
    extracted_junk = sum(d["url"] in junk for d in crawl["docs"])
    # junk pages: no main text (every paragraph boilerplate to jusText), or extracted for the quality stage
    assert report["outcomes"].get("no_main_text", 0) + extracted_junk == len(junk)
    assert sum(report["no_main_text_languages"].values()) == report["outcomes"].get("no_main_text", 0)


def test_output_is_the_same_bytes_for_any_worker_count_via_python_m(crawl, tmp_path):
    out = tmp_path / "two"
    p = subprocess.run(
        [sys.executable, "-m", "mtnlg_lightning.crawl.extract_cli", str(crawl["warc"]), "-o", str(out), "-q"]
        + ["--workers", "2", "--languages", "en,de"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "documents" in p.stdout and "language_not_kept" in p.stdout
    one = [d for d in crawl["docs"] if d["language"] in ("en", "de")]
    assert (out / "crawl.jsonl").read_text(encoding="utf-8") == "".join(
        json.dumps(d, ensure_ascii=False) + "\n" for d in one
    )
    report = json.loads((out / "extract_report.json").read_text())
    assert report["outcomes"]["language_not_kept"] == sum(d["language"] not in ("en", "de") for d in crawl["docs"])


@pytest.mark.distributed  # a Ray instance: GCS, raylet and worker processes (~50 s on 2 busy cores)
@pytest.mark.slow
def test_the_ray_engine_writes_the_same_bytes(crawl, tmp_path):
    pytest.importorskip("ray")
    assert extract_cli.main([str(crawl["warc"]), "-o", str(tmp_path / "ray"), "--engine", "ray", "-q"]) == 0
    assert (tmp_path / "ray" / "crawl.jsonl").read_bytes() == (crawl["root"] / "out" / "crawl.jsonl").read_bytes()
    report = json.loads((tmp_path / "ray" / "extract_report.json").read_text())
    assert report["engine"] == "ray" and report["outcomes"] == crawl["report"]["outcomes"]


def test_the_synthetic_crawl_is_the_same_bytes_for_a_seed(tmp_path):
    spec = CrawlSpec(english_pages=5, pages_per_language=1, junk_pages=2, seed=7)
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        write_synthetic_warc(tmp_path / run / "c.warc.gz", spec)
    for name in ("c.warc.gz", "c.warc.gz.truth.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_plain_warc_wet_records_and_a_corrupt_stretch_in_the_middle(tmp_path):
    from warcio.warcwriter import WARCWriter

    paragraphs = [p for _, p in english_paragraphs(4)]
    buf = io.BytesIO()
    writer = WARCWriter(buf, gzip=False)
    for i, text in enumerate(paragraphs):
        record = writer.create_warc_record(
            f"https://wet.example/{i}",
            "conversion",
            payload=io.BytesIO(text.encode("utf-8")),
            warc_headers_dict={"Content-Type": "text/plain"},
        )
        writer.write_record(record)
        if i == 1:
            buf.write(b"WARC/1.0\r\nthis header never ends and its length is missing\r\n\r\ngarbage\r\n\r\n")
    path = tmp_path / "segment.warc.wet"
    path.write_bytes(buf.getvalue())
    assert extract_cli.main([str(path), "-o", str(tmp_path / "out"), "-q"]) == 0
    docs = read_jsonl(tmp_path / "out" / "segment.jsonl")
    assert [d["text"] for d in docs] == paragraphs  # the records after the corrupt stretch are read too
    assert {d["language"] for d in docs} == {"en"}
    report = json.loads((tmp_path / "out" / "extract_report.json").read_text())
    assert report["outcomes"]["unreadable_record"] == 1


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    not_warc = tmp_path / "notes.warc.gz"
    not_warc.write_text("hello\n")
    for args in ([str(tmp_path / "missing.warc.gz")], [str(not_warc)]):
        assert extract_cli.main([*args, "-o", str(tmp_path / "out"), "-q"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mtnlg-extract: error: ") and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_missing_extra_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pycld2" else real(name, *a))
    assert extract_cli.main([str(tmp_path / "x.warc.gz"), "-o", str(tmp_path / "out")]) == 2
    assert quality_cli.main(["score", str(tmp_path / "x.jsonl"), "-o", str(tmp_path / "o"), "--model", "m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("pycld2" in line and "mtnlg-lightning[crawl]" in line for line in err)


@pytest.mark.parametrize("cli", [extract_cli, quality_cli])
def test_help_documents_every_flag(cli):
    import argparse

    parsers = [cli.build_parser()]
    for action in parsers[0]._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(action.choices.values())
    for parser in parsers:
        text = parser.format_help()
        for action in parser._actions:
            assert action.help and len(action.help) > 10, (parser.prog, action.option_strings)
            for opt in action.option_strings:
                assert opt in text


# --- mtnlg-quality -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """Real prose (stdlib docstring paragraphs, three to a page) and planted junk pages of six kinds, split into
    training and held-out pages."""
    root = tmp_path_factory.mktemp("quality")
    paragraphs = [p for _, p in english_paragraphs(300)]
    prose = ["\n\n".join(paragraphs[i : i + 3]) for i in range(0, len(paragraphs) - 2, 3)]
    junk = junk_documents(120, seed=5)
    n_prose, n_junk = len(prose) * 2 // 3, len(junk) * 2 // 3
    held = [{"id": f"prose{i}", "text": t, "good": True} for i, t in enumerate(prose[n_prose:])]
    held += [{"id": f"junk{i}", "text": t, "good": False} for i, t in enumerate(junk[n_junk:])]
    return {
        "root": root,
        "positive": write_jsonl(root / "positive.jsonl", [{"text": t} for t in prose[:n_prose]]),
        "negative": write_jsonl(root / "negative.jsonl", [{"text": t} for t in junk[:n_junk]]),
        "held": write_jsonl(root / "held.jsonl", held),
    }


def precision_recall(records, kept_ids):
    tp = sum(r["good"] and r["id"] in kept_ids for r in records)
    kept = sum(r["id"] in kept_ids for r in records)
    return tp / max(1, kept), tp / max(1, sum(r["good"] for r in records))


def test_classifier_separates_junk_from_prose_on_held_out_pages(labelled, capsys):
    root = labelled["root"]
    model = str(root / "model.npz")
    args = ["train", "--positive", labelled["positive"], "--negative", labelled["negative"], "--model", model]
    assert quality_cli.main(args) == 0
    with np.load(model, allow_pickle=False) as z:  # plain arrays: loading runs no code
        assert set(z.files) == {"coef", "intercept", "config"} and z["coef"].dtype == np.float32
    assert quality_cli.main(["score", labelled["held"], "-o", str(root / "scored"), "--model", model, "-q"]) == 0
    scored = read_jsonl(root / "scored" / "held.jsonl")
    assert all(0.0 <= r["quality_score"] <= 1.0 and "good" in r for r in scored)  # fields kept, score added

    assert (
        quality_cli.main(["filter", str(root / "scored/held.jsonl"), "-o", str(root / "t"), "--threshold", "0.5"]) == 0
    )
    precision, recall = precision_recall(scored, {r["id"] for r in read_jsonl(root / "t" / "held.jsonl")})
    assert precision >= 0.9 and recall >= 0.9, (precision, recall)

    # GPT-3's Pareto rule, seeded: the same documents kept on every run; junk (score near 0) almost never kept
    pareto = ["filter", str(root / "scored/held.jsonl"), "--pareto", "9", "--seed", "4", "-q"]
    assert quality_cli.main([*pareto, "-o", str(root / "p1")]) == 0
    assert quality_cli.main([*pareto, "-o", str(root / "p2")]) == 0
    assert (root / "p1/held.jsonl").read_bytes() == (root / "p2/held.jsonl").read_bytes()
    kept = {r["id"] for r in read_jsonl(root / "p1" / "held.jsonl")}
    precision, _ = precision_recall(scored, kept)
    assert precision >= 0.9
    report = json.loads((root / "p1" / "quality_filter_report.json").read_text())
    assert report["kept"] + report["dropped"] == report["documents"] == len(scored)
    assert report["dropped_by"]["pareto"] == report["dropped"]
    out = capsys.readouterr().out
    assert "held out" in out and "precision" in out


def test_a_model_file_holding_objects_is_refused(tmp_path, capsys):
    model = tmp_path / "evil.npz"
    np.savez(model, coef=np.array([object()], dtype=object), intercept=np.zeros(1), config=np.array("{}"))
    docs = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}])
    assert quality_cli.main(["score", docs, "-o", str(tmp_path / "o"), "--model", str(model), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtnlg-quality: error: ") and "not a quality model" in err and "\n" not in err


def test_heuristic_signals_of_known_texts():
    repeated = "\n".join(["Click here to win a prize now"] * 10)
    s = measure(repeated)
    assert s["duplicate_line_fraction"] == pytest.approx(0.9) and s["word_count"] == 70
    bullets = "\n".join(f"• item number {i}" for i in range(9)) + "\nThe end of the list..."
    s = measure(bullets)
    assert s["bullet_line_fraction"] == pytest.approx(0.9) and s["ellipsis_line_fraction"] == pytest.approx(0.1)
    assert s["symbol_word_ratio"] == pytest.approx(1 / 41, abs=1e-6)  # one ellipsis, 9 x 4 + 5 tokens
    assert measure("the cat and the dog")["stop_words"] == 3
    distinct = " ".join(f"w{i}" for i in range(40))
    assert measure(distinct)["duplicate_5gram_char_fraction"] == 0.0
    assert measure(distinct + " " + distinct)["duplicate_5gram_char_fraction"] == pytest.approx(1.0)


def test_heuristic_counts_add_up_and_thresholds_change_without_re_measuring(labelled, tmp_path):
    held = labelled["held"]
    assert quality_cli.main(["annotate", held, "-o", str(tmp_path / "a"), "-q"]) == 0
    annotated = read_jsonl(tmp_path / "a" / "held.jsonl")
    report = json.loads((tmp_path / "a" / "quality_annotate_report.json").read_text())
    assert len(annotated) == report["documents"]  # annotated, none dropped
    listed = Counter(rule for r in annotated for rule in r["quality_failed"])
    assert all(report["failing_by_rule"][rule] == listed[rule] for rule in report["failing_by_rule"])
    assert report["failing_any_rule"] == sum(bool(r["quality_failed"]) for r in annotated)
    assert report["failing_any_rule"] + report["passing_every_rule"] == report["documents"]
    assert sum(report["failing_by_rule"].values()) >= report["failing_any_rule"]  # one document, several rules
    assert sum(not r["good"] and bool(r["quality_failed"]) for r in annotated) == sum(not r["good"] for r in annotated)

    # filter re-applies the rules to the stored signals: new thresholds, the same answer as measuring again
    looser = ["--set", "word_count.min=20", "--disable", "duplicate_ngrams", "--disable", "lorem_ipsum"]
    stored = str(tmp_path / "a" / "held.jsonl")
    assert quality_cli.main(["filter", stored, "-o", str(tmp_path / "f1"), "--heuristics", *looser, "-q"]) == 0
    assert quality_cli.main(["filter", held, "-o", str(tmp_path / "f2"), "--heuristics", *looser, "-q"]) == 0
    kept_stored = [r["id"] for r in read_jsonl(tmp_path / "f1" / "held.jsonl")]
    assert kept_stored == [r["id"] for r in read_jsonl(tmp_path / "f2" / "held.jsonl")]
    f1 = json.loads((tmp_path / "f1" / "quality_filter_report.json").read_text())
    assert f1["kept"] + f1["dropped"] == f1["documents"] and f1["kept"] == len(kept_stored)
    assert "rule:lorem_ipsum" not in f1["dropped_by"] and "rule:duplicate_ngrams" not in f1["dropped_by"]
    assert f1["kept"] > report["passing_every_rule"]  # looser thresholds keep more


def test_the_language_filter_keeps_the_named_languages_without_re_extracting(crawl, tmp_path):
    extracted = crawl["root"] / "out" / "crawl.jsonl"
    assert quality_cli.main(["filter", str(extracted), "-o", str(tmp_path / "en"), "--languages", "en,de", "-q"]) == 0
    kept = read_jsonl(tmp_path / "en" / "crawl.jsonl")
    assert kept == [d for d in crawl["docs"] if d["language"] in ("en", "de")]  # same records, same order
    assert {d["language"] for d in kept} == {"en", "de"}
    report = json.loads((tmp_path / "en" / "quality_filter_report.json").read_text())
    assert report["dropped_by"] == {"language": len(crawl["docs"]) - len(kept)} and report["languages"] == ["en", "de"]


def test_quality_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    assert quality_cli.main(["annotate", str(bad), "-o", str(tmp_path / "o"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtnlg-quality: error: ") and "bad.jsonl:2" in err and "\n" not in err
    assert not (tmp_path / "o" / "bad.jsonl").exists()
    with pytest.raises(SystemExit) as exit_info:
        quality_cli.main(["annotate", str(bad), "-o", str(tmp_path / "o"), "--set", "word_count.nope=3"])
    assert exit_info.value.code == 2
    assert "unknown threshold 'word_count.nope'" in capsys.readouterr().err
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "a document that was never scored"}])
    assert quality_cli.main(["annotate", good, "-o", str(tmp_path), "-q"]) == 2  # would replace its input
    assert quality_cli.main(["filter", good, "-o", str(tmp_path / "f"), "--threshold", "0.5", "-q"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "replace the input" in errors[0] and "mtnlg-quality score" in errors[1]
    assert not (tmp_path / "f" / "good.jsonl").exists()


def test_tools_wrappers_run_from_a_checkout():
    for name in ("extract.py", "quality.py"):
        p = subprocess.run(
            [sys.executable, str(ROOT / "tools" / name), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
        assert p.returncode == 0 and "usage:" in p.stdout
