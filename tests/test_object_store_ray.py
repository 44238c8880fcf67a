"""--engine ray with inputs and outputs on S3 (moto's server on 127.0.0.1) writes the bytes of a local run, and
needs no file system shared with the driver: each Ray worker works in a folder of its own, filled from the store.
One Ray instance (2 CPUs) for the module."""

import json
import os
from pathlib import Path

import pytest
from corpus_layouts import write_layout
from object_store import local_tree

from mtnlg_lightning.curation import decontaminate_cli, dedup_cli
from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus, make_tasks_and_training

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a Ray cluster: GCS, raylet and worker processes


@pytest.fixture(scope="module")
def workers_cache(s3, tmp_path_factory):
    """A local Ray whose workers see the S3 server (the environment at ray.init) and keep their copies of work
    folders in a cache of their own; yields that cache."""
    cache = tmp_path_factory.mktemp("workers-cache")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"MTNLG_CACHE": str(cache), **s3.env}},
    )
    yield cache
    ray.shutdown()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTNLG_CACHE", str(tmp_path / "cache"))


def on_s3(s3, bucket, root, specs, name):
    s3.put_tree(root, f"s3://{bucket}/{name}")
    return [spec.replace(str(root), f"s3://{bucket}/{name}") for spec in specs]


def without_reports(tree):
    return {k: v for k, v in tree.items() if not k.endswith("report.json")}


def worker_copies(cache: Path) -> set[str]:
    """The worker processes (by pid) that kept a copy of a work folder."""
    return {p.name for p in (cache / "ray-mirror").iterdir()} if (cache / "ray-mirror").exists() else set()


def test_ray_dedup_from_s3_to_s3_needs_no_shared_folder_and_writes_the_local_bytes(s3, workers_cache, tmp_path):
    records = make_near_dup_corpus(200, seed=9, doc_chars=900)
    bucket = s3.new_bucket()
    specs = write_layout("folder", tmp_path / "in", [records[:100], records[100:]])
    urls = on_s3(s3, bucket, tmp_path / "in", specs, "in")
    assert dedup_cli.main([*specs, "-o", str(tmp_path / "local"), "-q", "--shard-mb", "1"]) == 0
    args = [*urls, "-o", f"s3://{bucket}/out", "-q", "--shard-mb", "1", "--engine", "ray"]
    assert dedup_cli.main(args) == 0
    tree = s3.tree(f"s3://{bucket}/out")
    assert without_reports(tree) == without_reports(local_tree(tmp_path / "local"))
    assert json.loads(tree["report.json"])["settings"]["engine"] == "ray"
    assert worker_copies(workers_cache) - {str(os.getpid())}  # the tasks ran on the workers' own copies
    assert not [k for k in s3.keys(f"s3://{bucket}/out") if k.startswith(".")]  # the work twin is gone


def test_ray_decontaminate_from_s3_to_s3_writes_the_local_bytes(s3, workers_cache, tmp_path):
    tasks, docs = make_tasks_and_training(40, 80, seed=6, doc_chars=1000, plant_fraction=0.3)
    bucket = s3.new_bucket()
    task_specs = write_layout("plain", tmp_path / "tasks", [tasks, tasks[:1]])[:1]
    task_urls = on_s3(s3, bucket, tmp_path / "tasks", task_specs, "tasks")
    specs = write_layout("parquet", tmp_path / "in", [docs[:40], docs[40:]])
    urls = on_s3(s3, bucket, tmp_path / "in", specs, "in")
    common = ["-q", "--shard-mb", "1"]
    local = ["--tasks", *task_specs, "--input", *specs, "--output-dir", str(tmp_path / "local"), *common]
    remote = ["--tasks", *task_urls, "--input", *urls, "--output-dir", f"s3://{bucket}/out", *common]
    assert decontaminate_cli.main(local) == 0
    assert decontaminate_cli.main([*remote, "--engine", "ray"]) == 0
    tree = s3.tree(f"s3://{bucket}/out")
    assert without_reports(tree) == without_reports(local_tree(tmp_path / "local"))
    assert json.loads(tree["report.json"])["hits"]["documents"] >= 5


def test_ray_extract_from_s3_to_s3_writes_the_local_bytes(s3, workers_cache, tmp_path):
    for module in ("warcio", "trafilatura", "justext", "pycld2", "lxml_html_clean"):
        pytest.importorskip(module)
    from mtnlg_lightning.crawl import extract_cli
    from mtnlg_lightning.demo.synthetic.warc import CrawlSpec, write_synthetic_warc

    (tmp_path / "in").mkdir()
    write_synthetic_warc(tmp_path / "in" / "crawl.warc.gz", CrawlSpec(english_pages=10, pages_per_language=1, seed=2))
    bucket = s3.new_bucket()
    (url,) = on_s3(s3, bucket, tmp_path / "in", [str(tmp_path / "in" / "crawl.warc.gz")], "crawl")
    assert extract_cli.main([str(tmp_path / "in" / "crawl.warc.gz"), "-o", str(tmp_path / "local"), "-q"]) == 0
    assert extract_cli.main([url, "-o", f"s3://{bucket}/text", "-q", "--engine", "ray"]) == 0
    tree = s3.tree(f"s3://{bucket}/text")
    assert without_reports(tree) == without_reports(local_tree(tmp_path / "local"))
    assert json.loads(tree["extract_report.json"])["engine"] == "ray"
