#!/usr/bin/env python
"""Export memory: peak resident memory of `mtnlg-export-hf` streaming into shards, beside importing torch and
transformers alone (the baseline) and beside exporting with the whole model read into memory first (as the export
did before it streamed), each measured in its own subprocess in the same run.

    python benchmarks/bench_export.py [--layers 24 --hidden 1024 --heads 16 --vocab 50257 --max-shard-size 100MB]

The default model is GPT-2 medium's shape, ~355M parameters (1.42 GB in fp32). Its checkpoint is written in the
project's format (model-space tensors in a rank file, manifest last), streamed with random values
(testing/synthetic_checkpoint.py). Peak RSS is the child's VmHWM from /proc (it counts pages of memory-mapped files
the process touched, as the kernel charges them; `ru_maxrss` is not used: after fork and exec it starts from the
parent's size).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: testing.*
from model_shape import add_model_shape_args  # noqa: E402
from results import benchmark_args, benchmark_parser, write_result  # noqa: E402

from testing.synthetic_checkpoint import write_synthetic_checkpoint  # noqa: E402

PROBE = """
import re, sys
import torch, transformers  # the baseline: what importing the two costs
mode, argv = sys.argv[1], sys.argv[2:]
if mode == "stream":
    from mtnlg_lightning.interop.export_cli import main
    assert main(argv) == 0
elif mode == "whole":  # the previous export: every tensor read into one dict first
    from mtnlg_lightning.checkpoint import ModelState
    from mtnlg_lightning.interop.hf import export_hf, read_source
    state = read_source(argv[0])
    whole = ModelState(state.config, {name: state.weights[name] for name in state.weights}, state.hparams)
    export_hf(whole, argv[1], max_shard_size=argv[3])
# VmHWM: this process's own peak (ru_maxrss would start from the parent's size at the fork)
print("peak_rss_bytes", int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024)
"""


def peak_rss(mode: str, *args: str) -> tuple[int, float]:
    """(peak resident bytes, seconds) of one probe subprocess."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE, mode, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench_export: {mode} failed:\n{out.stderr[-3000:]}")
    return int(re.search(r"peak_rss_bytes (\d+)", out.stdout)[1]), time.perf_counter() - started


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__)
    add_model_shape_args(parser, layers=24, hidden=1024, heads=16, vocab=50257)
    parser.add_argument("--max-shard-size", default="100MB", help="shard size of the export (default 100MB)")
    parser.add_argument("--skip-whole", action="store_true", help="do not run the whole-model export for contrast")
    args = benchmark_args(parser, argv)
    from mtnlg_lightning.checkpoint.safetensors_shards import parse_size

    shard = parse_size(args.max_shard_size)
    work = Path(tempfile.mkdtemp(prefix="bench_export."))
    try:
        checkpoint = write_synthetic_checkpoint(work / "ckpt", args.layers, args.hidden, args.vocab, args.heads)
        model_bytes = (checkpoint / "rank-00000.safetensors").stat().st_size
        export_args = (str(checkpoint), str(work / "out"), "--max-shard-size", args.max_shard_size)
        baseline, _ = peak_rss("baseline")
        stream, stream_s = peak_rss("stream", *export_args)
        shards = len(list((work / "out").glob("*.safetensors")))
        results = {
            "parameters": model_bytes // 4,
            "model_mb": model_bytes / 1e6,
            "max_shard_size_mb": shard / 1e6,
            "shards_written": shards,
            "baseline_peak_rss_mb": baseline / 1e6,
            "stream_peak_rss_mb": stream / 1e6,
            "stream_over_baseline_mb": (stream - baseline) / 1e6,
            "stream_over_baseline_shards": (stream - baseline) / shard,
            "stream_seconds": stream_s,
        }
        if not args.skip_whole:
            shutil.rmtree(work / "out")
            whole, whole_s = peak_rss("whole", *export_args)
            results.update(
                whole_peak_rss_mb=whole / 1e6, whole_over_baseline_mb=(whole - baseline) / 1e6, whole_seconds=whole_s
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"export of a {results['parameters'] / 1e6:,.0f}M-parameter checkpoint ({results['model_mb']:,.0f} MB fp32) "
        f"in {shards} shards of <= {args.max_shard_size}:"
    )
    r = results
    print(f"  import torch + transformers  {r['baseline_peak_rss_mb']:8,.0f} MB peak RSS (the baseline)")
    print(
        f"  streaming export             {r['stream_peak_rss_mb']:8,.0f} MB  +{r['stream_over_baseline_mb']:,.0f} MB = "
        f"{r['stream_over_baseline_shards']:.2f} shards over the baseline ({r['stream_seconds']:.1f} s)"
    )
    if "whole_peak_rss_mb" in r:
        print(
            f"  whole model read first       {r['whole_peak_rss_mb']:8,.0f} MB  +{r['whole_over_baseline_mb']:,.0f} MB "
            f"over the baseline ({r['whole_seconds']:.1f} s)"
        )
    write_result(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
