#!/usr/bin/env python
"""Reader-layer benchmark: dedup and preprocessing throughput on .jsonl.zst and parquet vs plain .jsonl, the
tokenizing tool vs the tokenizers library's own batch encoding, and peak memory on a corpus of gigabytes.

    python benchmarks/bench_readers.py                       # 6,000 docs (~22 MB) per format, 3 rounds
    python benchmarks/bench_readers.py --big-gb 1 --docs 0   # only the large-corpus memory runs

Prints, all measured in this run on the same records (~3.6 KB English-like documents, 30% near duplicates):
  1. mtnlg-dedup (1 worker) on plain .jsonl, .jsonl.zst and parquet (row groups of 1,000): docs per CPU-second
     (this process and its children: a shared machine's other load does not count), medians of the rounds, and
     the ratios zst/plain and parquet/plain (target >= 0.9); outputs checked to hold the same records.
  2. tools/preprocess_data.py's work (preprocess(), 1 worker) on the three formats: tokens per CPU-second, same
     ratios; and against the ceiling: the tokenizers library's encode_batch on the same texts already in memory
     (tokens per CPU-second of the encode alone; the ratio is the share of the ceiling the whole tool reaches).
  3. --big-gb N [--big-preprocess-gb M]: a corpus of N GB of JSON lines (.jsonl.zst, written in a stream, never
     held in memory) through tools/dedup.py (1 worker), one of M GB through tools/preprocess_data.py (2 workers),
     as subprocesses; peak RSS of each (ru_maxrss of the child and its workers), beside the same runs on a quarter
     of the size: bounded memory means the two are about equal.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

# one thread per tokenizer: figures per core, the tool and the library's encode_batch alike (rayon's idle threads
# spin, and their CPU time would be counted against whichever side calls with smaller batches)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import zstandard  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.corpora.formats import detect  # noqa: E402
from mtnlg_lightning.corpora.readers import iter_raw  # noqa: E402
from mtnlg_lightning.curation.dedup import DedupConfig, run_dedup  # noqa: E402
from mtnlg_lightning.data.preprocess import preprocess  # noqa: E402
from mtnlg_lightning.data.tokenizer import Tokenizer, train_bpe  # noqa: E402
from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus  # noqa: E402

FORMATS = ("jsonl", "jsonl.zst", "parquet")


def cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def write_formats(records: list[dict], base: str) -> dict[str, str]:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    paths = {f: f"{base}.{f}" for f in FORMATS}
    with open(paths["jsonl"], "wb") as f:
        f.write(data)
    with open(paths["jsonl.zst"], "wb") as f:
        f.write(zstandard.ZstdCompressor(level=3).compress(data))
    pq.write_table(pa.Table.from_pylist(records), paths["parquet"], row_group_size=1000)
    return paths


def records_of(path: str) -> list:
    return [json.loads(x) if isinstance(x, bytes) else x for _, x in iter_raw(path, detect(path))]


def median(xs: list[float]) -> float:
    return float(np.median(xs))


def bench_dedup(paths: dict[str, str], n: int, tmp: str, rounds: int) -> dict:
    rates: dict[str, list[float]] = {f: [] for f in FORMATS}
    outs = {}
    for r in range(rounds):
        for f, path in paths.items():  # interleaved rounds: load changes on a shared machine hit every format
            out = os.path.join(tmp, f"dedup-{f}")
            c0 = cpu_seconds()
            rep = run_dedup(DedupConfig([path], out, workers=1, progress=False, force=True))
            rates[f].append(n / (cpu_seconds() - c0))
            outs[f] = os.path.join(out, rep["inputs"][0]["output"])
            print(f"  round {r + 1} dedup {f:10}: {rates[f][-1]:8.0f} docs/CPU-s  stages {rep['timings_s']}")
    same = all(records_of(outs[f]) == records_of(outs["jsonl"]) for f in FORMATS)
    med = {f: median(v) for f, v in rates.items()}
    return {
        "docs_per_cpu_s": med,
        "zst_vs_plain": med["jsonl.zst"] / med["jsonl"],
        "parquet_vs_plain": med["parquet"] / med["jsonl"],
        "outputs_same_records": same,
    }


def bench_preprocess(paths: dict[str, str], tok_dir: str, tmp: str, rounds: int) -> dict:
    rates: dict[str, list[float]] = {f: [] for f in FORMATS}
    ceiling: list[float] = []
    texts = [r["text"] for r in records_of(paths["jsonl"])]
    tok = Tokenizer(tok_dir)
    outputs = {}
    for r in range(rounds):
        for f, path in paths.items():
            prefix = os.path.join(tmp, f"pre-{f}")
            c0 = cpu_seconds()
            s = preprocess([path], tok_dir, prefix, progress=False)
            rates[f].append(s.tokens / (cpu_seconds() - c0))
            outputs[f] = open(prefix + ".bin", "rb").read()
            print(f"  round {r + 1} preprocess {f:10}: {rates[f][-1]:10.0f} tokens/CPU-s")
        c0 = cpu_seconds()
        encoded = tok._tok.encode_batch(texts, add_special_tokens=False)
        tokens = sum(len(e.ids) for e in encoded) + len(texts)  # + EOD, as the tool counts them
        ceiling.append(tokens / (cpu_seconds() - c0))
        print(f"  round {r + 1} tokenizers encode_batch (in memory): {ceiling[-1]:10.0f} tokens/CPU-s")
    med = {f: median(v) for f, v in rates.items()}
    return {
        "tokens_per_cpu_s": med,
        "zst_vs_plain": med["jsonl.zst"] / med["jsonl"],
        "parquet_vs_plain": med["parquet"] / med["jsonl"],
        "ceiling_tokens_per_cpu_s": median(ceiling),
        "plain_vs_ceiling": med["jsonl"] / median(ceiling),
        "outputs_identical": all(outputs[f] == outputs["jsonl"] for f in FORMATS),
    }


def write_big(targets: dict[str, float], seed: int) -> dict[str, tuple[int, int]]:
    """Corpora of ``targets[path]`` GB of JSON lines as .jsonl.zst, each a prefix of one stream written once (never
    held in memory): a block of 2,000 generated documents (30% near duplicates), then copies of it with every
    document's words shuffled (new shingles: unique documents with the same word statistics) and fresh ids.
    Returns (JSON bytes, documents) of each."""
    block = make_near_dup_corpus(2000, seed=seed, doc_chars=3600)
    sizes = {p: [int(gb * 1e9), 0, 0] for p, gb in targets.items()}  # target, bytes, docs
    raws = {p: open(p, "wb") for p in targets}
    outs = {p: zstandard.ZstdCompressor(level=3).stream_writer(raws[p]) for p in targets}
    rep = 0
    while any(b < t for t, b, _ in sizes.values()):
        rng = np.random.default_rng(rep)
        for r in block:
            text = r["text"]
            if rep:
                words = text.split(" ")
                text = " ".join([words[i] for i in rng.permutation(len(words))])
            line = (json.dumps({"id": f"{rep}-{r['id']}", "text": text}) + "\n").encode()
            for p, size in sizes.items():
                if size[1] < size[0]:
                    outs[p].write(line)
                    size[1] += len(line)
                    size[2] += 1
        rep += 1
    for p in targets:
        outs[p].close()  # closes the file too
    return {p: (b, d) for p, (_, b, d) in sizes.items()}


def child_run(cmd: list[str], log: str) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MB) of a tool run as a subprocess (output to ``log``). The peak is
    the largest sum of the RSS of the tool and its worker processes, sampled every 50 ms: ``ru_maxrss`` of a
    child would start at this (larger) process's RSS, which Linux carries over fork and exec."""
    import psutil

    t0 = time.perf_counter()
    peak = 0
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        proc = psutil.Process(p.pid)
        while p.poll() is None:
            try:
                tree = [proc, *proc.children(recursive=True)]
                peak = max(peak, sum(x.memory_info().rss for x in tree))
            except psutil.Error:  # a process of the tree ended between listing and reading it
                pass
            time.sleep(0.05)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        print(open(log).read())
        raise SystemExit(1)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru.ru_utime + ru.ru_stime - child_run.cpu_so_far
    child_run.cpu_so_far += cpu
    return wall, cpu, peak / 2**20


child_run.cpu_so_far = 0.0


def bench_big(dedup_gb: float, preprocess_gb: float, tok_dir: str, tmp: str, keep: str | None = None) -> dict:
    """Peak RSS of dedup on ``dedup_gb`` and a quarter of it, and of preprocessing (2 workers) on
    ``preprocess_gb`` and a quarter of it (all prefixes of one generated stream). A size of 0 skips that tool.
    ``keep``: a folder where the corpora are kept, and found again by a later run (generation is seeded)."""
    gb = {
        "dedup-quarter": dedup_gb / 4,
        "dedup-full": dedup_gb,
        "pre-quarter": preprocess_gb / 4,
        "pre-full": preprocess_gb,
    }
    gb = {k: v for k, v in gb.items() if v > 0}
    folder = keep or tmp
    os.makedirs(folder, exist_ok=True)
    paths = {k: os.path.join(folder, f"{k}-{v:g}GB.jsonl.zst") for k, v in gb.items()}
    t0 = time.perf_counter()
    made = {p: tuple(json.load(open(p + ".json"))) for p in paths.values() if os.path.exists(p + ".json")}
    missing = {paths[k]: v for k, v in gb.items() if paths[k] not in made}
    if missing:
        made |= write_big(missing, seed=7)
        for p in missing:
            with open(p + ".json", "w") as f:  # written last: the corpus beside it is complete
                json.dump(made[p], f)
    print(f"  generated in {time.perf_counter() - t0:.0f} s ({len(gb) - len(missing)} of {len(gb)} kept from before)")
    result = {}
    for k, path in paths.items():
        nbytes, docs = made[path]
        out = os.path.join(tmp, f"out-{k}")
        if k.startswith("dedup"):
            cmd = [sys.executable, os.path.join(ROOT, "tools", "dedup.py"), path, "-o", out, "-q", "--workers", "1"]
        else:
            cmd = [
                sys.executable,
                os.path.join(ROOT, "tools", "preprocess_data.py"),
                "--input",
                path,
                "--tokenizer",
                tok_dir,
                "--output-prefix",
                out,
                "--no-progress",
                "--workers",
                "2",
            ]
        wall, cpu, rss = child_run(cmd, os.path.join(tmp, f"{k}.log"))
        rate = f"{docs / cpu:6.0f} docs/CPU-s" if k.startswith("dedup") else f"{nbytes / 1e6 / cpu:6.2f} MB/CPU-s"
        print(
            f"  {k:13}: {nbytes / 1e9:5.2f} GB JSON ({os.path.getsize(path) / 1e9:.2f} GB zstd), {docs} docs:"
            f" {wall:6.0f} s wall, {cpu:6.0f} CPU-s, {rate}, peak RSS {rss:5.0f} MB"
        )
        result[k] = {"json_bytes": nbytes, "docs": docs, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss}
        if not keep:
            os.unlink(path)
        shutil.rmtree(out, ignore_errors=True)
        for suffix in (".bin", ".idx"):
            if os.path.exists(out + suffix):
                os.unlink(out + suffix)
    return result


def main() -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--docs", type=int, default=6000, help="documents of the format comparison (0: skip it)")
    add_rounds_arg(ap, 3)
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained for the preprocessing runs")
    ap.add_argument("--big-gb", type=float, default=0.0, help="size of the large-corpus dedup run (0: skip)")
    ap.add_argument(
        "--big-preprocess-gb",
        type=float,
        default=None,
        help="size of the preprocessing run (default: --big-gb; 0: skip)",
    )
    ap.add_argument(
        "--big-keep",
        metavar="DIR",
        help="keep the large corpora in DIR (and use the ones a previous run left there) instead of deleting them",
    )
    args = benchmark_args(ap)
    tmp = tempfile.mkdtemp(prefix="bench_readers_")
    print(f"# bench_readers (cpu cores visible: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, work {tmp})")
    sample = make_near_dup_corpus(2000, seed=11, doc_chars=3600)
    tok_dir = os.path.join(tmp, "tok")
    train_bpe([r["text"] for r in sample], args.vocab, tok_dir)
    figures: dict = {"vocab": args.vocab}
    if args.docs:
        records = [{"id": r["id"], "text": r["text"]} for r in make_near_dup_corpus(args.docs, seed=1, doc_chars=3600)]
        paths = write_formats(records, os.path.join(tmp, "corpus"))
        sizes = {f: os.path.getsize(p) / 1e6 for f, p in paths.items()}
        print(f"\n## corpus: {args.docs} docs; " + ", ".join(f"{f} {mb:.1f} MB" for f, mb in sizes.items()))
        print("\n## 1. dedup, 1 worker")
        d = bench_dedup(paths, args.docs, tmp, args.rounds)
        print("dedup docs/CPU-s (medians): " + ", ".join(f"{f} {v:.0f}" for f, v in d["docs_per_cpu_s"].items()))
        print(
            f"dedup zst/plain {d['zst_vs_plain']:.3f}, parquet/plain {d['parquet_vs_plain']:.3f} (target >= 0.9);"
            f" same records out: {d['outputs_same_records']}"
        )
        print("\n## 2. preprocessing, 1 worker")
        p = bench_preprocess(paths, tok_dir, tmp, args.rounds)
        print(
            "preprocess tokens/CPU-s (medians): " + ", ".join(f"{f} {v:.0f}" for f, v in p["tokens_per_cpu_s"].items())
        )
        print(
            f"preprocess zst/plain {p['zst_vs_plain']:.3f}, parquet/plain {p['parquet_vs_plain']:.3f} (target >= 0.9);"
            f" identical .bin: {p['outputs_identical']}"
        )
        print(
            f"preprocess plain vs tokenizers encode_batch in memory ({p['ceiling_tokens_per_cpu_s']:.0f} tokens/CPU-s):"
            f" {p['plain_vs_ceiling']:.3f}"
        )
        figures.update(docs=args.docs, sizes_mb=sizes, dedup=d, preprocess=p)
    if args.big_gb or args.big_preprocess_gb:
        pre_gb = args.big_gb if args.big_preprocess_gb is None else args.big_preprocess_gb
        print(f"\n## 3. large corpora as .jsonl.zst: dedup {args.big_gb} GB, preprocessing {pre_gb} GB, and quarters")
        figures["big"] = bench_big(args.big_gb, pre_gb, tok_dir, tmp, args.big_keep)
    write_result(args.json, figures)


if __name__ == "__main__":
    main()
