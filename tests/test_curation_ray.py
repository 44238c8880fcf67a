"""The Ray engine: same bytes as the local engine, a killed worker is retried, a killed run resumes, bad input is
the same one-line error. One Ray instance (2 CPUs) is shared by the module: starting Ray costs seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import curation_faults
import pytest
from curation_faults import Faults, SimulatedCrash

from mtnlg_lightning.curation.decontaminate import DecontamConfig, run_decontaminate
from mtnlg_lightning.curation.dedup import DedupConfig, run_dedup
from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus, make_tasks_and_training

ray = pytest.importorskip("ray")
# Ray workers do not have tests/ on their path: the fault hooks travel to them by value.
ray.cloudpickle.register_pickle_by_value(curation_faults)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a Ray cluster: GCS, raylet and worker processes
TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The labelled near-duplicate corpus in two inputs, and the local engine's outputs on it."""
    d = tmp_path_factory.mktemp("corpus")
    recs = make_near_dup_corpus(240, seed=8, doc_chars=1500)
    inputs = [write_jsonl(d / "web.jsonl", recs[:160]), write_jsonl(d / "books.jsonl", recs[160:])]
    ref = run_dedup(dedup_config(inputs, d / "local", engine="local"))
    return inputs, d / "local", ref


def dedup_config(inputs, out, **kw):
    kw.setdefault("engine", "ray")
    return DedupConfig(
        list(inputs), str(out), priority=["books.jsonl"], shard_bytes=48 << 10, progress=False, force=True, **kw
    )


def outputs(d):
    return {n: (Path(d) / n).read_bytes() for n in ("web.jsonl", "books.jsonl", "duplicates.jsonl")}


def test_ray_dedup_is_byte_identical_to_local(ray_address, corpus, tmp_path):
    inputs, local, ref = corpus
    rep = run_dedup(dedup_config(inputs, tmp_path / "ray"))
    assert rep["settings"]["engine"] == "ray" and rep["signature_shards"]["total"] >= 4
    assert ref["totals"]["near_duplicates_removed"] > 10  # the corpus has near duplicates to find
    assert outputs(tmp_path / "ray") == outputs(local)
    assert rep["totals"] == ref["totals"] and rep["pairs"] == ref["pairs"] and rep["clusters"] == ref["clusters"]


def test_ray_decontaminate_is_byte_identical_to_local(ray_address, tmp_path):
    tasks, docs = make_tasks_and_training(60, 80, seed=4, doc_chars=1500, plant_fraction=0.3)
    t, i = write_jsonl(tmp_path / "tasks.jsonl", tasks), write_jsonl(tmp_path / "train.jsonl", docs)
    reps = {}
    for engine in ("local", "ray"):
        out = str(tmp_path / engine / "clean.jsonl")
        reps[engine] = run_decontaminate(DecontamConfig([t], i, out, engine=engine, shard_bytes=20000, progress=False))
    assert reps["ray"]["hits"]["documents"] >= 10
    assert (tmp_path / "ray" / "clean.jsonl").read_bytes() == (tmp_path / "local" / "clean.jsonl").read_bytes()
    assert reps["ray"]["documents"] == reps["local"]["documents"] and reps["ray"]["hits"] == reps["local"]["hits"]


def test_ray_worker_killed_mid_stage_is_retried(ray_address, corpus, tmp_path):
    inputs, local, _ = corpus
    flag = tmp_path / "killed"
    with Faults(kill_worker_in="verify", kill_worker_flag=str(flag)):
        rep = run_dedup(dedup_config(inputs, tmp_path / "ray"))
    assert flag.exists()  # a worker died in the middle of the verify stage ...
    assert rep["resumed_stages"] == []  # ... Ray ran its task again inside the same run
    assert outputs(tmp_path / "ray") == outputs(local)


def test_ray_killed_run_resumes_identical(ray_address, corpus, tmp_path):
    inputs, local, _ = corpus
    killed_under_local = dedup_config(inputs, tmp_path / "ray", engine="local")
    with pytest.raises(SimulatedCrash):  # the same work files whatever the engine: a local run resumes on Ray
        with Faults(crash_at="buckets:task5", raise_instead=True):
            run_dedup(killed_under_local)
    cfg = dedup_config(inputs, tmp_path / "ray")
    cfg.force = False
    with pytest.raises(SimulatedCrash), Faults(crash_at="verify:task3", raise_instead=True):
        run_dedup(cfg)
    assert not (tmp_path / "ray" / "report.json").exists() and not (tmp_path / "ray" / "web.jsonl").exists()
    rep = run_dedup(cfg)
    assert rep["resumed_stages"] == ["signatures", "buckets"]
    assert outputs(tmp_path / "ray") == outputs(local)


@pytest.mark.parametrize("tool", ["dedup", "decontaminate"])
def test_bad_input_under_ray_is_one_line_exit_2(ray_address, tmp_path, tool):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "one two three four five six seven eight"}] * 3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n' * 40 + '{"text": broken\n')
    out = tmp_path / "out"
    if tool == "dedup":
        args = [good, bad, "-o", out]
    else:
        args = ["--tasks", good, "--input", bad, "--output", out / "clean.jsonl"]
    env = {k: v for k, v in os.environ.items() if k != "MTNLG_CURATION_CRASH_AT"}
    p = subprocess.run(
        [sys.executable, str(TOOLS / f"{tool}.py"), *map(str, args), "-q", "--engine", "ray"],
        capture_output=True,
        text=True,
        env={**env, "RAY_ADDRESS": ray_address},
        timeout=300,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "bad.jsonl:41: invalid JSON" in lines[0]
    assert not out.exists()  # nothing partial left behind
