#!/usr/bin/env python
"""TP / ZeRO / PP cost on CPU: tokens/s of tp2, dp2 + ZeRO-1 and pp2 vs one process at the same global batch,
and the communication volume per step per rank counted from the process-group calls vs theory.

Rounds alternate a single-process run (1 thread: multi-threaded runs on a shared 2-core machine measure OpenMP
contention) and one 2-rank torchrun launch running every layout (1 thread per rank); tokens/s is the global batch
over the median step time of all measured steps (the first `--warmup` of each run are dropped). With 2 ranks on
2 cores a perfect layout would reach 2x the single process: "efficiency" = ratio / world. `comm_counter` wraps the
torch.distributed calls in the ranks and sums payload bytes per group kind for the last step of each run.

Theoretical volume per rank per step (fp32, B = global batch / dp, s = seq, h = hidden, L = layers, V = vocab):
  TP: 2 all-reduces of B*s*h per layer forward (attention and MLP outputs) + 2 backward (their inputs), plus
      the vocab-parallel embedding (forward) and LM head (backward) all-reduces of B*s*h and the
      cross-entropy's 3 all-reduces of B*s.
  DP: the replica's gradient bytes / (TP * PP) reduced (all-reduce or reduce-scatter); ZeRO >= 1 also
      all-gathers the updated parameters (the same bytes).
  PP: activations forward and their gradients backward between stages (B*s*h each way, sent + received),
      and the tied embedding kept in step between the first and the last stage (V*h each way).
  TP + sequence parallelism (b = micro-batch, n = micro-batches, per micro-batch): per layer 2 all-gathers and
      2 reduce-scatters of b*s*h forward (each a half of TP's all-reduce), 2 reduce-scatters and 4 all-gathers
      backward (one re-gathers the input shard a column-parallel layer saved instead of the whole sequence); the
      LM head gathers (1 forward, 1 + 1 reduce-scatter backward), the scattered embedding gathers its gradient (1);
      all-reduces: the word embedding (b*s*h), the loss (3 x b*s), the LayerNorm and row-parallel-bias gradients
      (6h per layer + 2h). In bytes on the wire of a ring (all-reduce 2(t-1)/t, all-gather and reduce-scatter
      (t-1)/t of the payload) the forward moves what TP moves; the backward re-gathers add 2 b*s*h per layer.
      With pipelining the stage boundary carries the sequence shard: PP activation bytes / TP.

    python benchmarks/bench_parallel.py [--preset demo --global-batch 8 --micro-batch 4 --steps 5 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent))  # the repository root: testing.*
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from testing.local_ranks import run_on_ranks  # noqa: E402

LAYOUTS = {
    "tp2": dict(tp=2),
    "dp2_zero1": dict(zero=1),
    "pp2": dict(pp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "tp2_pp2": dict(tp=2, pp=2),  # 4 ranks (--world 4): the stage boundary with and without the sequence shard
    "tp2_pp2_sp": dict(tp=2, pp=2, sp=True),
}
DEFAULT_LAYOUTS = ["tp2", "dp2_zero1", "pp2", "tp2_sp"]


def pipeline_supported() -> tuple[bool, str]:
    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

    try:
        MegatronDeepSpeedStrategy(pipeline_parallel=2, print_layout=False)._check_arguments()
    except Exception as error:  # noqa: BLE001 - any refusal means: not supported by this strategy
        return False, str(error).splitlines()[0]
    return True, ""


# ------------------------------------------------------------------ the ranks
def worker(args) -> None:
    from testing import comm_counter

    comm_counter.install()  # before DeepSpeed builds its communication backend
    import lightning as L
    import torch
    import torch.distributed as dist

    from testing.lightning_run import StepTimer, fit, megatron_strategy

    class CommProbe(L.Callback):
        def __init__(self):
            self.last: dict = {}

        def on_train_start(self, trainer, pl_module):
            comm_counter.register_groups(trainer.strategy.groups)

        def on_train_batch_start(self, *a):
            comm_counter.reset()

        def on_train_batch_end(self, *a):
            self.last = comm_counter.snapshot()

    torch.set_num_threads(args.threads)
    rows = []
    for name in args.layouts:
        timer, comm = StepTimer(), CommProbe()
        if name == "single":
            fit("auto", 1, args.preset, args.steps, args.micro_batch, args.global_batch, [timer])
        else:
            world = int(os.environ["WORLD_SIZE"])
            fit(
                megatron_strategy(**LAYOUTS[name]),
                world,
                args.preset,
                args.steps,
                args.micro_batch,
                args.global_batch,
                [timer, comm],
            )
        per_rank = [comm.last]
        if dist.is_initialized():
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, comm.last)
        rows.append({"layout": name, "step_seconds": timer.seconds[args.warmup :], "comm_per_rank": per_rank})
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.worker).write_text(json.dumps(rows))


# ------------------------------------------------------------------ the parent
def run_round(args, layouts: list[str], world: int, out: Path) -> list[dict]:
    common = [
        "--worker",
        str(out),
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--micro-batch",
        str(args.micro_batch),
        "--global-batch",
        str(args.global_batch),
    ]
    if world == 1:
        cmd = [sys.executable, __file__, *common, "--threads", "1", "--layouts", "single"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:
        proc = run_on_ranks(world, __file__, *common, "--threads", "1", "--layouts", *layouts)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({' '.join(layouts)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def theory(args, layout: str) -> dict[str, float]:
    """Payload bytes per rank per step by group kind, fp32."""
    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.families import count_parameters

    c = get_config(args.preset)
    s, h, layers = c.seq_len, c.hidden_size, c.num_layers
    if layout == "tp2":
        bsh = args.global_batch * s * h
        return {
            "tp": 4 * (4 * layers * bsh + 2 * bsh + 3 * args.global_batch * s),
            "tp_issue_formula_forward": 4 * 2 * layers * bsh,
        }
    if layout == "tp2_sp":
        bsh, n = args.global_batch * s * h, args.global_batch // args.micro_batch  # dp 1: every micro-batch here
        return {
            "tp_all_gather": 4 * (6 * layers + 3) * bsh,
            "tp_reduce_scatter": 4 * (4 * layers + 1) * bsh,
            "tp_all_reduce": 4 * (bsh + 3 * args.global_batch * s + n * (6 * layers + 2) * h),
        }
    if layout in ("tp2_pp2", "tp2_pp2_sp"):
        shard = 2 if layout.endswith("_sp") else 1  # what crosses a stage: the sequence shard under SP
        return {
            "pp_activations": 4 * 2 * args.global_batch * s * h // shard,
            "pp_tied_embedding": 4 * 2 * c.padded_vocab_size() * h // 2,  # each TP rank's vocabulary half
        }
    if layout == "dp2_zero1":
        grads = 4 * count_parameters(c)  # TP = PP = 1: the whole replica
        return {"dp_gradient_reduce": grads, "dp_param_all_gather": grads}
    if layout == "pp2":
        return {
            "pp_activations": 4 * 2 * args.global_batch * s * h,
            "pp_tied_embedding": 4 * 2 * c.padded_vocab_size() * h,
        }
    return {}


def measured(comm: dict, layout: str) -> dict[str, float]:
    def total(pred):
        return sum(v["bytes"] for k, v in comm.items() if pred(*k.split("/")))

    if layout == "tp2":
        return {"tp": total(lambda kind, op: kind == "tp")}
    if layout == "tp2_sp":
        return {
            "tp_all_gather": total(lambda kind, op: kind == "tp" and op == "all_gather_into_tensor"),
            "tp_reduce_scatter": total(lambda kind, op: kind == "tp" and op == "reduce_scatter_tensor"),
            "tp_all_reduce": total(lambda kind, op: kind == "tp" and op == "all_reduce"),
        }
    if layout == "dp2_zero1":
        return {
            "dp_gradient_reduce": total(lambda kind, op: kind == "dp" and "reduce" in op),
            "dp_param_all_gather": total(lambda kind, op: kind == "dp" and "gather" in op),
        }
    if layout in ("pp2", "tp2_pp2", "tp2_pp2_sp"):  # the tied embedding: broadcast over its first/last-stage group
        return {
            "pp_activations": total(lambda kind, op: op in ("send", "recv", "isend", "irecv")),
            "pp_tied_embedding": total(lambda kind, op: op == "broadcast"),
        }
    return {}


def need_tp_pp(name: str) -> int:
    """Ranks of one model replica (TP x PP) in a layout."""
    return LAYOUTS[name].get("tp", 1) * LAYOUTS[name].get("pp", 1)


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--preset", default="demo", help="model preset (default demo: 4 layers, hidden 256)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not timed (default 2)")
    add_rounds_arg(parser, 2)
    parser.add_argument("--world", type=int, default=2, help="ranks per parallel layout (default 2)")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=DEFAULT_LAYOUTS,
        help=f"default: {' '.join(DEFAULT_LAYOUTS)} (tp2_pp2 and tp2_pp2_sp need --world 4)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = benchmark_args(parser)
    if args.worker:
        worker(args)
        return 0

    layouts = list(args.layouts)
    notes = []
    for name in layouts:
        if name not in LAYOUTS:
            parser.error(f"unknown layout {name}; choose from {', '.join(LAYOUTS)}")
        if args.world % need_tp_pp(name):
            parser.error(f"layout {name} needs a world divisible by {need_tp_pp(name)}; got --world {args.world}")
    if "pp2" in layouts:
        ok, why = pipeline_supported()
        if not ok:
            layouts.remove("pp2")
            notes.append(f"pp2 skipped: the strategy refuses pipeline_parallel=2 ({why})")
            print(notes[-1], flush=True)
    steps: dict[str, list[float]] = {name: [] for name in ["single", *layouts]}
    comm: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for world, names in ((1, ["single"]), (args.world, layouts)):
                for row in run_round(args, names, world, Path(tmp) / f"r{round_}_{world}.json"):
                    steps[row["layout"]] += row["step_seconds"]
                    comm[row["layout"]] = row["comm_per_rank"]
            print(
                f"round {round_ + 1}/{args.rounds}: "
                + ", ".join(f"{k} {statistics.median(v):.3f} s/step" for k, v in steps.items()),
                flush=True,
            )

    tokens = args.global_batch * __import__("mtnlg_lightning.config", fromlist=["x"]).get_config(args.preset).seq_len
    base = tokens / statistics.median(steps["single"])
    result = {
        "preset": args.preset,
        "global_batch": args.global_batch,
        "world": args.world,
        "notes": notes,
        "single_tokens_per_s": base,
        "layouts": {},
    }
    print(
        f"\nthroughput ({args.preset}, global batch {args.global_batch}, {args.rounds} rounds, median step): "
        f"single process (1 thread) {base:,.0f} tokens/s"
    )
    print(
        f"{'layout':<10} {'tokens/s':>9} {'vs single':>9} {'effic.':>6}   {'comm/rank/step':<18} {'measured MB':>11} "
        f"{'theory MB':>9} {'ratio':>6}"
    )
    for name in layouts:
        tps = tokens / statistics.median(steps[name])
        entry = {
            "tokens_per_s": tps,
            "ratio_vs_single": tps / base,
            "efficiency": tps / base / args.world,
            "comm": {},
            "comm_raw_rank0": comm[name][0],
        }
        expected = theory(args, name)
        got_per_rank = [measured(c, name) for c in comm[name]]
        first = True
        for key, want in expected.items():
            if key.endswith("issue_formula_forward"):
                continue
            got = max(g[key] for g in got_per_rank)
            entry["comm"][key] = {"measured_bytes": got, "theory_bytes": want, "ratio": got / want}
            head = f"{name:<10} {tps:>9,.0f} {tps / base:>9.3f} {tps / base / args.world:>6.3f}" if first else " " * 37
            print(f"{head}   {key:<18} {got / 1e6:>11.2f} {want / 1e6:>9.2f} {got / want:>6.3f}")
            first = False
        if "pp_activations" in entry["comm"]:
            micro_batches = args.global_batch // (args.micro_batch * args.world // need_tp_pp(name))
            entry["pp_activation_bytes_per_microbatch"] = (
                entry["comm"]["pp_activations"]["measured_bytes"] / micro_batches
            )
        result["layouts"][name] = entry
    print(
        "comm = payload bytes of the process-group calls, max over ranks, last step; theory in the module doc. "
        "Other traffic (world: logged-loss sync; mp: grad-norm) is in the JSON's comm_raw_rank0."
    )
    if {"tp2_pp2", "tp2_pp2_sp"} <= set(result["layouts"]):
        plain, sp = (result["layouts"][k]["pp_activation_bytes_per_microbatch"] for k in ("tp2_pp2", "tp2_pp2_sp"))
        result["pp_sequence_shard"] = {"tp2_pp2": plain, "tp2_pp2_sp": sp, "ratio": sp / plain}
        print(
            f"PP activation bytes per micro-batch per rank: tp2_pp2 {plain:,.0f}, with SP {sp:,.0f} ({sp / plain:.3f})"
        )
    for note in notes:
        print(note)
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
