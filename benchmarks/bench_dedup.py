#!/usr/bin/env python
"""Dedup benchmark: speed vs a straightforward datasketch pipeline, worker scaling, memory, accuracy.

    python benchmarks/bench_dedup.py                 # defaults: 4k docs speed, 100k docs memory, 4k accuracy
    python benchmarks/bench_dedup.py --docs 2000 --scale-docs 20000 --accuracy-docs 2000   # quicker

Prints:
  1. docs/s of our pipeline (1 worker = per core) vs the naive datasketch pipeline (per-document
     MinHash(num_perm=260), update() per shingle, MinHashLSH(threshold=0.8) query + insert) on the same corpus
     of ~3.6 KB English-like documents, in the same run, and the ratio;
  2. our pipeline with 1 vs 2 workers;
  3. signature bytes/doc and the peak RSS of a 100k-document run (separate process);
  4. accuracy (recall by Jaccard bucket, precision) of the default settings vs --preset mtnlg.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import mtnlg_lightning.curation  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(ROOT, "src"))

from mtnlg_lightning.curation.dedup import DedupConfig, run_dedup  # noqa: E402
from mtnlg_lightning.curation.lsh import MTNLG_BANDING  # noqa: E402
from mtnlg_lightning.curation.shingles import normalize_words  # noqa: E402
from mtnlg_lightning.curation.synthetic import evaluate_dedup, make_near_dup_corpus  # noqa: E402


def write_corpus(path: str, n: int, seed: int) -> float:
    recs = make_near_dup_corpus(n, seed=seed, doc_chars=3600, dup_fraction=0.3)
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return os.path.getsize(path) / n


def naive_datasketch(path: str, out_path: str, num_perm: int = 260, threshold: float = 0.8) -> tuple[float, int, float]:
    """The straightforward pipeline: per-document MinHash, update() per shingle, MinHashLSH query + insert."""
    from datasketch import MinHash, MinHashLSH

    t0, c0 = time.perf_counter(), time.process_time()
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    kept = 0
    with open(path, encoding="utf-8") as f, open(out_path, "w", encoding="utf-8") as out:
        for i, line in enumerate(f):
            text = json.loads(line)["text"]
            words = normalize_words(text)
            m = MinHash(num_perm=num_perm)
            for k in range(max(1, len(words) - 4)):
                m.update(" ".join(words[k : k + 5]).encode("utf-8"))
            if not lsh.query(m):
                lsh.insert(i, m)
                out.write(line)
                kept += 1
    return time.perf_counter() - t0, kept, time.process_time() - c0


def ours(path: str, out_dir: str, workers: int) -> tuple[float, dict, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    rep = run_dedup(DedupConfig([path], out_dir, workers=workers, progress=False, force=True, shard_bytes=4 << 20))
    return time.perf_counter() - t0, rep, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4000, help="speed-comparison corpus size (both pipelines)")
    ap.add_argument("--scale-docs", type=int, default=100000, help="memory run size (0 to skip)")
    ap.add_argument("--accuracy-docs", type=int, default=4000, help="accuracy corpus size (0 to skip)")
    ap.add_argument("--skip-naive", action="store_true", help="do not run the datasketch baseline")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    figures = {}
    tmp = tempfile.mkdtemp(prefix="bench_dedup_")
    print(f"# bench_dedup (cpu cores visible: {os.cpu_count()}, work dir {tmp})")

    corpus = os.path.join(tmp, "speed.jsonl")
    avg = write_corpus(corpus, args.docs, seed=1)
    n = args.docs
    print(f"\n## 1. speed on {n} docs of {avg / 1000:.2f} KB (30% near/exact duplicates)")
    t1, rep1, c1 = ours(corpus, os.path.join(tmp, "o1"), 1)
    print(
        "(docs/s per core: wall-clock rate of a 1-process run, and docs per CPU-second of that process,"
        " which is robust to other load on a shared machine)"
    )
    print(
        f"ours, 1 worker        : {n / t1:8.0f} docs/s wall, {n / c1:8.0f} docs/CPU-s"
        f"  ({t1:.2f} s; stages {rep1['timings_s']})"
    )
    figures.update(docs=n, ours_docs_per_s=n / t1, ours_docs_per_cpu_s=n / c1)
    if not args.skip_naive:
        tn, kept, cn = naive_datasketch(corpus, os.path.join(tmp, "naive.jsonl"))
        figures.update(datasketch_docs_per_s=n / tn, datasketch_docs_per_cpu_s=n / cn)
        print(
            f"naive datasketch      : {n / tn:8.0f} docs/s wall, {n / cn:8.0f} docs/CPU-s  ({tn:.2f} s;"
            f" kept {kept}, ours kept {rep1['totals']['docs_out']})"
        )
        print(f"speed-up              : {tn / t1:8.1f} x wall, {cn / c1:.1f} x CPU")
    t2, rep2, _ = ours(corpus, os.path.join(tmp, "o2"), 2)
    print(
        f"\n## 2. workers\nours, 1 worker        : {n / t1:8.0f} docs/s\nours, 2 workers       : {n / t2:8.0f} docs/s"
        f"  (x{t1 / t2:.2f}; signatures stage {rep1['timings_s']['signatures']:.2f}s -> "
        f"{rep2['timings_s']['signatures']:.2f}s)"
    )

    if args.scale_docs:
        big = os.path.join(tmp, "scale.jsonl")
        t0 = time.perf_counter()
        avg_b = write_corpus(big, args.scale_docs, seed=2)
        gen_s = time.perf_counter() - t0
        out = os.path.join(tmp, "oscale")
        t0 = time.perf_counter()
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "dedup.py"), big, "-o", out, "-q"],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        if p.returncode != 0:
            print(p.stderr)
            raise SystemExit(1)
        rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        rep = json.load(open(os.path.join(out, "report.json")))
        print(
            f"\n## 3. memory: {args.scale_docs} docs of {avg_b / 1000:.2f} KB ({os.path.getsize(big) / 1e6:.0f} MB;"
            f" generated in {gen_s:.0f} s)"
        )
        print(f"signature bytes/doc   : {rep['signature_bytes_per_doc']} ({rep['settings']['num_perm']} x uint32)")
        print(f"peak RSS              : {rss_mb:.0f} MB (whole CLI process, 1 worker)")
        print(
            f"throughput            : {args.scale_docs / wall:.0f} docs/s wall, {args.scale_docs / cpu:.0f} docs/CPU-s,"
            f" end-to-end incl. start-up ({wall:.1f} s wall, {cpu:.1f} CPU-s; stages {rep['timings_s']})"
        )
        print(f"pairs                 : {rep['pairs']}")
        print(f"result                : {rep['totals']}")

    if args.accuracy_docs:
        recs = make_near_dup_corpus(args.accuracy_docs, seed=3, doc_chars=3600, dup_fraction=0.4)
        print(
            f"\n## 4. accuracy on {args.accuracy_docs} labelled docs"
            " (ground truth: exact Jaccard of word:5 shingle sets)"
        )
        print(
            f"{'setting':22} {'pairs J>=.85':>12} {'recall':>14} {'pairs .80-.85':>13} {'recall':>14} "
            f"{'precision':>9} {'P(cand|.8)':>10}"
        )
        for name, kw in (("default 32x8", {}), ("--preset mtnlg 20x13", {"banding": MTNLG_BANDING})):
            r = evaluate_dedup(recs, os.path.join(tmp, "acc-" + name.split()[0].strip("-")), **kw)
            hi, mid = r["J>=0.85"], r["0.80<=J<0.85"]
            figures.setdefault("accuracy", {})[name] = {
                "recall_j085_clustered": hi["recall_clustered"],
                "precision": r["precision_verified_pairs"],
            }
            p8 = r["report"]["banding"]["candidate_probability"]["0.80"]
            print(
                f"{name:22} {hi['pairs']:12d} {hi['recall_direct']:6.3f}/{hi['recall_clustered']:6.3f} "
                f"{mid['pairs']:13d} {mid['recall_direct']:6.3f}/{mid['recall_clustered']:6.3f} "
                f"{r['precision_verified_pairs']:9.4f} {p8:10.3f}"
            )
        print(
            "recall shown as direct/clustered: direct = the pair itself became an LSH candidate (then verified);"
            " clustered = both documents ended up in the same duplicate cluster"
        )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
