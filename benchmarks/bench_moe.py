#!/usr/bin/env python
"""The mixture-of-experts layer, forward and backward, against transformers' Qwen 3-MoE block and torchtitan's MoE
layer: same shapes, same weights, same tokens, side by side in one run.

    python benchmarks/bench_moe.py [--hidden 256 --experts 16 --top-k 4 --ffn 128 --tokens 4096 --rounds 5]
    python benchmarks/bench_moe.py --dtype bf16     # every layer in bf16 (torchtitan's experts always run in bf16)

Ours (`mtnlg_lightning.moe.MoE`, stacked experts) runs with each expert kernel (`grouped_mm`: torch._grouped_mm,
`loop`: one GEMM per expert); transformers' `Qwen3MoeSparseMoeBlock` with each experts implementation this machine
runs (eager: a loop over the experts hit; grouped_mm). Every variant first shows it computes the same
output as the first (max |difference|), then the variants alternate for --rounds rounds of --steps timed
forward + backward passes; reported: the median tokens/s of each, and how many times as fast ours is with the
kernel `auto` picks (torch._grouped_mm where it runs).

torchtitan's layer (`torchtitan.models.common.moe.MoE`, 0.3: softmax top-k router with renormalised weights, grouped
GEMM experts, no load-balancing bias) is compared where torchtitan imports. It is not an extra of this project: its
import needs triton, which its wheel does not declare (`pip install torchtitan triton`); the run says when it is
missing. It casts the experts' GEMM inputs to bf16 whatever the layer's dtype, so `--dtype bf16` compares like with
like.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.config import get_config  # noqa: E402
from mtnlg_lightning.moe import MoE  # noqa: E402

OURS_KERNELS = ("grouped_mm", "loop")
# batched_mm (each pair's expert weights gathered: ~240 tokens/s at the default shape on CPU) is left out: its memory
# traffic slowed whichever variant ran after it.
THEIR_IMPLEMENTATIONS = ("eager", "grouped_mm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def our_layer(args) -> MoE:
    config = get_config(
        "tiny-llama",
        family="mixtral",
        hidden_size=args.hidden,
        num_heads=4,
        num_experts=args.experts,
        experts_per_token=args.top_k,
        moe_ffn_hidden_size=args.ffn,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    layer = MoE(config)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    return layer


def their_layer(ours: MoE, args, implementation: str):
    """transformers' Qwen3MoeSparseMoeBlock holding our weights (gate and up stacked into one gate_up_proj)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.ffn,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ours.experts.gate.weight, ours.experts.up.weight], dim=1))
        block.experts.down_proj.copy_(ours.experts.down.weight)
    return block


def torchtitan_layer(ours: MoE, args):
    """torchtitan's MoE layer holding our weights (router gate; w1 = gate, w3 = up, w2 = down)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.moe import MoE as TitanMoE
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    e, k = args.experts, args.top_k
    experts = GroupedExperts.Config(dim=args.hidden, hidden_dim=args.ffn, num_experts=e)
    gate = Linear.Config(in_features=args.hidden, out_features=e)
    config = TitanMoE.Config(
        num_experts=e,
        routed_experts=RoutedExperts.Config(
            inner_experts=experts, token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k)
        ),
        router=TokenChoiceTopKRouter.Config(num_experts=e, gate=gate, top_k=k, score_func="softmax", route_norm=True),
        load_balance_coeff=None,
    )
    # its router asks CPU autocast for fp32, which CPU autocast refuses with a warning each call (then runs in fp32)
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    layer = config.build()
    inner = layer.routed_experts.inner_experts
    with torch.no_grad():
        layer.router.gate.weight.copy_(ours.router.weight)
        inner.w1_EFD.copy_(ours.experts.gate.weight)
        inner.w3_EFD.copy_(ours.experts.up.weight)
        inner.w2_EDF.copy_(ours.experts.down.weight)
    return layer


def output(layer, x: torch.Tensor) -> torch.Tensor:
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def timed(layer, x: torch.Tensor, steps: int) -> float:
    """Seconds per forward + backward (the input's and every weight's gradient)."""
    started = time.perf_counter()
    for _ in range(steps):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        output(layer, x).square().mean().backward()
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> int:
    ap = benchmark_parser(__doc__)
    shape = {  # flag: (default, what it sets)
        "--hidden": (256, "hidden size H"),
        "--experts": (16, "experts per layer E"),
        "--top-k": (4, "experts per token k"),
        "--ffn": (128, "each expert's SwiGLU width"),
        "--tokens": (4096, "tokens per forward"),
        "--steps": (3, "timed forward + backward passes per round"),
    }
    for flag, (default, what) in shape.items():
        ap.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    ap.add_argument(
        "--dtype", choices=DTYPES, default="fp32", help="every layer's and the input's dtype (default fp32)"
    )
    add_rounds_arg(ap, 5)
    args = benchmark_args(ap, argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, dtype=dtype, requires_grad=True)
    ours = our_layer(args)
    variants = {}
    for kernel in OURS_KERNELS:
        variants[f"ours ({kernel})"] = (ours, kernel)
    if importlib.util.find_spec("transformers") is not None:
        for implementation in THEIR_IMPLEMENTATIONS:
            variants[f"transformers Qwen3-MoE ({implementation})"] = (their_layer(ours, args, implementation), None)
    try:
        variants["torchtitan MoE"] = (torchtitan_layer(ours, args), None)
    except ImportError as error:  # not an extra of this project (see the docstring)
        print(f"torchtitan's MoE layer: not compared ({error}; pip install torchtitan triton)")
    variants = {name: (layer.to(dtype), kernel) for name, (layer, kernel) in variants.items()}
    print(f"# bench_moe: H {args.hidden}, E {args.experts}, k {args.top_k}, expert width {args.ffn}, "
          f"{args.tokens} tokens, {args.dtype}, {torch.get_num_threads()} threads")  # fmt: skip
    reference = None
    runnable = {}
    for name, (layer, kernel) in variants.items():
        if kernel is not None:
            type(layer.experts).kernel = kernel
        try:
            with torch.no_grad():
                out = output(layer, x)
        except Exception as error:  # noqa: BLE001 - an implementation this machine cannot run is reported, not timed
            print(f"{name}: does not run here ({type(error).__name__}: {str(error).splitlines()[0][:100]})")
            continue
        reference = out if reference is None else reference
        print(f"{name}: output max |diff| vs ours (grouped_mm) {(out - reference).abs().max().item():.1e}")
        runnable[name] = (layer, kernel)
    seconds = {name: [] for name in runnable}
    for layer, _ in runnable.values():  # one untimed pass each: first-touch allocations
        timed(layer, x, 1)
    for _ in range(args.rounds):  # alternating: the machine's noise falls on every variant alike
        for name, (layer, kernel) in runnable.items():
            if kernel is not None:
                type(layer.experts).kernel = kernel
            seconds[name].append(timed(layer, x, args.steps))
    type(ours.experts).kernel = "auto"
    picked = "grouped_mm" if ours.experts._grouped(x.flatten(0, 1)) else "loop"
    base = statistics.median(seconds[f"ours ({picked})"])
    result = {"shape": vars(args), "auto_kernel": picked, "variants": {}}
    print(f"ours with auto's kernel on {x.device.type}: {picked}")
    for name, times in seconds.items():
        median = statistics.median(times)
        tokens_per_s = args.tokens / median
        result["variants"][name] = {"tokens_per_s": tokens_per_s, "step_s": median, "ours_speedup": median / base}
        print(f"{name}: {tokens_per_s:,.0f} tokens/s forward+backward | ours ({picked}) {median / base:.2f}x as fast")
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
