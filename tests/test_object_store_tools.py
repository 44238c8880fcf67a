"""Every data tool reads its inputs from S3 and writes its outputs there (moto's S3 server on 127.0.0.1), and the
bytes it writes are the bytes it writes on local disk: for plain, zstd, parquet and folder-tree corpora.

The reports are left out of the comparisons (they hold timings and the paths or URLs given); everything else a tool
writes is compared byte for byte, and nothing hidden (staging objects, the work folder's twin) is left behind.
"""

import json
from pathlib import Path

import pytest
from conftest import tool_main
from corpus_layouts import write_layout
from object_store import local_tree

from mtnlg_lightning.curation import decontaminate_cli, dedup_cli
from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus, make_tasks_and_training

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("plain", "zstd", "parquet", "folder")
REPORTS = ("report.json", "extract_report.json")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Scratch folders, fetched tokenizers and token blocks in this test's folder, not the user's cache."""
    monkeypatch.setenv("MTNLG_CACHE", str(tmp_path / "cache"))


def on_s3(s3, bucket: str, root: Path, specs: list[str], name: str) -> list[str]:
    """The local corpus below ``root`` uploaded to s3://bucket/name/, and the specs that name it there."""
    s3.put_tree(root, f"s3://{bucket}/{name}")
    return [spec.replace(str(root), f"s3://{bucket}/{name}") for spec in specs]


def layout_on_s3(s3, bucket: str, layout: str, root: Path, files: list[list[dict]], name: str):
    """``files`` (lists of records) written in ``layout`` below ``root`` and uploaded to s3://bucket/name/: the
    specs that name them on disk, and there."""
    specs = write_layout(layout, root, files)
    return specs, on_s3(s3, bucket, root, specs, name)


def written(tree: dict[str, bytes]) -> dict[str, bytes]:
    """A tool's outputs without its report."""
    return {k: v for k, v in tree.items() if k.split("/")[-1] not in REPORTS and not k.endswith("_report.json")}


def assert_nothing_hidden_left(s3, url: str, cache: Path) -> None:
    assert not [k for k in s3.keys(url) if any(part.startswith(".") for part in k.split("/"))]
    assert not (cache / "scratch").exists() or not any((cache / "scratch").iterdir())


@pytest.fixture(scope="module")
def near_dups():
    records = make_near_dup_corpus(120, seed=5, doc_chars=700)
    return [records[:60], records[60:]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dedup_from_s3_to_s3_writes_the_bytes_it_writes_on_disk(layout, near_dups, s3, tmp_path):
    bucket = s3.new_bucket()
    specs, urls = layout_on_s3(s3, bucket, layout, tmp_path / "in", near_dups, "in")
    assert dedup_cli.main([*specs, "-o", str(tmp_path / "out"), "-q"]) == 0
    assert dedup_cli.main([*urls, "-o", f"s3://{bucket}/out", "-q"]) == 0
    remote = s3.tree(f"s3://{bucket}/out")
    assert written(remote) == written(local_tree(tmp_path / "out"))
    assert b'"kind": "near"' in remote["duplicates.jsonl"]  # the corpus has near duplicates to remove
    local_report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert json.loads(remote["report.json"])["totals"] == local_report["totals"]
    assert_nothing_hidden_left(s3, f"s3://{bucket}/out", tmp_path / "cache")


@pytest.fixture(scope="module")
def contaminated():
    tasks, docs = make_tasks_and_training(30, 60, seed=4, doc_chars=900, plant_fraction=0.3)
    return tasks, [docs[:30], docs[30:]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decontaminate_from_s3_to_s3_writes_the_bytes_it_writes_on_disk(layout, contaminated, s3, tmp_path):
    tasks, halves = contaminated
    bucket = s3.new_bucket()
    task_files = layout_on_s3(s3, bucket, "zstd", tmp_path / "tasks", [tasks, tasks[:1]], "tasks")
    task_specs, task_urls = (names[:1] for names in task_files)  # the first file: the whole task set
    specs, urls = layout_on_s3(s3, bucket, layout, tmp_path / "in", halves, "in")
    local = ["--tasks", *task_specs, "--input", *specs, "--output-dir", str(tmp_path / "out"), "-q"]
    remote = ["--tasks", *task_urls, "--input", *urls, "--output-dir", f"s3://{bucket}/out", "-q"]
    assert decontaminate_cli.main(local) == 0
    assert decontaminate_cli.main(remote) == 0
    tree = s3.tree(f"s3://{bucket}/out")
    assert written(tree) == written(local_tree(tmp_path / "out"))
    assert json.loads(tree["report.json"])["hits"]["documents"] >= 5  # there was text to remove
    assert_nothing_hidden_left(s3, f"s3://{bucket}/out", tmp_path / "cache")


def test_decontaminate_one_output_file_and_its_report_on_s3(contaminated, s3, tmp_path):
    tasks, halves = contaminated
    bucket = s3.new_bucket()
    specs, (task_url, train_url) = layout_on_s3(
        s3, bucket, "plain", tmp_path / "in", [tasks, halves[0] + halves[1]], "in"
    )
    local = ["--tasks", specs[0], "--input", specs[1], "--output", str(tmp_path / "clean.jsonl"), "-q"]
    remote = ["--tasks", task_url, "--input", train_url, "--output", f"s3://{bucket}/out/clean.jsonl", "-q"]
    assert decontaminate_cli.main(local) == 0
    assert decontaminate_cli.main([*remote, "--report", f"s3://{bucket}/reports/decontaminate.json"]) == 0
    assert s3.get(f"s3://{bucket}/out/clean.jsonl") == (tmp_path / "clean.jsonl").read_bytes()
    assert s3.keys(f"s3://{bucket}/reports") == ["decontaminate.json"]
    assert s3.keys(f"s3://{bucket}/out") == ["clean.jsonl"]


@pytest.fixture(scope="module")
def token_corpus():
    words = "the river carries small stones past the mill while the wind moves the grass on the bank".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(30 + i % 11)) + f" number {i}." for i in range(80)]
    records = [{"id": i, "text": t} for i, t in enumerate(texts)]
    return [records[:40], records[40:]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tokenizer_and_preprocess_from_s3_to_s3_write_the_bytes_they_write_on_disk(layout, token_corpus, s3, tmp_path):
    bucket = s3.new_bucket()
    specs, urls = layout_on_s3(s3, bucket, layout, tmp_path / "in", token_corpus, "in")
    train, preprocess = tool_main("train_tokenizer"), tool_main("preprocess_data")
    assert train(["--input", *specs, "--vocab-size", "300", "--output", str(tmp_path / "tok")]) == 0
    assert train(["--input", *urls, "--vocab-size", "300", "--output", f"s3://{bucket}/tok"]) == 0
    assert s3.get(f"s3://{bucket}/tok/tokenizer.json") == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    local = ["--input", *specs, "--tokenizer", str(tmp_path / "tok"), "--output-prefix", str(tmp_path / "data/c")]
    # the tokenizer read from S3 too; two workers: the inputs are read in ranges by several processes
    remote = ["--input", *urls, "--tokenizer", f"s3://{bucket}/tok", "--output-prefix", f"s3://{bucket}/data/c"]
    assert preprocess([*local, "--no-progress"]) == 0
    assert preprocess([*remote, "--no-progress", "--workers", "2"]) == 0
    assert s3.tree(f"s3://{bucket}/data") == local_tree(tmp_path / "data")
    assert_nothing_hidden_left(s3, f"s3://{bucket}/data", tmp_path / "cache")


@pytest.fixture(scope="module")
def warcs(tmp_path_factory):
    """A synthetic crawl (gzip, with broken records) and a plain WET file."""
    pytest.importorskip("warcio")
    import io

    from warcio.warcwriter import WARCWriter

    from mtnlg_lightning.demo.synthetic.warc import CrawlSpec, english_paragraphs, write_synthetic_warc

    root = tmp_path_factory.mktemp("warcs")
    write_synthetic_warc(
        root / "crawl.warc.gz", CrawlSpec(english_pages=12, pages_per_language=1, junk_pages=4, seed=7)
    )
    buf = io.BytesIO()
    writer = WARCWriter(buf, gzip=False)
    for i, (_, text) in enumerate(english_paragraphs(6)):
        payload, headers = io.BytesIO(text.encode("utf-8")), {"Content-Type": "text/plain"}
        record = writer.create_warc_record(
            f"https://wet.example/{i}", "conversion", payload=payload, warc_headers_dict=headers
        )
        writer.write_record(record)
    (root / "segment.warc.wet").write_bytes(buf.getvalue())
    return root


def test_extract_from_s3_to_s3_writes_the_bytes_it_writes_on_disk(warcs, s3, tmp_path):
    for module in ("trafilatura", "justext", "pycld2", "lxml_html_clean"):
        pytest.importorskip(module)
    from mtnlg_lightning.crawl import extract_cli

    bucket = s3.new_bucket()
    specs = [str(warcs / "crawl.warc.gz"), str(warcs / "segment.warc.wet")]
    urls = on_s3(s3, bucket, warcs, specs, "crawl")
    assert extract_cli.main([*specs, "-o", str(tmp_path / "out"), "-q", "--workers", "1"]) == 0
    assert extract_cli.main([*urls, "-o", f"s3://{bucket}/text", "-q", "--workers", "1"]) == 0
    tree = s3.tree(f"s3://{bucket}/text")
    assert written(tree) == written(local_tree(tmp_path / "out"))
    assert tree["crawl.jsonl"].count(b"\n") >= 10 and tree["segment.jsonl"].count(b"\n") == 6
    assert_nothing_hidden_left(s3, f"s3://{bucket}/text", tmp_path / "cache")


def test_quality_train_score_annotate_filter_from_s3_to_s3(s3, tmp_path):
    pytest.importorskip("sklearn")
    from mtnlg_lightning.crawl import quality_cli
    from mtnlg_lightning.demo.synthetic.warc import english_paragraphs, junk_documents

    prose = [{"text": p} for _, p in english_paragraphs(60)]
    junk = [{"text": t} for t in junk_documents(40, seed=2)]
    (tmp_path / "in").mkdir()
    for name, records in (("good.jsonl", prose), ("bad.jsonl", junk), ("mix.jsonl", prose[::3] + junk[::3])):
        (tmp_path / "in" / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    bucket = s3.new_bucket()
    s3.put_tree(tmp_path / "in", f"s3://{bucket}/in")
    for where, base in (("local", str(tmp_path)), ("s3", f"s3://{bucket}")):
        model = f"{base}/{where}-model.npz"
        pos, neg, mix = (f"{base}/in/{n}" for n in ("good.jsonl", "bad.jsonl", "mix.jsonl"))
        assert quality_cli.main(["train", "--positive", pos, "--negative", neg, "--model", model]) == 0
        assert quality_cli.main(["score", mix, "-o", f"{base}/scored", "--model", model, "-q"]) == 0
        assert quality_cli.main(["annotate", f"{base}/scored/mix.jsonl", "-o", f"{base}/annotated", "-q"]) == 0
        filtered = ["filter", f"{base}/annotated/mix.jsonl", "-o", f"{base}/kept", "--threshold", "0.5"]
        assert quality_cli.main([*filtered, "--heuristics", "-q"]) == 0
    assert s3.get(f"s3://{bucket}/s3-model.npz") == (tmp_path / "local-model.npz").read_bytes()
    for folder in ("scored", "annotated", "kept"):
        assert written(s3.tree(f"s3://{bucket}/{folder}")) == written(local_tree(tmp_path / folder)), folder
    kept = s3.get(f"s3://{bucket}/kept/mix.jsonl")
    assert 0 < kept.count(b"\n") < len(prose[::3] + junk[::3])  # the filter kept some and dropped some


def test_merge_of_datasets_on_s3_into_s3_writes_the_bytes_of_a_local_merge(token_corpus, s3, tmp_path):
    from mtnlg_lightning.data.tokenizer import train_bpe

    bucket = s3.new_bucket()
    train_bpe([r["text"] for half in token_corpus for r in half], 300, tmp_path / "tok")
    preprocess = tool_main("preprocess_data")
    for i, half in enumerate(token_corpus):
        (tmp_path / f"half{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in half))
        args = ["--input", str(tmp_path / f"half{i}.jsonl"), "--tokenizer", str(tmp_path / "tok")]
        assert preprocess([*args, "--output-prefix", str(tmp_path / "parts" / f"p{i}"), "--no-progress"]) == 0
    s3.put_tree(tmp_path / "parts", f"s3://{bucket}/parts")
    local = [str(tmp_path / "parts" / "p0"), str(tmp_path / "parts" / "p1")]
    assert preprocess(["--merge", *local, "--output-prefix", str(tmp_path / "merged" / "all")]) == 0
    remote = [f"s3://{bucket}/parts/p0", f"s3://{bucket}/parts/p1"]
    assert preprocess(["--merge", *remote, "--output-prefix", f"s3://{bucket}/merged/all"]) == 0
    assert s3.tree(f"s3://{bucket}/merged") == local_tree(tmp_path / "merged")


def test_an_https_style_url_is_read_like_a_file(near_dups, s3, tmp_path):
    """http(s):// objects are read (here public objects of the S3 server, fetched by plain HTTP GETs)."""
    bucket = s3.new_bucket()
    specs = write_layout("zstd", tmp_path / "in", near_dups)
    for spec in specs:
        s3.put(f"s3://{bucket}/in/{Path(spec).name}", Path(spec).read_bytes(), public=True)
    urls = [f"{s3.endpoint}/{bucket}/in/{Path(spec).name}" for spec in specs]
    assert dedup_cli.main([*specs, "-o", str(tmp_path / "local"), "-q"]) == 0
    assert dedup_cli.main([*urls, "-o", str(tmp_path / "http"), "-q"]) == 0
    assert written(local_tree(tmp_path / "http")) == written(local_tree(tmp_path / "local"))
