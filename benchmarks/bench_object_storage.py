#!/usr/bin/env python
"""Object storage against local disk, side by side in one run: dedup and preprocessing reading their inputs from
a local S3 server (moto's, on 127.0.0.1, started here) and writing their outputs there, and the same runs on local
files; and the bound of the training data's block cache, measured.

    python benchmarks/bench_object_storage.py                 # 4,000 docs (~15 MB as .jsonl.zst), 2 rounds
    python benchmarks/bench_object_storage.py --docs 10000 --rounds 3 --json results.json

Prints, all measured in this run:
  1. tools/dedup.py and tools/preprocess_data.py (1 worker) as subprocesses, whole process (start, imports,
     reading, work, writing, the commit): wall seconds and MB (of JSON) per second, and MB per CPU-second (the
     tool's processes plus, for S3, the server's work in this process: on a shared machine the CPU figures move
     far less than the wall ones), local disk vs the S3 server, medians of interleaved rounds, the ratios
     S3/local, and whether the outputs are the same bytes. The S3 server is moto's, a Python server: a request
     costs it far more than it costs S3 or MinIO, so the ratios are a pessimistic bound of what object storage
     costs a run.
  2. The block cache of datasets named by URLs: two processes read random samples of one indexed dataset on the
     S3 server through one cache folder with a bound a quarter of the dataset's size; the folder's size sampled
     every 2 ms while they run, the largest size seen against the bound, and the samples checked against the
     local file.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# one thread per tokenizer (the tools' subprocesses inherit it): rayon's idle threads spin, and their CPU time would
# be counted against whichever run the machine's other load slowed down
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import zstandard  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.data.tokenizer import train_bpe  # noqa: E402
from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus  # noqa: E402

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def start_s3() -> tuple[object, str]:
    """moto's S3 server on 127.0.0.1 (a free port); this process's environment (and so the tools') pointed at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    return server, endpoint


def s3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    )


def cpu_seconds() -> float:
    """CPU seconds of this process (the S3 server's threads) and of its finished children (the tools)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_tool(args: list[str], log: str) -> tuple[float, float]:
    """Wall and CPU seconds of ``python tools/<args>`` as a subprocess, the whole process (and the S3 server's
    work for it)."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    if done.returncode != 0:
        print(open(log).read())
        raise SystemExit(f"{args[0]} failed (exit {done.returncode})")
    return wall, cpu


def bench_tools(client, bucket: str, corpus: str, json_bytes: int, tok_dir: str, tmp: str, rounds: int) -> dict:
    """Dedup and preprocessing of ``corpus`` local -> local and S3 -> S3, interleaved; medians."""
    size_mb = json_bytes / 1e6  # the documents' JSON, what the tools read (the file is zstd)
    name = os.path.basename(corpus)
    url = f"s3://{bucket}/in/{name}"
    tools = os.path.join(ROOT, "tools")
    runs = {
        "dedup": lambda out: [f"{tools}/dedup.py", corpus if out == "local" else url, "-q", "--workers", "1"],
        "preprocess": lambda out: [
            f"{tools}/preprocess_data.py",
            "--input",
            corpus if out == "local" else url,
            "--tokenizer",
            tok_dir,
            "--no-progress",
        ],
    }
    walls: dict[str, dict[str, list[float]]] = {t: {"local": [], "s3": []} for t in runs}
    cpus: dict[str, dict[str, list[float]]] = {t: {"local": [], "s3": []} for t in runs}
    for r in range(rounds):
        for tool, args in runs.items():
            for where in ("local", "s3"):  # interleaved: load changes on a shared machine hit both sides
                out = os.path.join(tmp, f"{tool}-local") if where == "local" else f"s3://{bucket}/{tool}-out"
                flag = ["-o", out, "--force"] if tool == "dedup" else ["--output-prefix", f"{out}/c"]
                wall, cpu = run_tool([*args(where), *flag], os.path.join(tmp, f"{tool}-{where}-{r}.log"))
                walls[tool][where].append(wall)
                cpus[tool][where].append(cpu)
                print(
                    f"  round {r + 1} {tool:10} {where:5}: {wall:6.2f} s  {size_mb / wall:6.2f} MB/s  "
                    f"{cpu:6.2f} CPU-s  {size_mb / cpu:6.2f} MB/CPU-s",
                    flush=True,
                )
    same = {
        "dedup": all(
            open(os.path.join(tmp, "dedup-local", n), "rb").read() == get(client, bucket, f"dedup-out/{n}")
            for n in (name, "duplicates.jsonl")
        ),
        "preprocess": all(
            open(os.path.join(tmp, "preprocess-local", f"c{s}"), "rb").read()
            == get(client, bucket, f"preprocess-out/c{s}")
            for s in (".bin", ".idx")
        ),
    }
    figures = {}
    for tool in runs:
        local, s3 = (statistics.median(walls[tool][w]) for w in ("local", "s3"))
        cpu_local, cpu_s3 = (statistics.median(cpus[tool][w]) for w in ("local", "s3"))
        figures[tool] = {
            "wall_s": {"local": local, "s3": s3},
            "mb_per_s": {"local": size_mb / local, "s3": size_mb / s3},
            "s3_vs_local": local / s3,
            "cpu_s": {"local": cpu_local, "s3": cpu_s3},
            "mb_per_cpu_s": {"local": size_mb / cpu_local, "s3": size_mb / cpu_s3},
            "s3_vs_local_per_cpu_s": cpu_local / cpu_s3,
            "rounds_wall_s": walls[tool],
            "rounds_cpu_s": cpus[tool],
            "outputs_identical": same[tool],
        }
    return figures


def get(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def _read_samples(url_prefix: str, cache_dir: str, max_bytes: int, block_bytes: int, seed: int, n: int, q) -> None:
    """A reader process: ``n`` random GPT samples of the dataset at ``url_prefix`` through the shared cache;
    puts the samples' checksum."""
    from mtnlg_lightning.corpora.block_cache import BlockCache
    from mtnlg_lightning.data.gpt_dataset import GPTDataset
    from mtnlg_lightning.data.indexed import IndexedDataset

    dataset = IndexedDataset(url_prefix, BlockCache(cache_dir, max_bytes, block_bytes))
    samples = GPTDataset(dataset, (0, dataset.num_documents), 512, n, seed)
    order = np.random.default_rng(seed).permutation(len(samples))[:n]
    q.put((seed, [int(samples[int(i)].astype(np.int64).sum()) for i in order]))


def bench_cache(client, bucket: str, prefix: str, tmp: str, samples: int) -> dict:
    """Two processes reading one dataset through one cache folder bounded at a quarter of the dataset."""
    from mtnlg_lightning.corpora.block_cache import BLOCK_SUFFIX
    from mtnlg_lightning.data.gpt_dataset import GPTDataset
    from mtnlg_lightning.data.indexed import IndexedDataset

    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as f:
            client.put_object(Bucket=bucket, Key=f"data/c{suffix}", Body=f.read())
    bin_bytes = os.path.getsize(prefix + ".bin")
    block = 256 << 10
    bound = max(2 * block, (bin_bytes // 4) // block * block)
    cache_dir = os.path.join(tmp, "blocks")
    os.makedirs(cache_dir)
    largest, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            total = 0
            for entry in os.scandir(cache_dir):
                if entry.name.endswith(BLOCK_SUFFIX):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
            largest[0] = max(largest[0], total)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    url = f"s3://{bucket}/data/c"
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_read_samples, args=(url, cache_dir, bound, block, s, samples, q)) for s in (1, 2)]
    for p in procs:
        p.start()
    got = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    local = IndexedDataset(prefix)
    expected = {}
    for seed in (1, 2):
        ds = GPTDataset(local, (0, local.num_documents), 512, samples, seed)
        order = np.random.default_rng(seed).permutation(len(ds))[:samples]
        expected[seed] = [int(ds[int(i)].astype(np.int64).sum()) for i in order]
    return {
        "dataset_bytes": bin_bytes,
        "block_bytes": block,
        "bound_bytes": bound,
        "readers": len(procs),
        "samples_per_reader": samples,
        "largest_seen_bytes": largest[0],
        "within_bound": largest[0] <= bound,
        "samples_match_local": got == expected,
        "wall_s": wall,
    }


def main() -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--docs", type=int, default=4000, help="documents of the corpus (~3.6 KB each)")
    add_rounds_arg(ap, 2)
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary of the preprocessing runs")
    ap.add_argument("--cache-samples", type=int, default=400, help="random samples each cache reader takes")
    args = benchmark_args(ap)
    tmp = tempfile.mkdtemp(prefix="bench_object_storage_")
    os.environ["MTNLG_CACHE"] = os.path.join(tmp, "cache")  # scratch folders and fetched tokenizers: here
    print(f"# bench_object_storage (cpu cores visible: {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, work {tmp})")
    server, endpoint = start_s3()
    try:
        client = s3_client(endpoint)
        bucket = "bench"
        client.create_bucket(Bucket=bucket)
        records = make_near_dup_corpus(args.docs, seed=1, doc_chars=3600)
        data = "".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in records).encode()
        corpus = os.path.join(tmp, "corpus.jsonl.zst")
        with open(corpus, "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3).compress(data))
        client.upload_file(corpus, bucket, "in/corpus.jsonl.zst")
        tok_dir = os.path.join(tmp, "tok")
        train_bpe([r["text"] for r in records[:2000]], args.vocab, tok_dir)
        print(
            f"\n## 1. whole tools, 1 worker: {args.docs} docs, {len(data) / 1e6:.1f} MB of JSON lines as "
            f"{os.path.getsize(corpus) / 1e6:.1f} MB of .jsonl.zst (MB/s: of the JSON)"
        )
        tools = bench_tools(client, bucket, corpus, len(data), tok_dir, tmp, args.rounds)
        for tool, f in tools.items():
            print(
                f"{tool:10} wall: local {f['wall_s']['local']:6.2f} s ({f['mb_per_s']['local']:.2f} MB/s)  "
                f"S3 {f['wall_s']['s3']:6.2f} s ({f['mb_per_s']['s3']:.2f} MB/s)  S3/local {f['s3_vs_local']:.3f}; "
                f"CPU: local {f['mb_per_cpu_s']['local']:.2f} MB/CPU-s  S3 {f['mb_per_cpu_s']['s3']:.2f} MB/CPU-s  "
                f"S3/local {f['s3_vs_local_per_cpu_s']:.3f}; identical outputs: {f['outputs_identical']}"
            )
        print("\n## 2. the block cache: two readers, one folder, a bound of a quarter of the dataset")
        cache = bench_cache(client, bucket, os.path.join(tmp, "preprocess-local", "c"), tmp, args.cache_samples)
        print(
            f"dataset {cache['dataset_bytes'] / 1e6:.2f} MB, blocks of {cache['block_bytes'] >> 10} KiB, bound "
            f"{cache['bound_bytes'] / 1e6:.2f} MB; largest size seen {cache['largest_seen_bytes'] / 1e6:.2f} MB "
            f"(within the bound: {cache['within_bound']}); samples equal local: {cache['samples_match_local']}"
        )
        write_result(args.json, {"docs": args.docs, "rounds": args.rounds, "tools": tools, "cache": cache})
    finally:
        server.stop()


if __name__ == "__main__":
    main()
