"""Decontamination semantics (Megatron-LM filter_ngrams.py) and exact agreement with a plain-Python oracle."""

import json
import pickle
import re

import numpy as np
import pytest

from mtnlg_lightning.corpora.jsonl import InputError
from mtnlg_lightning.curation.decontaminate import DecontamConfig, run_decontaminate
from mtnlg_lightning.curation.ngrams import TaskNgrams, clean_text, split_text, words_and_spans
from mtnlg_lightning.demo.synthetic.near_duplicates import TextGenerator

# ----------------------------------------------------------------------------------------------------------
# Oracle: a direct transcription of the rules with strings (no hashing, no numpy)


def oracle(tasks, docs, max_n=13, min_n=8, window=200, min_piece=200, max_splits=10, freq_thr=10):
    grams = {}
    for t in tasks:
        w = re.findall(r"\w+", t.lower())
        if len(w) < min_n:
            continue
        if len(w) < max_n:
            grams[" ".join(w)] = 0
        for i in range(len(w) - max_n + 1):
            grams[" ".join(w[i : i + max_n])] = 0
    lengths = sorted({len(g.split()) for g in grams})
    order = [max_n] + [n for n in lengths if n != max_n] if max_n in lengths else lengths
    for d in docs:  # pass 1: number of documents containing each n-gram
        w = re.findall(r"\w+", d.lower())
        found = {" ".join(w[i : i + n]) for i in range(len(w)) for n in lengths if i + n <= len(w)} & grams.keys()
        for g in found:
            grams[g] += 1
    active = {g for g, c in grams.items() if c < freq_thr}
    results = []
    for d in docs:
        pieces, buf = [], [d]
        while buf:
            t = buf.pop(0)
            ms = list(re.finditer(r"\w+", t.lower()))
            w = [m.group(0) for m in ms]
            hit = None
            for i in range(len(w)):
                for n in order:
                    if i + n <= len(w) and " ".join(w[i : i + n]) in active:
                        hit = (i, n)
                        break
                if hit:
                    break
            if hit is None:
                pieces.append(t)
                continue
            i, n = hit
            start, end = ms[i].start(), ms[i + n - 1].end()
            pos = start - window
            first = ""
            while pos > 0 and t[pos] not in ".!?":
                pos -= 1
            if pos > 0:
                first = t[: pos + 1]
            pos = end + window
            second = ""
            while pos < len(t) and t[pos] not in ".!?":
                pos += 1
            if pos + 1 < len(t):
                second = t[pos + 1 :]
            if len(first) > min_piece:
                pieces.append(first)
            if len(second) > min_piece:
                buf.append(second)
        results.append([] if len(pieces) > max_splits else pieces)
    return results


def sentences(gen, n_chars):
    out = []
    while sum(len(s) + 1 for s in out) < n_chars:
        out.append(" ".join(gen.sentence_tokens()))
    return " ".join(out)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def run_files(tmp_path, tasks, docs, **kw):
    tp = write_jsonl(tmp_path / "tasks.jsonl", tasks)
    ip = write_jsonl(tmp_path / "train.jsonl", docs)
    cfg = DecontamConfig(tasks=[tp], input=ip, output=str(tmp_path / "out" / "clean.jsonl"), progress=False, **kw)
    rep = run_decontaminate(cfg)
    out = [json.loads(x) for x in (tmp_path / "out" / "clean.jsonl").read_text().splitlines()]
    return out, rep


# ----------------------------------------------------------------------------------------------------------
# Unit rules


def test_task_ngrams_13_grams_and_8_to_12_word_tasks_used_whole():
    idx = TaskNgrams()
    long_task = " ".join(f"w{i}" for i in range(15))  # 15 words -> 3 13-grams
    assert idx.add("t", long_task) == 3
    assert idx.add("t", "One two three four five six seven eight nine ten") == 1  # 10 words: whole
    assert idx.add("t", "only seven words in this task here") == 0  # < 8 words: ignored
    idx.build()
    assert sorted(len(g) for g in idx.ngrams) == [10, 13, 13, 13]
    words = "x y".split() + [f"w{i}" for i in range(1, 14)] + ["z"]
    assert [(p, idx.ngram_text(g)) for p, g in idx.hits(words)] == [(2, " ".join(f"w{i}" for i in range(1, 14)))]
    nine = "one two three four five six seven eight nine".split()
    assert idx.hits(nine) == [] and len(idx.hits(nine + ["ten"])) == 1


def test_task_index_sent_to_another_process_matches_and_grows_the_same():
    """What the Ray engine ships: a pickled index finds the same hits, names the same tasks, and still takes
    more task text (its n-gram table and task sets are rebuilt from the compact form)."""
    idx = TaskNgrams()
    idx.add("lambada", " ".join(f"w{i}" for i in range(15)))
    idx.add("squad", " ".join(f"w{i}" for i in range(2, 15)))  # shares one 13-gram with lambada
    idx.add("squad", "One two three four five six seven eight nine ten")
    idx.build()
    copy = pickle.loads(pickle.dumps(idx))
    words = ["x"] + [f"w{i}" for i in range(15)] + "one two three four five six seven eight nine ten".split()
    assert copy.hits(words) == idx.hits(words) and len(idx.hits(words)) == 4
    assert [copy.tasks_of(g) for _, g in copy.hits(words)] == [idx.tasks_of(g) for _, g in idx.hits(words)]
    assert copy.tasks_of(idx.ids[tuple(f"w{i}" for i in range(2, 15))]) == ["lambada", "squad"]
    for index in (idx, copy):
        assert index.add("hans", " ".join(f"w{i}" for i in range(13))) == 1  # an existing 13-gram, a new task
        index.build()
    assert [copy.tasks_of(g) for _, g in copy.hits(words)] == [idx.tasks_of(g) for _, g in idx.hits(words)]
    assert copy.tasks_of(idx.ids[tuple(f"w{i}" for i in range(13))]) == ["hans", "lambada"]


def test_words_are_lowercased_w_runs_with_original_offsets():
    words, spans = words_and_spans("Hello, WORLD!  it's")
    assert words == ["hello", "world", "it", "s"]
    assert spans == [(0, 5), (7, 12), (15, 17), (18, 19)]
    text = "İstanbul is BIG"  # lowercasing 'İ' adds a character: offsets still point into the original
    words, spans = words_and_spans(text)
    assert [text[a:b].lower() for a, b in spans][1:] == words[1:] and spans[0][0] == 0


def test_split_text_removes_window_and_snaps_outward_to_sentence_ends():
    text = "A" * 50 + ". " + "b" * 100 + ". " + "MATCH" + " c" * 60 + "! " + "d" * 100 + "? tail" + "e" * 10
    start = text.index("MATCH")
    end = start + 5
    first, second = split_text(text, start, end, window=20)
    # start-20 lands in the b-run, after the '.' that ends it? no: that '.' is 2 chars before the match, so the
    # walk goes back to the nearest sentence end at or before start-20: the '.' after the A-run
    assert first == text[: text.index(".") + 1]
    assert second == text[text.index("!") + 1 :]
    # window larger than the text before the match: nothing before is kept
    assert split_text(text, start, end, window=start + 5)[0] == ""
    # no sentence end after the window: nothing after is kept
    assert split_text("x. " + "y" * 50, 3, 4, window=5) == ("", "")


def test_clean_text_drops_short_pieces_and_rescans_the_rest():
    gen = TextGenerator(seed=11)
    task = " ".join(gen.words(13))
    idx = TaskNgrams()
    idx.add("t", task)
    idx.build()
    before, between, after = sentences(gen, 900), sentences(gen, 900), sentences(gen, 900)
    text = f"{before} {task}. {between} {task}. {after}"
    pieces, matched = clean_text(text, idx, None)
    assert len(matched) == 2 and len(pieces) == 3 and all(len(p) > 200 for p in pieces)
    assert all(task not in p for p in pieces)
    assert pieces == oracle([task], [text], freq_thr=10**9)[0]
    short = f"Tiny start. {task}. {after}"  # the piece before the match is <= 200 chars: dropped
    pieces, _ = clean_text(short, idx, None)
    assert len(pieces) == 1 and pieces[0] in short and not pieces[0].startswith("Tiny")


# ----------------------------------------------------------------------------------------------------------
# Whole-file runs against the oracle (planted matches)


def planted_corpus(seed=0, n_docs=60):
    gen = TextGenerator(seed=seed)
    rng = np.random.default_rng(seed)
    tasks = [" ".join(gen.words(int(rng.integers(14, 30)))) + "?" for _ in range(30)]
    tasks += [" ".join(gen.words(int(rng.integers(8, 13)))) for _ in range(6)]  # used whole
    tasks += [" ".join(gen.words(5))]  # too short: ignored
    common = tasks[0]  # planted in >= 10 documents: a "common phrase", ignored
    rare = tasks[1]  # planted in 9 documents: removed
    docs = []
    for i in range(n_docs):
        parts = [sentences(gen, int(rng.integers(100, 1500)))]
        for _ in range(int(rng.integers(0, 4))):
            t = tasks[int(rng.integers(2, len(tasks)))]
            w = t.split()
            if rng.random() < 0.5 and len(w) > 13:  # a partial passage: still contains 13-grams
                k = int(rng.integers(0, len(w) - 13 + 1))
                t = " ".join(w[k : k + 13 + int(rng.integers(0, len(w) - 13 - k + 1))])
            parts.append(t.upper() if rng.random() < 0.2 else t)
            parts.append(sentences(gen, int(rng.integers(0, 1200))))
        if i < 10:
            parts.insert(1, common + ".")
        if 10 <= i < 19:
            parts.insert(1, rare + ".")
        docs.append(" ".join(parts))
    # a document cut into more than 10 pieces is dropped; one with exactly 10 pieces is kept
    for k in (12, 9):
        body = [sentences(gen, 800)]
        for j in range(k):
            body += [tasks[2 + j], ".", sentences(gen, 800)]
        docs.append(" ".join(body))
    return tasks, docs


def test_agreement_with_oracle_on_planted_corpus(tmp_path):
    tasks, docs = planted_corpus()
    recs = [{"id": f"d{i}", "meta": {"k": i}, "text": d} for i, d in enumerate(docs)]
    recs[3]["split_id"] = "old"
    out, rep = run_files(tmp_path, [{"task": f"task{i % 3}", "text": t} for i, t in enumerate(tasks)], recs)
    expected = oracle(tasks, docs)
    got: dict[int, list[str]] = {}
    for r in out:
        i = int(r["id"][1:])
        got.setdefault(i, []).append(r["text"])
        assert r["meta"] == {"k": i}  # source fields kept
        prefix = "old-" if i == 3 else ""
        assert r["split_id"] == f"{prefix}task0-task1-task2-{i + 1:010d}-{len(got[i]) - 1:04d}"
    assert [got.get(i, []) for i in range(len(docs))] == expected
    d = rep["documents"]
    assert d["in"] == len(docs) and d["records_out"] == sum(len(p) for p in expected)
    assert d["dropped_too_many_splits"] >= 1
    assert got.get(len(docs) - 1) and len(got[len(docs) - 1]) == 10  # exactly 10 pieces: kept
    assert len(docs) - 2 not in got  # 13 pieces: dropped
    # frequency rule: the common task (in 10 documents) was ignored, the rare one (in 9) removed
    common, rare = tasks[0][:-1].lower(), tasks[1][:-1].lower()
    assert any(common in t.lower() for i in range(10) for t in got.get(i, []))
    assert not any(rare in t.lower() for i in range(10, 19) for t in got.get(i, []))
    top = {x["ngram"]: x["documents"] for x in rep["frequent_ngrams"]["top"]}
    assert " ".join(common.split()[:13]) in top and top[" ".join(common.split()[:13])] >= 10
    assert {f"d{i}" for i in range(10, 19)} <= {h["id"] for h in rep["hits"]["list"]}
    assert set(rep["hits"]["per_task"]) == {"task0", "task1", "task2"}
    assert rep["mb_per_s"] > 0 and (tmp_path / "out" / "report.json").exists()


def test_two_workers_identical(tmp_path):
    tasks, docs = planted_corpus(seed=2, n_docs=40)
    trecs = [{"task": "t", "text": t} for t in tasks]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out1, _ = run_files(tmp_path / "a", trecs, [{"text": d} for d in docs])
    out2, rep2 = run_files(tmp_path / "b", trecs, [{"text": d} for d in docs], workers=2, shard_bytes=7000)
    assert out1 == out2 and rep2["settings"]["workers"] == 2


def test_frequent_threshold_flag(tmp_path):
    tasks, docs = planted_corpus(seed=3, n_docs=25)
    trecs = [{"task": "t", "text": t} for t in tasks]
    (tmp_path / "a").mkdir()
    out, rep = run_files(tmp_path / "a", trecs, [{"text": d} for d in docs], frequent_threshold=1000)
    assert rep["frequent_ngrams"]["ignored"] == 0
    assert [r["text"] for r in out] == [p for ps in oracle(tasks, docs, freq_thr=1000) for p in ps]


def test_bad_inputs_raise_one_line_errors(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"task": "t", "text": "short"}\n')
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    cfg = DecontamConfig([str(tmp_path / "tasks.jsonl")], str(tmp_path / "train.jsonl"), str(tmp_path / "o.jsonl"))
    with pytest.raises(InputError, match="no task n-grams"):
        run_decontaminate(cfg)
    (tmp_path / "tasks.jsonl").write_text('{"task": "t", "text": "one two three four five six seven eight"}\n')
    (tmp_path / "train.jsonl").write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    with pytest.raises(InputError, match=r"train.jsonl:2: missing text key 'text'"):
        run_decontaminate(cfg)
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "report.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_killed_run_resumes_and_matches_an_uninterrupted_run(tmp_path):
    from curation_faults import Faults, SimulatedCrash

    tasks, docs = planted_corpus(seed=4, n_docs=40)
    trecs = [{"task": "t", "text": t} for t in tasks]
    (tmp_path / "a").mkdir()
    ref, _ = run_files(tmp_path / "a", trecs, [{"text": d} for d in docs], shard_bytes=9000)
    tp, ip = str(tmp_path / "a" / "tasks.jsonl"), str(tmp_path / "a" / "train.jsonl")
    cfg = DecontamConfig([tp], ip, str(tmp_path / "b" / "clean.jsonl"), progress=False, shard_bytes=9000)
    for point, resumed in (("clean:task2", ["count"]), ("publish:1", ["count", "clean"])):
        with pytest.raises(SimulatedCrash), Faults(crash_at=point, raise_instead=True):
            run_decontaminate(cfg)
        assert not (tmp_path / "b" / "report.json").exists()  # never looks done
        rep = run_decontaminate(cfg)
        assert rep["resumed_stages"] == resumed
        assert [json.loads(x) for x in (tmp_path / "b" / "clean.jsonl").read_text().splitlines()] == ref
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["clean.jsonl", "report.json"]  # work dir gone
