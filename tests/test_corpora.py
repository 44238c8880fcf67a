"""Every data tool reads every corpus layout (compression from the bytes, parquet, JSON arrays, folders, globs,
mixes) and gives byte-identical results to the same records as plain JSON lines; bad records have a policy."""

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from corpus_layouts import LAYOUTS, decompressed, read_records, write_layout

from mtnlg_lightning.corpora.formats import detect
from mtnlg_lightning.curation import dedup_cli
from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus


@pytest.fixture(scope="module")
def shards():
    recs = [{"id": r["id"], "text": r["text"]} for r in make_near_dup_corpus(60, seed=3, doc_chars=600)]
    return [recs[:35], recs[35:]]


def _outputs(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*") if p.is_file() and p.name not in ("report.json", "duplicates.jsonl"))


def _dups_by_position(out: Path, names: list[str]) -> list[dict]:
    """duplicates.jsonl with source names replaced by the input's position (the names differ by layout)."""
    rows = [json.loads(x) for x in (out / "duplicates.jsonl").read_text().splitlines()]
    for r in rows:
        for k in ("source", "duplicate_of_source"):
            r[k] = names.index(r[k])
        for k in ("id", "duplicate_of"):
            if isinstance(r[k], str) and ":" in r[k]:
                r[k] = r[k].split(":")[-1]
    return rows


@pytest.fixture(scope="module")
def dedup_reference(shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    inputs = write_layout("plain", root, shards)
    assert dedup_cli.main([*inputs, "-o", str(root / "out"), "-q", "--workers", "1"]) == 0
    report = json.loads((root / "out" / "report.json").read_text())
    return root / "out", report


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dedup_reads_every_layout(layout, shards, dedup_reference, tmp_path):
    ref_out, ref_report = dedup_reference
    inputs = write_layout(layout, tmp_path, shards)
    out = tmp_path / "out"
    assert dedup_cli.main([*inputs, "-o", str(out), "-q", "--workers", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["docs_in"] == 60 and report["totals"] == ref_report["totals"]
    names = [x["file"] for x in report["inputs"]]
    assert _dups_by_position(out, [x["output"] for x in report["inputs"]]) == _dups_by_position(
        ref_out, ["a.jsonl", "b.jsonl"]
    )
    outs = [out / x["output"] for x in report["inputs"]]
    refs = [ref_out / "a.jsonl", ref_out / "b.jsonl"]
    for inp, o, r in zip(names, outs, refs, strict=True):
        fmt_in, fmt_out = detect(inp), detect(str(o))
        assert fmt_out == fmt_in, (inp, o)  # the input's format and compression
        if fmt_in.kind == "jsonl":
            assert decompressed(o) == r.read_bytes()  # byte-identical kept records
        else:
            assert read_records(o) == read_records(r)
    assert len(_outputs(out)) == 2


@pytest.fixture(scope="module")
def decontam_data(tmp_path_factory):
    from mtnlg_lightning.demo.synthetic.near_duplicates import make_tasks_and_training

    tasks, train = make_tasks_and_training(4, 40, seed=5, doc_chars=800, plant_fraction=0.3)
    root = tmp_path_factory.mktemp("decon")
    task_file = write_layout("gzip", root / "tasks", [tasks, tasks[:1]])[0]  # tasks read through the same layer
    ref = write_layout("plain", root / "ref", [train, train[:1]])[0]
    return train, task_file, _decontaminate(root / "ref", ref, task_file)


def _decontaminate(root: Path, inp: str, task_file: str, *extra: str) -> tuple[Path, dict]:
    from mtnlg_lightning.curation import decontaminate_cli

    out = root / "out" / ("clean" + "".join(Path(inp).suffixes))
    args = ["--tasks", task_file, "--input", inp, "--output", str(out), "-q", "--workers", "1", *extra]
    assert decontaminate_cli.main(args) == 0
    return out, json.loads((out.parent / "report.json").read_text())


@pytest.mark.parametrize("layout", ["gzip", "zstd", "misleading", "parquet", "json_array"])
def test_decontaminate_reads_every_format(layout, decontam_data, tmp_path):
    train, task_file, (ref_out, ref_report) = decontam_data
    inp = write_layout(layout, tmp_path, [train, train[:1]])[0]
    out, report = _decontaminate(tmp_path, inp, task_file)
    assert report["documents"] == ref_report["documents"] and report["documents"]["split"] > 0
    assert [h.pop("file") for h in report["hits"]["list"]] == [inp] * len(report["hits"]["list"])  # file and line
    assert report["hits"]["list"] == [{k: v for k, v in h.items() if k != "file"} for h in ref_report["hits"]["list"]]
    assert detect(str(out)) == detect(inp)  # the input's format and compression
    if detect(inp).kind == "jsonl":
        assert decompressed(out) == ref_out.read_bytes()
    else:
        assert read_records(out) == read_records(ref_out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decontaminate_writes_one_output_per_input_in_its_format(layout, decontam_data, tmp_path):
    """--output-dir: each input file's records come out under its name, in its format and compression, and
    together they are exactly the one-file run over the same records (n-grams counted over all inputs); every hit
    names its file and its line there."""
    from mtnlg_lightning.curation import decontaminate_cli

    train, task_file, _ = decontam_data
    halves = [train[:25], train[25:]]
    single = write_layout("plain", tmp_path / "one", [train, train[:1]])[0]
    ref_out, ref_report = _decontaminate(tmp_path / "one", single, task_file)
    inputs = write_layout(layout, tmp_path / "in", halves)
    out = tmp_path / "out"
    args = ["--tasks", task_file, "--input", *inputs, "--output-dir", str(out), "-q", "--workers", "2"]
    assert decontaminate_cli.main([*args, "--shard-mb", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    files, outputs = report["input_files"], [Path(o) for o in report["settings"]["outputs"]]
    assert len(files) == 2 and sorted(outputs) == _outputs(out)  # one output per input file, nothing else
    assert report["documents"] == ref_report["documents"] and report["documents"]["split"] > 0
    assert {h["file"] for h in report["hits"]["list"]} == set(files)  # planted documents in both files
    for hit, ref in zip(report["hits"]["list"], ref_report["hits"]["list"], strict=True):
        offset = len(halves[0]) if hit["file"] == files[1] else 0  # lines are numbered within each file
        assert (hit["line"] + offset, hit["id"], hit["ngrams"]) == (ref["line"], ref["id"], ref["ngrams"])
    records, plain = [], b""
    for inp, o in zip(files, outputs, strict=True):
        assert detect(str(o)) == detect(inp)  # the input's format and compression
        records += read_records(o)
        plain += decompressed(o) if detect(inp).kind == "jsonl" else b""
    assert records == read_records(ref_out)
    if all(detect(f).kind == "jsonl" for f in files):
        assert plain == ref_out.read_bytes()  # byte-identical to the one-file run


def test_decontaminate_output_compression_and_one_line_errors(decontam_data, tmp_path, capsys):
    from mtnlg_lightning.curation import decontaminate_cli

    train, task_file, _ = decontam_data
    inputs = write_layout("plain", tmp_path / "in", [train[:25], train[25:]])
    out = tmp_path / "out"
    base = ["--tasks", task_file, "--input", *inputs, "-q"]
    assert decontaminate_cli.main([*base, "--output-dir", str(out), "--output-compression", "zstd"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["a.jsonl.zst", "b.jsonl.zst", "report.json"]
    assert all(detect(str(p)).compression == "zstd" for p in out.glob("*.zst"))
    assert decontaminate_cli.main([*base, "--output", str(tmp_path / "one.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names 2 files" in err[0] and "--output-dir" in err[0]
    assert not (tmp_path / "one.jsonl").exists()


@pytest.fixture(scope="module")
def tokenizer_dir(shards, tmp_path_factory):
    from mtnlg_lightning.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("tok")
    train_bpe([r["text"] for s in shards for r in s], 400, d)
    return d


def _tool(name):
    import importlib.util
    import sys

    tools = Path(__file__).resolve().parents[1] / "tools"
    if str(tools) not in sys.path:
        sys.path.insert(0, str(tools))
    path = tools / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def preprocess_reference(shards, tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pre_ref")
    inputs = write_layout("plain", root, shards)
    prefix = root / "ref"
    args = ["--input", *inputs, "--tokenizer", str(tokenizer_dir), "--output-prefix", str(prefix), "--no-progress"]
    assert _tool("preprocess_data")(args) == 0
    return prefix


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preprocess_and_tokenizer_read_every_layout(layout, shards, tokenizer_dir, preprocess_reference, tmp_path):
    inputs = write_layout(layout, tmp_path, shards)
    prefix = tmp_path / "out"
    args = ["--input", *inputs, "--tokenizer", str(tokenizer_dir), "--output-prefix", str(prefix), "--no-progress"]
    assert _tool("preprocess_data")(args) == 0
    for suffix in (".bin", ".idx"):
        got = (tmp_path / f"out{suffix}").read_bytes()
        assert got == preprocess_reference.with_suffix(suffix).read_bytes(), suffix
    if layout in ("plain", "mix"):  # the tokenizer trainer reads the same texts
        tok = tmp_path / "tok"
        assert _tool("train_tokenizer")(["--input", *inputs, "--vocab-size", "400", "--output", str(tok)]) == 0
        assert (tok / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_preprocess_splits_work_by_file_and_byte_range_and_merges_to_the_same_bytes(
    shards, tokenizer_dir, preprocess_reference, tmp_path
):
    from mtnlg_lightning.data.merge import merge_datasets
    from mtnlg_lightning.data.preprocess import plan_read_tasks, preprocess

    inputs = write_layout("mix", tmp_path / "mix", shards)  # a parquet file and a zstd file: one task each
    plain = write_layout("plain", tmp_path / "plain", shards)  # plain files: split into ~4 KB ranges
    assert len(plan_read_tasks(plain, range_bytes=4096)) > 4
    for i, ins in enumerate((inputs, plain)):
        summary = preprocess(
            ins, str(tokenizer_dir), str(tmp_path / f"w{i}"), workers=2, progress=False, range_bytes=4096
        )
        assert summary.documents == 60
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"w{i}{suffix}").read_bytes() == preprocess_reference.with_suffix(suffix).read_bytes()
    # two halves merged (Megatron merge_datasets) give the whole
    a, b = (write_layout("plain", tmp_path / f"half{i}", [s, s[:1]])[0] for i, s in enumerate(shards))
    for name, inp in (("a", a), ("b", b)):
        preprocess([inp], str(tokenizer_dir), str(tmp_path / name), progress=False)
    args = ["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix", str(tmp_path / "merged")]
    assert _tool("preprocess_data")(args) == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == preprocess_reference.with_suffix(suffix).read_bytes()
    assert merge_datasets([str(tmp_path / "a")], str(tmp_path / "one")) == (
        35,
        len(__import__("numpy").fromfile(tmp_path / "a.bin", dtype="uint16")),
    )


BAD_LINES = [
    (b'{"id": "m", "text": broken\n', "malformed_json"),
    (b'{"id": "u", "text": "caf\xe9 latte"}\n', "non_utf8"),
    (b'{"id": "f", "body": "no text field here"}\n', "missing_field"),
    (b'{"id": "n", "text": 42}\n', "non_string_text"),
    (b'{"id": "e", "text": ""}\n', "empty_text"),
    (b'["an", "array"]\n', "malformed_json"),
]


def _bad_corpus(tmp_path, shards) -> tuple[Path, int]:
    """A zstd JSON-lines file: good records with every kind of bad record between them; first bad line 3."""
    import zstandard

    good = [json.dumps(r).encode() + b"\n" for r in shards[0]]
    lines = good[:2] + [b for b, _ in BAD_LINES] + good[2:]
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines)))
    return path, len(good)


EXPECTED_BAD = {"malformed_json": 2, "non_utf8": 1, "missing_field": 1, "non_string_text": 1, "empty_text": 1}


@pytest.mark.parametrize("tool", ["dedup", "decontaminate", "preprocess_data", "train_tokenizer"])
def test_bad_records_skip_counts_each_kind_and_error_names_file_and_line(tool, shards, tokenizer_dir, tmp_path, capsys):
    from mtnlg_lightning.curation import decontaminate_cli

    path, n_good = _bad_corpus(tmp_path, shards)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task": "t", "text": "one two three four five six seven eight nine ten"}) + "\n")
    out = tmp_path / "out"

    def run(policy: str) -> int:
        flag = ["--on-bad-record", policy]
        if tool == "dedup":
            return dedup_cli.main([str(path), "-o", str(out), "-q", *flag])
        if tool == "decontaminate":
            args = ["--tasks", str(tasks), "--input", str(path), "--output", str(out / "clean.jsonl.zst"), "-q"]
            return decontaminate_cli.main(args + flag)
        if tool == "preprocess_data":
            args = ["--input", str(path), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(out / "d")]
            return _tool(tool)(args + ["--no-progress", *flag])
        return _tool(tool)(["--input", str(path), "--vocab-size", "300", "--output", str(out / "tok"), *flag])

    capsys.readouterr()
    assert run("error") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: {path}:3: invalid JSON" in err[0], err
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]  # nothing written
    assert run("skip") == 0
    printed = capsys.readouterr().out
    assert (
        "skipped 6 bad records (malformed json 2, non utf8 1, missing field 1, non string text 1, empty text 1)"
        in printed
    )
    if tool in ("dedup", "decontaminate"):
        report = json.loads((out / "report.json").read_text())
        assert report["bad_records"] == EXPECTED_BAD
        docs = report["totals"]["docs_in"] if tool == "dedup" else report["documents"]["in"]
        assert docs == n_good


@pytest.mark.parametrize("layout, module", [("zstd", "zstandard"), ("parquet", "pyarrow")])
def test_missing_corpora_extra_is_one_line_before_any_work(layout, module, shards, tmp_path, monkeypatch, capsys):
    inputs = write_layout(layout, tmp_path, shards)
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    out = tmp_path / "out"
    assert dedup_cli.main([*inputs, "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"mtnlg-dedup: error: {inputs[0]}: reading {'zstd' if layout == 'zstd' else 'parquet'} needs the "
        f"'{module}' package: pip install 'mtnlg-lightning[corpora]'"
    ]
    assert not out.exists()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eval_data_reads_every_layout(layout, shards, tmp_path):
    from mtnlg_lightning.evaluation.data import read_documents, read_records

    inputs = write_layout(layout, tmp_path, shards)
    expected = shards[0] + shards[1] if len(inputs) == 1 else shards[0]  # a folder or glob names both files
    assert read_documents(inputs[0]) == [r["text"] for r in expected]
    assert read_records(inputs[0], ("text",)) == expected


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_a_huge_single_line_is_read_whole_and_a_huge_broken_one_is_one_named_bad_record(compression, tmp_path):
    """No fixed parse block: a 24 MB record on one line comes back whole, in every compression; a 24 MB line
    that is not JSON is one bad record naming its file and line, not a traceback or a silent truncation."""
    import gzip

    from mtnlg_lightning.corpora import BadRecordPolicy, CorpusError, expand_inputs
    from mtnlg_lightning.corpora.readers import iter_records

    if compression == "zstd":
        zstandard = pytest.importorskip("zstandard")
    huge = "word " * (24 << 18)  # 24 MiB of text in one record
    data = json.dumps({"id": "small", "text": "a short one"}) + "\n" + json.dumps({"id": "huge", "text": huge}) + "\n"
    broken = data + '{"id": "cut", "text": "' + "x" * (24 << 20) + "\n"  # the closing quote and brace are missing
    for name, content in (("ok.jsonl", data), ("broken.jsonl", broken)):
        raw = content.encode("utf-8")
        if compression == "gzip":
            raw = gzip.compress(raw, compresslevel=1)
        elif compression == "zstd":
            raw = zstandard.ZstdCompressor(level=1).compress(raw)
        (tmp_path / name).write_bytes(raw)
    records = list(iter_records(expand_inputs([str(tmp_path / "ok.jsonl")])))
    assert [r.id for r in records] == ["small", "huge"] and records[1].text == huge
    with pytest.raises(CorpusError, match=r"broken\.jsonl.*3") as caught:
        list(iter_records(expand_inputs([str(tmp_path / "broken.jsonl")])))
    assert len(str(caught.value).splitlines()) == 1 and len(str(caught.value)) < 1000
    policy = BadRecordPolicy("skip")
    assert [r.id for r in iter_records(expand_inputs([str(tmp_path / "broken.jsonl")]), policy=policy)] == [
        "small",
        "huge",
    ]
    assert policy.summary()["malformed_json"] == 1


def _fails_on_two(shared, item):
    if item == 2:
        raise ValueError("item 2 is bad")
    time.sleep(0.2)
    return item


@pytest.mark.timeout(60)
def test_a_failing_pool_run_ends_its_workers_whatever_sigterm_handler_the_driver_installed():
    """The pool's terminate() ends its workers with SIGTERM. A driver's Python-level handler that does not exit (Ray
    installs one at ray.init, and it outlives ray.shutdown) is inherited by forked workers: the workers reset it, so
    a failed stage does not wait for them forever."""
    from mtnlg_lightning.corpora.engine import LocalEngine

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        engine = LocalEngine(workers=2)
        with pytest.raises(ValueError, match="item 2 is bad"):
            list(engine.map(_fails_on_two, range(6)))
        engine.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
