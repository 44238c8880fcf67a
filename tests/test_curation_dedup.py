"""Dedup pipeline semantics: exact duplicates first, verification, clusters, priority keep, outputs, resume."""

import json
import os

import numpy as np
import pytest
from curation_faults import CRASH_ENV, Faults, SimulatedCrash

from mtnlg_lightning.corpora.jsonl import InputError
from mtnlg_lightning.curation.dedup import WORK_DIR_NAME, DedupConfig, run_dedup
from mtnlg_lightning.curation.lsh import Banding
from mtnlg_lightning.curation.shingles import ShingleSpec, jaccard_strings, normalize_words, shingle_strings
from mtnlg_lightning.demo.synthetic.near_duplicates import TextGenerator, make_near_dup_corpus

W5 = ShingleSpec("word", 5)
ALWAYS_CANDIDATE = Banding(64, 1)  # any pair sharing one of 64 minhash values is a candidate: tests verification


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def true_j(a, b):
    return jaccard_strings(shingle_strings(a, W5), shingle_strings(b, W5))


def words_doc(seed, n=300):
    gen = TextGenerator(seed=seed)
    return gen.words(n)


def substitute(words, positions, seed=0):
    gen = TextGenerator(seed=1000 + seed)
    out = list(words)
    for p in positions:
        out[p] = "zz" + gen.words(1)[0]
    return out


def run(tmp_path, inputs, **kw):
    kw.setdefault("progress", False)
    return run_dedup(DedupConfig(inputs=inputs, output_dir=str(tmp_path / "out"), **kw))


def test_exact_duplicates_are_removed_first_without_lsh(tmp_path):
    a = " ".join(words_doc(1))
    recs = [
        {"id": "a", "text": a},
        {"id": "b", "text": " ".join(words_doc(2))},
        {"id": "a-copy", "text": "  " + a.upper().replace(" ", " ,  ") + "!"},  # case/space/punct only
        {"id": "a-copy2", "text": a},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", recs)
    rep = run(tmp_path, [path])
    assert [r["id"] for r in read_jsonl(tmp_path / "out" / "in.jsonl")] == ["a", "b"]
    dups = read_jsonl(tmp_path / "out" / "duplicates.jsonl")
    assert [(d["id"], d["duplicate_of"], d["kind"], d["exact_jaccard"]) for d in dups] == [
        ("a-copy", "a", "exact", 1.0),
        ("a-copy2", "a", "exact", 1.0),
    ]
    assert rep["totals"]["exact_duplicates_removed"] == 2
    assert rep["pairs"]["candidate_pairs"] == 0  # exact copies never reached LSH


def test_candidates_are_verified_by_exact_jaccard(tmp_path):
    base = words_doc(3)
    a = " ".join(base)
    b = " ".join(substitute(base, range(0, 300, 12)))  # 25 substitutions -> J well below 1
    j = true_j(a, b)
    assert 0.3 < j < 0.8
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": a}, {"id": "b", "text": b}])
    rep = run(tmp_path, [path], threshold=round(j + 0.01, 4), banding=ALWAYS_CANDIDATE, estimate_margin=-1.0)
    assert rep["pairs"]["candidate_pairs"] == 1 and rep["pairs"]["rejected_pairs"] == 1
    assert rep["totals"]["docs_out"] == 2
    # far below the threshold: rejected from the MinHash estimate alone, no exact Jaccard needed
    rep = run(tmp_path, [path], threshold=min(1.0, round(j + 0.3, 4)), banding=ALWAYS_CANDIDATE, force=True)
    assert rep["pairs"]["rejected_by_estimate"] == 1 and rep["pairs"]["jaccard_computed"] == 0
    rep = run(tmp_path, [path], threshold=round(j - 0.01, 4), banding=ALWAYS_CANDIDATE, force=True)
    assert rep["totals"]["docs_out"] == 1 and rep["pairs"]["verified_pairs"] == 1
    (d,) = read_jsonl(tmp_path / "out" / "duplicates.jsonl")
    assert d["kind"] == "near" and d["exact_jaccard"] == pytest.approx(j, abs=1e-4)
    assert 0 < d["estimated_jaccard"] <= 1


def test_clusters_are_connected_components_and_first_occurrence_is_kept(tmp_path):
    base = words_doc(4)
    a = " ".join(base)
    b_words = substitute(base, range(0, 150, 10), seed=1)  # edits in the first half
    b = " ".join(b_words)
    c = " ".join(substitute(b_words, range(150, 300, 10), seed=2))  # more edits in the second half
    jab, jbc, jac = true_j(a, b), true_j(b, c), true_j(a, c)
    thr = round((jac + min(jab, jbc)) / 2, 4)
    assert jac < thr <= min(jab, jbc)  # a~b, b~c, but not a~c
    other = " ".join(words_doc(5))
    recs = [{"id": "o", "text": other}, {"id": "b", "text": b}, {"id": "c", "text": c}, {"id": "a", "text": a}]
    path = write_jsonl(tmp_path / "in.jsonl", recs)
    rep = run(tmp_path, [path], threshold=thr, banding=ALWAYS_CANDIDATE)
    assert [r["id"] for r in read_jsonl(tmp_path / "out" / "in.jsonl")] == ["o", "b"]
    dups = {d["id"]: d for d in read_jsonl(tmp_path / "out" / "duplicates.jsonl")}
    assert {k: v["duplicate_of"] for k, v in dups.items()} == {"c": "b", "a": "b"}
    assert rep["clusters"]["clusters"] == 1 and rep["clusters"]["largest_cluster"] == 3


def test_priority_input_wins_then_first_occurrence(tmp_path):
    base = words_doc(6)
    x = " ".join(base)
    x2 = " ".join(substitute(base, [7, 100]))
    y = " ".join(words_doc(7))
    f1 = write_jsonl(tmp_path / "web.jsonl", [{"id": "w1", "text": x}, {"id": "w2", "text": y}])
    f2 = write_jsonl(tmp_path / "books.jsonl", [{"id": "k1", "text": x2}, {"id": "k2", "text": x}])
    rep = run(tmp_path, [f1, f2])
    assert [r["id"] for r in read_jsonl(tmp_path / "out" / "web.jsonl")] == ["w1", "w2"]
    assert read_jsonl(tmp_path / "out" / "books.jsonl") == []
    rep = run(tmp_path, [f1, f2], priority=["books.jsonl"], force=True)
    assert [r["id"] for r in read_jsonl(tmp_path / "out" / "web.jsonl")] == ["w2"]
    assert [r["id"] for r in read_jsonl(tmp_path / "out" / "books.jsonl")] == ["k1"]  # first occurrence in books
    dups = {
        d["id"]: (d["duplicate_of"], d["duplicate_of_source"], d["kind"])
        for d in read_jsonl(tmp_path / "out" / "duplicates.jsonl")
    }
    assert dups == {"w1": ("k1", "books.jsonl", "near"), "k2": ("k1", "books.jsonl", "near")}
    assert rep["settings"]["priority"] == ["books.jsonl", "web.jsonl"]
    assert rep["inputs"][0]["docs_out"] == 1 and rep["inputs"][1]["near_duplicates_removed"] == 1


def test_kept_records_are_unchanged_bytes_in_order_and_report_fields(tmp_path):
    recs = make_near_dup_corpus(120, seed=3, doc_chars=800)
    path = tmp_path / "c.jsonl"
    lines = [json.dumps(r, ensure_ascii=False, indent=None, separators=(",", ":")) for r in recs]
    lines.insert(5, "")  # a blank line is skipped, line numbers still count it
    path.write_text("\n".join(lines) + "\n")
    rep = run(tmp_path, [str(path)], id_key="nope")
    out_lines = (tmp_path / "out" / "c.jsonl").read_text().splitlines()
    assert set(out_lines) <= set(lines) and out_lines == [ln for ln in lines if ln in set(out_lines)]
    dups = read_jsonl(tmp_path / "out" / "duplicates.jsonl")
    assert len(out_lines) + len(dups) == 120
    for d in dups:  # id falls back to FILE:LINE; line numbers are 1-based and count the blank line
        name, line = d["id"].split(":")
        assert name == "c.jsonl" and lines[int(line) - 1].strip() and d["line"] == int(line)
        assert set(d) == {
            "id",
            "source",
            "line",
            "duplicate_of",
            "duplicate_of_source",
            "duplicate_of_line",
            "kind",
            "estimated_jaccard",
            "exact_jaccard",
        }
    for key in ("inputs", "totals", "clusters", "pairs", "timings_s", "docs_per_s", "banding", "settings"):
        assert key in rep
    assert rep["banding"]["candidate_probability"]["0.80"] == pytest.approx(0.9972, abs=1e-4)
    assert "affine32" in rep["settings"]["hash_scheme"]
    assert rep["signature_bytes_per_doc"] == 1024
    assert json.loads((tmp_path / "out" / "report.json").read_text())["totals"] == rep["totals"]
    assert not (tmp_path / "out" / WORK_DIR_NAME).exists()


def test_two_workers_give_identical_outputs(tmp_path):
    recs = make_near_dup_corpus(300, seed=4, doc_chars=1500)
    path = write_jsonl(tmp_path / "c.jsonl", recs)
    r1 = run_dedup(DedupConfig([path], str(tmp_path / "o1"), progress=False, shard_bytes=64 << 10))
    r2 = run_dedup(DedupConfig([path], str(tmp_path / "o2"), progress=False, shard_bytes=64 << 10, workers=2))
    for name in ("c.jsonl", "duplicates.jsonl"):
        assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()
    assert r1["totals"] == r2["totals"] and r2["settings"]["workers"] == 2


def test_settings_validation(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "a b c d e f"}])
    with pytest.raises(InputError, match="not one of the inputs"):
        run(tmp_path, [path], priority=["other.jsonl"])
    with pytest.raises(InputError, match="is the input"):
        run_dedup(DedupConfig([path], str(tmp_path), progress=False))
    os.makedirs(tmp_path / "sub")
    path2 = write_jsonl(tmp_path / "sub" / "x.jsonl", [{"text": "a b c d e f"}])
    with pytest.raises(InputError, match="same file name"):
        run(tmp_path, [path, path2])


# ----------------------------------------------------------------------------------------------------------
# Resume: a run killed at any point resumes finished stages, or starts clean; never looks complete early.


def killed_at(point):
    """A run that dies at ``point`` (a stage name, ``<stage>:task<i>`` or ``publish:<i>``)."""
    return Faults(crash_at=point, raise_instead=True)


@pytest.fixture
def corpus(tmp_path):
    recs = make_near_dup_corpus(200, seed=5, doc_chars=1500)
    path = write_jsonl(tmp_path / "c.jsonl", recs)
    ref = run_dedup(DedupConfig([path], str(tmp_path / "ref"), progress=False))
    return path, ref


def _outputs(d):
    return {n: (d / n).read_bytes() for n in ("c.jsonl", "duplicates.jsonl")}


@pytest.mark.parametrize(
    "point,resumed",
    [
        ("signatures:task2", []),
        ("signatures", ["signatures"]),
        ("buckets", ["signatures", "buckets"]),
        ("verify", ["signatures", "buckets", "verify"]),
        ("clusters", ["signatures", "buckets", "verify", "clusters"]),
        ("publish:1", ["signatures", "buckets", "verify", "clusters", "filter"]),
    ],
)
def test_killed_run_resumes_and_matches_an_uninterrupted_run(tmp_path, corpus, point, resumed):
    path, ref = corpus
    out = tmp_path / "out"
    cfg = DedupConfig([path], str(out), progress=False, shard_bytes=64 << 10)
    with pytest.raises(SimulatedCrash), killed_at(point):
        run_dedup(cfg)
    assert not (out / "report.json").exists()  # never looks done
    if not point.startswith("publish"):
        assert not (out / "c.jsonl").exists() and not (out / "duplicates.jsonl").exists()
    rep = run_dedup(cfg)
    assert rep["resumed_stages"] == resumed
    if point == "signatures:task2":
        assert rep["signature_shards"]["reused"] == 2 < rep["signature_shards"]["total"]  # finished shards kept
    assert _outputs(out) == _outputs(tmp_path / "ref")
    assert rep["totals"] == ref["totals"]
    again = run_dedup(cfg)  # complete: nothing to do
    assert again.get("already_complete") is True


def test_changed_input_or_settings_start_clean(tmp_path, corpus):
    path, _ = corpus
    out = tmp_path / "out"
    with pytest.raises(SimulatedCrash), killed_at("verify"):
        run_dedup(DedupConfig([path], str(out), progress=False))
    rep = run_dedup(DedupConfig([path], str(out), progress=False, threshold=0.9))
    assert rep["resumed_stages"] == []
    with open(path, "a") as f:
        f.write(json.dumps({"id": "new", "text": "brand new document text here"}) + "\n")
    rep = run_dedup(DedupConfig([path], str(out), progress=False, threshold=0.9))
    assert rep.get("already_complete") is None and rep["resumed_stages"] == [] and rep["totals"]["docs_in"] == 201


def test_real_kill_with_os_exit_then_resume(tmp_path, corpus):
    """The same through the CLI with a real process death (os._exit) in the middle of the pipeline."""
    import subprocess
    import sys

    path, _ = corpus
    tool = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "dedup.py")
    out = tmp_path / "out"
    env = {**os.environ, CRASH_ENV: "verify"}
    killed = [sys.executable, os.path.join(os.path.dirname(__file__), "curation_faults.py"), "dedup"]  # mtnlg-dedup
    p = subprocess.run([*killed, path, "-o", str(out), "-q"], env=env, capture_output=True, text=True)
    assert p.returncode == 86 and not (out / "report.json").exists()
    assert (out / WORK_DIR_NAME / "buckets.done").exists()
    p = subprocess.run([sys.executable, tool, path, "-o", str(out), "-q"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["resumed_stages"] == ["signatures", "buckets", "verify"]
    assert _outputs(out) == _outputs(tmp_path / "ref")
    assert np.all([not n.endswith(".tmp") for n in os.listdir(out)])


def test_filter_in_many_shards_keeps_the_right_lines_and_names_every_duplicate(tmp_path):
    """Kept records and duplicates.jsonl are assembled from one task per shard: tiny shards over two inputs,
    blank lines, no final newline in one input, records without an id, keepers in other shards and files."""
    recs = make_near_dup_corpus(160, seed=12, doc_chars=900, dup_fraction=0.4)
    for r in recs[::7]:
        r.pop("id")
    files = {"a.jsonl": recs[:90], "b.jsonl": recs[90:] + recs[10:20]}  # b repeats 10 records of a exactly
    lines_of = {}
    for name, rs in files.items():
        lines = []
        for i, r in enumerate(rs):
            lines.append(json.dumps(r))
            if i % 13 == 4:
                lines.append("  ")  # a blank line: not a record, still counted in line numbers
        (tmp_path / name).write_text("\n".join(lines) + ("" if name == "a.jsonl" else "\n"))
        lines_of[name] = lines
    inputs = [str(tmp_path / n) for n in files]
    reps = [
        run_dedup(
            DedupConfig(
                inputs, str(tmp_path / f"o{w}"), progress=False, shard_bytes=8 << 10, priority=["b.jsonl"], workers=w
            )
        )
        for w in (1, 2)
    ]
    assert reps[0]["signature_shards"]["total"] >= 12
    out = tmp_path / "o1"
    for name in ("a.jsonl", "b.jsonl", "duplicates.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()
    dups = read_jsonl(out / "duplicates.jsonl")
    assert sum(d["kind"] == "exact" for d in dups) >= 10 and sum(d["kind"] == "near" for d in dups) >= 10
    removed = {(d["source"], d["line"]) for d in dups}
    for name, lines in lines_of.items():
        want = "".join(ln + "\n" for i, ln in enumerate(lines, start=1) if ln.strip() and (name, i) not in removed)
        assert (out / name).read_text() == want
    for d in dups:
        rec = json.loads(lines_of[d["source"]][d["line"] - 1])
        kept = json.loads(lines_of[d["duplicate_of_source"]][d["duplicate_of_line"] - 1])
        assert d["id"] == rec.get("id", f"{d['source']}:{d['line']}")
        assert d["duplicate_of"] == kept.get("id", f"{d['duplicate_of_source']}:{d['duplicate_of_line']}")
        assert (d["duplicate_of_source"], d["duplicate_of_line"]) not in removed
        assert d["exact_jaccard"] == round(true_j(rec["text"], kept["text"]), 4)
        same_text = normalize_words(rec["text"]) == normalize_words(kept["text"])
        assert (d["kind"] == "exact") == same_text
    assert reps[0]["inputs"][0]["docs_out"] + reps[0]["inputs"][1]["docs_out"] + len(dups) == 170
