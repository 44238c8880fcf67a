#!/usr/bin/env python
"""Decontamination benchmark: MB/s of training text with ~100k task n-grams loaded; local engine with 1 and 2
workers and the Ray engine on a running 2-CPU Ray instance, outputs checked byte-identical.

    python benchmarks/bench_decontaminate.py [--ngrams 100000] [--docs 15000 --repeats 3]

Throughput = training bytes / (count pass + clean pass) wall time; task loading is reported separately.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time

from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.curation.decontaminate import DecontamConfig, run_decontaminate  # noqa: E402
from mtnlg_lightning.demo.synthetic.near_duplicates import make_tasks_and_training  # noqa: E402


def run(tasks: str, train: str, out: str, workers: int, engine: str) -> dict:
    cfg = DecontamConfig([tasks], train, out, workers=workers, engine=engine, progress=False, shard_bytes=1 << 20)
    return run_decontaminate(cfg)


def main() -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--ngrams", type=int, default=100000, help="approximate number of task n-grams to load")
    ap.add_argument(
        "--docs", type=int, default=15000, help="training documents (~3.6 KB each; 15,000: 58 MB, ~3-9 s a run)"
    )
    add_rounds_arg(ap, 3, "--repeats", what=" of each engine setting")
    ap.add_argument("--skip-ray", action="store_true", help="do not run the Ray engine")
    args = benchmark_args(ap)
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
    warm = os.path.join(tmp, "warmup.jsonl")  # a slice of the training text, to start Ray's workers on
    with open(ip, "rb") as f, open(warm, "wb") as out:
        out.writelines(itertools.islice(f, 300))
    figures["training_mb"] = mb
    print(
        f"# bench_decontaminate (cpu cores visible: {os.cpu_count()}; "
        f"data generated in {time.perf_counter() - t0:.0f} s)"
    )
    # Rounds of: 1 local worker, 2 local workers, Ray on 2 CPUs; medians are compared (wall times of the same run
    # vary by up to ~25% on a shared machine, so settings measured in separate blocks of time are not comparable).
    # Ray is started (and warmed up) for its run of each round and stopped after it, so that its daemons do not
    # run beside the local engine's runs.
    per_round = [("local", 1), ("local", 2)] + ([] if args.skip_ray else [("ray", 2)])
    runs = per_round * args.repeats
    outputs, scans, reports = {}, {}, {}
    for k, (engine, workers) in enumerate(runs):
        if engine == "ray":
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            run(tp, warm, os.path.join(tmp, "ray-warmup.jsonl"), 1, "ray")  # workers started, modules imported
        c0 = time.process_time()
        out = os.path.join(tmp, f"out-{engine}{workers}.jsonl")
        rep = run(tp, ip, out, workers, engine)
        cpu = time.process_time() - c0 - rep["timings_s"]["load_tasks"]
        with open(out, "rb") as f:
            outputs[(engine, workers)] = f.read()
        tm = rep["timings_s"]
        scan = tm["count_pass"] + tm["clean_pass"]
        scans.setdefault((engine, workers), []).append(scan)
        reports[(engine, workers)] = rep
        name = f"{engine}, {workers} {'CPUs' if engine == 'ray' else 'workers' if workers > 1 else 'worker '}"
        line = (
            f"{name:16}: {mb / scan:6.2f} MB/s wall"
            f" ({mb:.1f} MB in {scan:.2f} s: count {tm['count_pass']:.2f} s + clean {tm['clean_pass']:.2f} s)"
        )
        if (engine, workers) == ("local", 1):
            line += f", {mb / cpu:6.2f} MB per CPU-s"
            figures.setdefault("mb_per_cpu_s_rounds", []).append(mb / cpu)
        if k == 0:
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
    median = {key: statistics.median(v) for key, v in scans.items()}
    for (engine, workers), s_ in median.items():
        figures["mb_per_s"][f"{engine}{workers}"] = mb / s_
    figures["mb_per_cpu_s"] = statistics.median(figures["mb_per_cpu_s_rounds"])
    one, two = median[("local", 1)], median[("local", 2)]
    rounds = [a / b for a, b in zip(scans[("local", 1)], scans[("local", 2)], strict=True)]
    figures["two_workers_ratio"] = one / two
    print(
        f"medians             : local 1 worker {mb / one:.2f} MB/s ({figures['mb_per_cpu_s']:.2f} MB per CPU-s);"
        f" 2 workers {mb / two:.2f} MB/s, x{one / two:.2f} (rounds {', '.join(f'{r:.2f}' for r in rounds)};"
        " target >= 1.7)"
    )
    if ("ray", 2) in median:
        figures["ray_vs_local_2w"] = two / median[("ray", 2)]
        print(
            f"                      ray 2 CPUs {mb / median[('ray', 2)]:.2f} MB/s,"
            f" x{two / median[('ray', 2)]:.2f} local 2 workers (target >= 0.8)"
        )
    identical = len(set(outputs.values())) == 1
    figures["outputs_identical"] = identical
    print(f"outputs identical   : {identical} ({', '.join(f'{e}{w}' for e, w in outputs)})")

    write_result(args.json, figures)


if __name__ == "__main__":
    main()
