"""The CPU benchmark suite: which script runs with which (small) options, and how its JSON becomes table rows.

Options are sized so the whole suite finishes in about 15 minutes on a 2-core machine; every row is
(figure, ours, baseline, ratio, target), both sides measured in the same run of that benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MB = 1e6


@dataclass
class Benchmark:
    name: str
    script: str
    args: list[str]
    rows: Callable[[dict | list], list[tuple]]  # JSON -> [(figure, ours, baseline, ratio, target)]


def _ratio(a, b):
    return a / b if b else float("nan")


def overhead_rows(d):
    return [
        (
            f"overhead: tokens/s, mtnlg fit vs plain PyTorch ({d['preset']}, seq {d['seq_len']})",
            d["mtnlg_fit_tokens_per_s"],
            d["plain_pytorch_tokens_per_s"],
            d["ratio"],
            ">= 0.95",
        )
    ]


def parallel_rows(d):
    rows = []
    for name, e in d["layouts"].items():
        rows.append(
            (
                f"parallel: {name} tokens/s vs 1 process (1 thread; ratio/2 = efficiency {e['efficiency']:.2f})",
                e["tokens_per_s"],
                d["single_tokens_per_s"],
                e["ratio_vs_single"],
                "2.0 ideal on 2 cores",
            )
        )
        for key, c in e["comm"].items():
            rows.append(
                (
                    f"parallel: {name} comm MB/rank/step {key} vs theory",
                    c["measured_bytes"] / MB,
                    c["theory_bytes"] / MB,
                    c["ratio"],
                    "1.00",
                )
            )
    shard = d.get("pp_sequence_shard")
    if shard:
        rows.append(
            (
                "parallel: PP activation bytes/micro-batch/rank, tp2_pp2 + SP vs tp2_pp2 (the sequence shard)",
                shard["tp2_pp2_sp"],
                shard["tp2_pp2"],
                shard["ratio"],
                "0.50 (1/TP)",
            )
        )
    rows += [(f"parallel: {note}", None, None, None, "") for note in d.get("notes", [])]
    return rows


def memory_rows(d):
    return [
        (
            f"memory: ZeRO-{r['zero']} dp={r['dp']} model-state MB/rank vs planner fp32 "
            f"(bf16 20 B/param: {r['planner_bf16_20_bytes'] / MB:.1f})",
            r["measured_max_rank"]["total"] / MB,
            r["planner_fp32"] / MB,
            r["ratio_measured_to_planner"],
            "1.00 +- 0.10",
        )
        for r in d
    ]


def pipeline_rows(d):
    out = []
    for r in d:
        theory = r["theory_interleaved"] if r["schedule"] == "interleaved_1f1b" else r["theory_1f1b"]
        idle = sum(r["idle_per_stage"]) / len(r["idle_per_stage"])
        out.append(
            (
                f"pipeline: {r['schedule']} pp={r['pp']} mb={r['microbatches']} idle fraction vs theory",
                idle,
                theory,
                _ratio(idle, theory),
                "~1 (+ per-op overhead)",
            )
        )
    return out


def compile_rows(d):
    eager = d["eager"]
    return [
        (
            f"compile: {name} step s vs eager ({d['preset']}, {d['device']}; first step {c['first_step_s']:.0f} s)",
            c["step_s"],
            eager["step_s"],
            _ratio(c["step_s"], eager["step_s"]),
            "< 1 (GPU: 10-30% faster)",
        )
        for name, c in d["compiled"].items()
    ]


def activation_rows(d):
    base = next((r for r in d if r["mode"] == "none"), d[0])
    out = []
    for r in d:
        if r is base:
            continue
        out.append(
            (
                f"activation ckpt: {r['mode']} step peak MiB vs none",
                r["step_peak_mib"],
                base["step_peak_mib"],
                _ratio(r["step_peak_mib"], base["step_peak_mib"]),
                "< 1",
            )
        )
        out.append(
            (
                f"activation ckpt: {r['mode']} step s vs none",
                r["step_s"],
                base["step_s"],
                _ratio(r["step_s"], base["step_s"]),
                "> 1 (recompute cost)",
            )
        )
    return out


def sequence_parallel_memory_rows(d):
    rows = d["rows"]
    none = next(r for r in rows if r["tp"] == 1)
    out = []
    for r in rows:
        if r is none:
            continue
        out.append(
            (
                f"activation memory/layer/rank: {r['layout']} vs no parallelism (MB; Korthikanti formula ratio)",
                r["measured_bytes"] / MB,
                none["measured_bytes"] / MB,
                r["measured_vs_none"],
                f"{r['formula_vs_none']:.3f}",
            )
        )
        if r["sp"]:
            tp = next(x for x in rows if x["tp"] == r["tp"] and not x["sp"])
            out.append(
                (
                    f"activation memory/layer/rank: {r['layout']} vs tp{r['tp']} (MB; formula ratio)",
                    r["measured_bytes"] / MB,
                    tp["measured_bytes"] / MB,
                    _ratio(r["measured_bytes"], tp["measured_bytes"]),
                    f"{r['formula_fp32_bytes'] / tp['formula_fp32_bytes']:.3f}",
                )
            )
    return out


def dedup_rows(d):
    rows = [
        (
            f"dedup: signature stage docs per CPU-s ({d['doc_kb']:.1f} KB docs)",
            d["signatures_docs_per_cpu_s"],
            None,
            None,
            ">= 3000",
        )
    ]
    if "datasketch_docs_per_s" in d:
        rows.append(
            (
                f"dedup: docs per CPU-s, ours (1 worker) vs naive datasketch ({d['docs']} docs)",
                d["ours_docs_per_cpu_s"],
                d["datasketch_docs_per_cpu_s"],
                _ratio(d["ours_docs_per_cpu_s"], d["datasketch_docs_per_cpu_s"]),
                ">= 15",
            )
        )
    rows.append(
        (
            "dedup: docs/s wall, local 2 workers vs 1",
            d["ours_2w_docs_per_s"],
            d["ours_docs_per_s"],
            _ratio(d["ours_2w_docs_per_s"], d["ours_docs_per_s"]),
            ">= 1.7 (idle 2 cores)",
        )
    )
    if "ray_2cpu_docs_per_s" in d:
        rows.append(
            (
                f"dedup: docs/s wall, Ray on 2 CPUs vs local 2 workers (outputs identical: {d['outputs_identical']})",
                d["ray_2cpu_docs_per_s"],
                d["ours_2w_docs_per_s"],
                _ratio(d["ray_2cpu_docs_per_s"], d["ours_2w_docs_per_s"]),
                ">= 0.8",
            )
        )
    for name, a in d.get("accuracy", {}).items():
        rows.append((f"dedup: recall J>=0.85 (clustered), {name}", a["recall_j085_clustered"], None, None, ">= 0.95"))
    return rows


def decontaminate_rows(d):
    w = d["mb_per_s"]
    rows = [
        (
            f"decontaminate: MB/s, local 2 workers vs 1 ({d['training_mb']:.1f} MB)",
            w.get("local2"),
            w.get("local1"),
            _ratio(w.get("local2", 0), w.get("local1", 0)),
            ">= 1.7 (idle 2 cores)",
        )
    ]
    if "ray2" in w:
        rows.append(
            (
                f"decontaminate: MB/s, Ray on 2 CPUs vs local 2 workers (outputs identical: {d['outputs_identical']})",
                w["ray2"],
                w.get("local2"),
                _ratio(w["ray2"], w.get("local2", 0)),
                ">= 0.8",
            )
        )
    return rows


def checkpoint_rows(d):
    rows = []
    for run in d["runs"]:
        n = run["ranks"]
        rows.append(
            (
                f"checkpoint: save MB/s on {n} rank(s) vs torch.save ({d['preset']}, weights + Adam)",
                run["model_state_bytes"] / run["save_s"] / MB,
                d["torch"]["bytes"] / d["torch"]["save_s"] / MB,
                run["save_bandwidth_vs_torch_save"],
                ">= 0.8",
            )
        )
        rows.append(
            (
                f"checkpoint: load s on {n} rank(s) vs torch.load (ratio = speed-up)",
                run["load_s"],
                d["torch"]["load_s"],
                run["load_speed_vs_torch_load"],
                "-",
            )
        )
        rows.append(
            (
                f"checkpoint: bytes on disk vs model-state bytes, {n} rank(s)",
                run["bytes_on_disk"] / MB,
                run["model_state_bytes"] / MB,
                run["disk_vs_model_state"],
                "<= 1.05",
            )
        )
    return rows


def export_rows(d):
    return [
        (
            f"export: peak RSS MB over importing torch + transformers, streamed into {d['shards_written']} shards vs "
            f"the whole model read first ({d['parameters'] / 1e6:.0f}M parameters, {d['max_shard_size_mb']:.0f} MB "
            f"shards)",
            d["stream_over_baseline_mb"],
            d["whole_over_baseline_mb"],
            _ratio(d["stream_over_baseline_mb"], d["whole_over_baseline_mb"]),
            f"ours <= 3 shards ({3 * d['max_shard_size_mb']:.0f} MB)",
        )
    ]


def generate_rows(d):
    rows = [
        (
            f"generate: tokens/s, mtnlg-generate vs transformers generate ({d['parameters'] / 1e6:.0f}M, "
            f"{d['dtype']}, batch {batch}, {d['new_tokens']} new tokens)",
            b["ours_tokens_per_s"],
            b["transformers_tokens_per_s"],
            b["ratio"],
            ">= 1.0",
        )
        for batch, b in d["batches"].items()
    ]
    kv = d["kv_cache"]
    rows.append(
        (
            "generate: tokens/s, KV cache vs recomputing the prefix (batch 1)",
            kv["cached_tokens_per_s"],
            kv["recompute_tokens_per_s"],
            kv["speedup"],
            "> 1",
        )
    )
    return rows


def eval_rows(d):
    return [
        (
            f"eval: LAMBADA docs/s, mtnlg-eval vs lm-eval hf ({d['documents']} docs, {d['parameters'] / 1e6:.0f}M, "
            f"acc {d['ours_acc']:.3f} vs {d['lm_eval_acc']:.3f})",
            d["ours_docs_per_s"],
            d["lm_eval_hf_docs_per_s"],
            d["ratio"],
            ">= 1.0",
        )
    ] + [
        (
            f"eval in layout {row['layout']} ({row['ranks']} ranks) vs one process, LAMBADA docs/s (stages busy "
            f"{', '.join(f'{b:.2f}' for b in row['stage_busy_fraction'])}; no speed-up expected on a small CPU)",
            row["docs_per_s"],
            d["layouts"][0]["docs_per_s"],
            row["docs_per_s"] / d["layouts"][0]["docs_per_s"],
            "-",
        )
        for row in d.get("layouts", [])[1:]
    ]


def finetune_rows(d):
    v, shares = d["variants"], d["row_shares"]
    ours = v["ours_lora"]
    shape = f"{d['model']['hidden']}x{d['model']['layers']} Llama, seq {d['seq_len']}"
    peers = {
        "trl_lora": ("TRL SFT+peft packed", ">= 1.5"),
        "trl_lora_unpacked": ("TRL SFT+peft unpacked", ">= 1.5"),
        "litgpt_lora": ("litgpt finetune_lora", ">= 1.0"),
    }
    rows, key = [], f"tokens_per_{d['unit']}"
    per = "CPU-s" if d["unit"] == "cpu_s" else "s"
    for name, (label, target) in peers.items():
        if name in v:
            rows.append(
                (
                    f"finetune: LoRA document tokens/{per}, ours packed vs {label} ({shape})",
                    ours[key],
                    v[name][key],
                    _ratio(ours[key], v[name][key]),
                    target,
                )
            )
    if "litgpt_lora" not in v:
        rows.append((f"finetune: litgpt not run: {d['litgpt'].get('unavailable')}", None, None, None, ""))
    packed, unpacked = shares["packed"], shares["unpacked"]
    for key, label in (("token_share", "document tokens"), ("trained_share", "trained tokens")):
        rows.append(
            (
                f"finetune: {label} / row positions, packed vs one example per row",
                packed[key],
                unpacked[key],
                _ratio(packed[key], unpacked[key]),
                "> 1",
            )
        )
    if "ours_full" in v:
        full = v["ours_full"]
        rows.append(
            (
                f"finetune: peak memory MiB, ours LoRA vs full fine-tuning ({d['device']})",
                ours["peak_memory_bytes"] / 2**20,
                full["peak_memory_bytes"] / 2**20,
                _ratio(ours["peak_memory_bytes"], full["peak_memory_bytes"]),
                "< 1",
            )
        )
        rows.append(
            (
                "finetune: model-state MiB (params, grads, Adam moments), ours LoRA vs full fine-tuning",
                ours["state_bytes"]["total"] / 2**20,
                full["state_bytes"]["total"] / 2**20,
                _ratio(ours["state_bytes"]["total"], full["state_bytes"]["total"]),
                "< 1",
            )
        )
    return rows


def output_layer_rows(d):
    rows = []
    for r in d["rows"]:
        shape = f"{d['tokens']} tokens x hidden {d['hidden']}, vocab {r['vocab']}"
        one, chunked = r["one piece"], r["chunked (auto)"]
        rows.append((f"output layer: peak +MiB, one piece vs chunked ({shape})", one["peak_added_mib"],
                     chunked["peak_added_mib"], r["memory_ratio"], ">= 2 at 128k+"))  # fmt: skip
        rows.append((f"output layer: s/step, chunked vs one piece ({shape})", chunked["seconds"], one["seconds"],
                     r["time_ratio"], "<= 1.1"))  # fmt: skip
    return rows


def grpo_rows(d):
    v, m = d["variants"], d["model"]
    shape = (
        f"{m['hidden']}x{m['layers']} Llama, vocab {m['vocab']}, {d['prompts']}x{d['generations']}x"
        f"{d['completion_length']} tokens, LoRA r{d['lora']['rank']}, {d['threads']} thread(s)"
    )
    ours, rows = v["ours"], []
    for name, label in (("trl", "TRL GRPOTrainer+peft"), ("trl_recompute", "TRL with its gradient checkpointing")):
        if name in v:
            # per CPU-second of the process: on the shared machine the wall clock measures the neighbours
            for key, what in (("steps_per_cpu_s", "steps/CPU-s"), ("tokens_per_cpu_s", "generated tokens/CPU-s")):
                figure = f"grpo: {what}, ours vs {label} ({shape})"
                rows.append((figure, ours[key], v[name][key], _ratio(ours[key], v[name][key]), ">= 1.5"))
    for name, f in v.items():
        split = ", ".join(f"{k} {s:.2f}" for k, s in f["split_s"].items())
        rows.append((f"grpo: {name} CPU-s/step; wall s/step: {split}", f["step_cpu_s"], None, None, "-"))
    return rows


def readers_rows(d):
    rows = []
    names = {"zst": ("jsonl.zst", ".jsonl.zst"), "parquet": ("parquet", "parquet")}
    for tool, unit, key in (("dedup", "docs", "docs_per_cpu_s"), ("preprocess", "tokens", "tokens_per_cpu_s")):
        r = d[tool]
        for short, (fmt, label) in names.items():
            rows.append(
                (
                    f"readers: {tool} {unit}/CPU-s, {label} vs plain .jsonl",
                    r[key][fmt],
                    r[key]["jsonl"],
                    r[f"{short}_vs_plain"],
                    ">= 0.9",
                )
            )
    p = d["preprocess"]
    rows.append(
        (
            "readers: preprocess_data tokens/CPU-s vs tokenizers encode_batch of the texts in memory",
            p["tokens_per_cpu_s"]["jsonl"],
            p["ceiling_tokens_per_cpu_s"],
            p["plain_vs_ceiling"],
            "1.0 = the ceiling",
        )
    )
    return rows


def crawl_rows(d):
    ex, fl = d["extract"], d["filters"]
    rows = [
        (
            "crawl: read docs per CPU-s (records to decoded HTML), ours (warcio + resync) vs datatrove WarcReader",
            d["read"]["ours_docs_per_cpu_s"],
            d["read"].get("datatrove_docs_per_cpu_s"),
            _ratio(d["read"]["ours_docs_per_cpu_s"], d["read"].get("datatrove_docs_per_cpu_s", 0)),
            ">= 1",
        )
    ]
    peer = ex.get("datatrove_trafilatura", {})
    for name in ("ours_justext", "ours_trafilatura"):
        if name in ex:
            e = ex[name]
            rows.append(
                (
                    f"crawl: extract docs per CPU-s, {name} vs datatrove Trafilatura ({d['html_kb_per_page']:.1f} KB "
                    f"pages; body kept {e['body_words_kept']:.3f} vs {peer.get('body_words_kept', float('nan')):.3f}, "
                    f"boilerplate left {e['boilerplate_words_left']:.3f})",
                    e["docs_per_cpu_s"],
                    peer.get("docs_per_cpu_s"),
                    _ratio(e["docs_per_cpu_s"], peer.get("docs_per_cpu_s", 0)),
                    "body >= 0.9, boilerplate <= 0.1",
                )
            )
    rows.append(
        ("crawl: language id (pyCLD2) docs per CPU-s", d["language"]["ours_cld2_docs_per_cpu_s"], None, None, "-")
    )
    rows.append(
        (
            "crawl: heuristic filters docs per CPU-s, ours (12 Gopher/C4 rules) vs datatrove Gopher x2 + C4",
            fl["ours_all_rules_docs_per_cpu_s"],
            fl.get("datatrove_all_three_docs_per_cpu_s"),
            _ratio(fl["ours_all_rules_docs_per_cpu_s"], fl.get("datatrove_all_three_docs_per_cpu_s", 0)),
            ">= 1",
        )
    )
    rows.append(
        ("crawl: quality classifier scoring docs per CPU-s", d["classifier"]["ours_docs_per_cpu_s"], None, None, "-")
    )
    rows.append(
        (
            "crawl: mtnlg-extract end to end records per CPU-s",
            d["end_to_end"]["ours_records_per_cpu_s"],
            None,
            None,
            "-",
        )
    )
    rows += [(f"crawl: {note}", None, None, None, "") for note in d.get("notes", [])]
    return rows


def crawl_languages_rows(d):
    ex = d["extractors"]
    c = d["crawl"]
    rows = []
    for key, label, target in (
        ("non_english_pages_kept_right_language", "non-English pages kept with the right language", ">= 0.95"),
        ("article_words_kept", "article words kept (every page)", ">= 0.95"),
        ("boilerplate_words_left", "boilerplate words left", "<= 0.05"),
        ("pages_per_cpu_s", "HTML pages per CPU-s", "-"),
    ):
        rows.append(
            (
                f"crawl languages: {label}, trafilatura (default) vs jusText ({c['non_english_pages']} pages in "
                f"{c['languages']} languages + {c['english_pages']} English)",
                ex["trafilatura"][key],
                ex["justext"][key],
                _ratio(ex["trafilatura"][key], ex["justext"][key]),
                target,
            )
        )
    rows.append(
        (
            "crawl languages: non-English pages kept, jusText vs jusText with the stop words of the HTML's language",
            ex["justext"]["non_english_pages_kept_right_language"],
            ex["justext_from_markup"]["non_english_pages_kept_right_language"],
            _ratio(
                ex["justext"]["non_english_pages_kept_right_language"],
                ex["justext_from_markup"]["non_english_pages_kept_right_language"],
            ),
            ">= 0.95",
        )
    )
    return rows


SUITE = [
    Benchmark(
        "overhead",
        "bench_overhead.py",
        [
            "--preset",
            "gpt3-125m",
            "--seq-len",
            "128",
            "--micro-batch",
            "2",
            "--global-batch",
            "2",
            "--steps",
            "4",
            "--repeats",
            "2",
        ],
        overhead_rows,
    ),
    Benchmark("parallel", "bench_parallel.py", ["--rounds", "2", "--steps", "5"], parallel_rows),
    Benchmark(
        "parallel_sp_pipeline",
        "bench_parallel.py",
        ["--world", "4", "--layouts", "tp2_pp2", "tp2_pp2_sp", "--rounds", "1", "--steps", "3", "--warmup", "1"],
        parallel_rows,
    ),
    Benchmark("memory", "bench_memory.py", ["--dp", "2", "4"], memory_rows),
    Benchmark(
        "pipeline", "bench_pipeline.py", ["--pp", "2", "4", "--microbatches", "4", "8", "--steps", "2"], pipeline_rows
    ),
    Benchmark(
        "activation_checkpointing",
        "bench_activation_checkpointing.py",
        ["--layers", "4", "--seq", "512", "--steps", "2"],
        activation_rows,
    ),
    # the demo preset: big enough that the blocks dominate the step; inductor's first compile is minutes here
    Benchmark("compile", "bench_compile.py", ["--preset", "demo", "--batch", "4", "--steps", "4"], compile_rows),
    Benchmark(
        "sequence_parallel_memory",
        "bench_sequence_parallel_memory.py",
        ["--hidden", "256", "--heads", "8", "--seq", "1024", "--batch", "2"],
        sequence_parallel_memory_rows,
    ),
    Benchmark(
        "dedup", "bench_dedup.py", ["--docs", "1500", "--scale-docs", "0", "--accuracy-docs", "1000"], dedup_rows
    ),
    Benchmark("readers", "bench_readers.py", ["--docs", "2000", "--rounds", "3", "--vocab", "4096"], readers_rows),
    Benchmark("decontaminate", "bench_decontaminate.py", ["--ngrams", "20000", "--docs", "2000"], decontaminate_rows),
    Benchmark("checkpoint", "bench_checkpoint.py", ["--ranks", "1", "2", "4"], checkpoint_rows),
    # one thread: on the shared 2-core machine two threads per op stall whenever another process runs
    Benchmark(
        "generate", "bench_generate.py", ["--batches", "1", "8", "--repeats", "1", "--threads", "1"], generate_rows
    ),
    Benchmark("eval", "bench_eval.py", ["--repeats", "2"], eval_rows),
    Benchmark("finetune", "bench_finetune.py", ["--rounds", "2", "--steps", "6"], finetune_rows),
    # SmolLM2-135M's shape, one thread (as generate: two threads per op stall whenever another process runs)
    Benchmark("grpo", "bench_grpo.py", ["--steps", "3", "--threads", "1"], grpo_rows),
    Benchmark("output_layer", "bench_output_layer.py", ["--repeats", "2"], output_layer_rows),
    Benchmark("export", "bench_export.py", ["--layers", "8", "--max-shard-size", "50MB"], export_rows),
    Benchmark("crawl", "bench_crawl.py", ["--copies", "1", "--english-pages", "100"], crawl_rows),
    Benchmark("crawl_languages", "bench_crawl_languages.py", ["--seeds", "1"], crawl_languages_rows),
]
