#!/usr/bin/env python
"""Decontamination benchmark: MB/s of training text with ~100k task n-grams loaded; local engine with 1 and 2
workers and the Ray engine on a running 2-CPU Ray instance, outputs checked byte-identical.

    python benchmarks/bench_decontaminate.py [--ngrams 100000] [--docs 5000]

Throughput = training bytes / (count pass + clean pass) wall time; task loading is reported separately.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import mtnlg_lightning.curation  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(ROOT, "src"))

from mtnlg_lightning.curation.decontaminate import DecontamConfig, run_decontaminate  # noqa: E402
from mtnlg_lightning.curation.synthetic import make_tasks_and_training  # noqa: E402


def run(tasks: str, train: str, out: str, workers: int, engine: str) -> dict:
    cfg = DecontamConfig([tasks], train, out, workers=workers, engine=engine, progress=False, shard_bytes=1 << 20)
    return run_decontaminate(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ngrams", type=int, default=100000, help="approximate number of task n-grams to load")
    ap.add_argument("--docs", type=int, default=5000, help="training documents (~3.6 KB each)")
    ap.add_argument("--skip-ray", action="store_true", help="do not run the Ray engine")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_decontam_")
    figures = {"training_mb": None, "mb_per_s": {}}
    n_tasks = max(1, int(args.ngrams / 13.5))  # tasks of 14-40 words: ~15 13-grams each; 10% short tasks: 1
    t0 = time.perf_counter()
    tasks, docs = make_tasks_and_training(n_tasks, args.docs, seed=7, doc_chars=3600, plant_fraction=0.05)
    tp, ip = os.path.join(tmp, "tasks.jsonl"), os.path.join(tmp, "train.jsonl")
    for path, recs in ((tp, tasks), (ip, docs)):
        with open(path, "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    mb = os.path.getsize(ip) / 1e6
    figures["training_mb"] = mb
    print(
        f"# bench_decontaminate (cpu cores visible: {os.cpu_count()}; "
        f"data generated in {time.perf_counter() - t0:.0f} s)"
    )
    runs = [("local", 1), ("local", 2)] + ([] if args.skip_ray else [("ray", 2)])
    outputs = {}
    for engine, workers in runs:
        if engine == "ray":
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            run(tp, ip, os.path.join(tmp, "ray-warmup.jsonl"), 1, "ray")  # workers started, modules imported
        c0 = time.process_time()
        out = os.path.join(tmp, f"out-{engine}{workers}.jsonl")
        rep = run(tp, ip, out, workers, engine)
        cpu = time.process_time() - c0 - rep["timings_s"]["load_tasks"]
        with open(out, "rb") as f:
            outputs[(engine, workers)] = f.read()
        tm = rep["timings_s"]
        figures["mb_per_s"][f"{engine}{workers}"] = rep["mb_per_s"]
        scan = tm["count_pass"] + tm["clean_pass"]
        name = f"{engine}, {workers} {'CPUs' if engine == 'ray' else 'workers' if workers > 1 else 'worker '}"
        line = (
            f"{name:16}: {rep['mb_per_s']:6.2f} MB/s wall"
            f" ({mb:.1f} MB in {scan:.2f} s: count {tm['count_pass']:.2f} s + clean {tm['clean_pass']:.2f} s)"
        )
        if (engine, workers) == ("local", 1):
            figures["mb_per_cpu_s"] = mb / cpu
            line += f", {mb / cpu:6.2f} MB per CPU-s"
            print(
                f"task n-grams loaded : {rep['tasks']['ngrams']} (by length {rep['tasks']['ngrams_by_length']});"
                f" load {tm['load_tasks']:.2f} s"
            )
            d = rep["documents"]
            print(
                f"documents           : {d['in']} in, {d['records_out']} out; {rep['hits']['documents']} hit;"
                f" {d['split']} split, {d['trimmed']} trimmed,"
                f" {d['dropped_too_many_splits'] + d['dropped_no_piece_left']} dropped"
            )
        print(line)
        if engine == "ray":
            ray.shutdown()
    identical = len(set(outputs.values())) == 1
    figures["outputs_identical"] = identical
    print(f"outputs identical   : {identical} ({', '.join(f'{e}{w}' for e, w in outputs)})")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
