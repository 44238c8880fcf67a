#!/usr/bin/env python
"""Generation speed: tokens/s of `mtnlg_lightning.inference.decode.generate` vs transformers' `generate`, side by side.

Both run the same random model, GPT-2 (default ~125M: 12 layers, hidden 768, vocabulary 50257) or Llama
(`--family llama`: RoPE, RMSNorm, SwiGLU, `--kv-heads` for grouped-query attention, untied head); ours reads the
very same tensors from the directory transformers saved, through the Hugging Face import. The same dtype and
number of threads, greedy, exactly
--new-tokens new tokens from the same random prompt, at batch 1 and 8 (the same prompt sampled 8 times). Rounds
alternate the two; medians are compared. Also: our KV cache against re-running the whole prefix for every token.

Ours runs as `mtnlg-generate` runs it (`load_model(..., for_generation=True)`: the weights in the generation layout).
Transformers runs its normal fast path: `generate` with its default cache (DynamicCache), sdpa attention, inference
mode, an explicit all-ones attention mask (else it may infer padding from a prompt token equal to the pad id), no
end-of-text id (so no logits processor is needed to force exactly --new-tokens tokens: the lengths are asserted).

    python benchmarks/bench_generate.py [--layers 12 --hidden 768 --new-tokens 128 --batches 1 8 --repeats 3]
    python benchmarks/bench_generate.py --family llama --layers 16 --hidden 1024 --heads 16 --kv-heads 4 --vocab 32000
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from model_shape import add_model_shape_args  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.inference.decode import generate  # noqa: E402
from mtnlg_lightning.inference.load import load_model  # noqa: E402


def build_pair(args, positions: int, dtype: torch.dtype, tmp: Path):
    """A random transformers model (GPT-2 or Llama) and ours holding the same weights, loaded from the saved
    directory by our one loader as `mtnlg-generate` loads it (the weights in the generation layout)."""
    import transformers

    torch.manual_seed(0)
    if args.family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.ffn or 256 * ((8 * args.hidden // 3 + 255) // 256),
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads or args.heads,
            max_position_embeddings=positions,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        )
        theirs = transformers.LlamaForCausalLM(config).eval()
    else:
        config = transformers.GPT2Config(
            vocab_size=args.vocab, n_positions=positions, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads
        )
        theirs = transformers.GPT2LMHeadModel(config).eval()
    theirs.generation_config.eos_token_id = None  # never stop early (ours is given no eos_id either)
    theirs.save_pretrained(tmp)
    ours, _ = load_model(tmp, args.device, dtype, for_generation=True)
    return theirs.to(args.device, dtype), ours


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    ap = benchmark_parser(__doc__)
    add_model_shape_args(ap, layers=12, hidden=768, heads=12, vocab=50257)
    ap.add_argument("--family", default="gpt2", choices=["gpt2", "llama"], help="the block of both models")
    ap.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default: --heads)")
    ap.add_argument("--ffn", type=int, default=None, help="llama: SwiGLU width (default ~8/3 hidden, x256)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    add_rounds_arg(ap, 3, "--repeats", what=" per setting")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (both sides)")
    args = benchmark_args(ap)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        theirs, ours = build_pair(args, args.prompt_tokens + args.new_tokens, dtype, Path(tmp))
    params = sum(p.numel() for p in theirs.parameters())
    prompt = torch.randint(0, args.vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    n = args.new_tokens
    threads = torch.get_num_threads()
    print(
        f"# bench_generate: {args.family}, {params / 1e6:.0f}M parameters, {args.dtype}, {threads} threads, "
        f"{n} new tokens"
    )
    result = {"family": args.family, "parameters": params, "dtype": args.dtype, "threads": threads, "new_tokens": n}
    result["device"] = args.device
    result["batches"] = {}

    def run_ours(batch, use_cache=True):
        out = generate(ours, prompt, n, temperature=0, num_samples=batch, use_cache=use_cache)
        assert all(len(t) == n for t in out.tokens)
        return out.tokens

    def run_theirs(batch):
        ids = torch.tensor([prompt] * batch, device=args.device)
        with torch.inference_mode():
            mask = torch.ones_like(ids)
            out = theirs.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(prompt) + n
        return out[:, len(prompt) :].tolist()

    same = run_ours(1) == run_theirs(1)  # also the warm-up (allocator, kernels)
    print(f"same greedy tokens as transformers (batch 1): {same}")
    result["same_greedy_tokens"] = same
    for batch in args.batches:
        ours_s, theirs_s = [], []
        for _ in range(args.repeats):
            ours_s.append(timed(lambda b=batch: run_ours(b)))
            theirs_s.append(timed(lambda b=batch: run_theirs(b)))
        o, t = batch * n / statistics.median(ours_s), batch * n / statistics.median(theirs_s)
        result["batches"][batch] = {"ours_tokens_per_s": o, "transformers_tokens_per_s": t, "ratio": o / t}
        print(f"batch {batch}: mtnlg {o:8.1f} tokens/s | transformers {t:8.1f} tokens/s | ratio {o / t:.2f}")
    cached = statistics.median(timed(lambda: run_ours(1)) for _ in range(args.repeats))
    recomputed = statistics.median(timed(lambda: run_ours(1, use_cache=False)) for _ in range(max(1, args.repeats - 1)))
    result["kv_cache"] = {
        "cached_tokens_per_s": n / cached,
        "recompute_tokens_per_s": n / recomputed,
        "speedup": recomputed / cached,
    }
    print(f"KV cache vs recomputing the prefix (batch 1): {n / cached:.1f} vs {n / recomputed:.1f} tokens/s, "
          f"speed-up {recomputed / cached:.2f}x")  # fmt: skip
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
