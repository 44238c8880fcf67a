"""What `--model.optimizer muon` changes in a plan (`parallel/muon.py`): the hidden matrices' optimizer state is one
fp32 momentum buffer instead of AdamW's two moments, shared out over the data-parallel replicas (DP x CP) for the
dense matrices (ZeRO 1-3: partitioned as ZeRO partitions the moments, experts over their replicas too); the step
adds the Newton-Schulz FLOPs of the whole matrices (shared out over the replicas and the TP ranks), the TP gather
(bf16) and scatter (fp32) of the TP-split matrices' updates, and the replicas' broadcast of the updated weights
(fp32; ZeRO 1-3 instead: the all-to-alls moving each rank's pieces to the matrices' owners, bf16, and the updates
back, fp32).

The matrices are read off the model itself (built on the meta device: no memory), with the split the trainer uses
(`train.optimizer_recipe.muon_split`) and its logical matrices (a fused QKV as Q, K and V, each expert).
"""

from __future__ import annotations

from dataclasses import dataclass

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.gpus import GPUSpec
from mtnlg_lightning.model import build_model
from mtnlg_lightning.moe import moe_layers
from mtnlg_lightning.parallel.muon import logical_matrices
from mtnlg_lightning.planning.cost_model import Layout, all_gather_seconds, dp_bandwidth
from mtnlg_lightning.train.optimizer_recipe import muon_split

ADAM_MOMENTS = 8  # bytes per parameter AdamW keeps beside the weights (two fp32 moments)
MOMENTUM = 4  # Muon's one fp32 buffer


@dataclass(frozen=True)
class MuonLayer:
    """One block's Muon matrices, whole: parameters and Newton-Schulz FLOPs a step, dense and experts apart."""

    dense_params: int = 0
    expert_params: int = 0
    dense_flops: float = 0.0
    expert_flops: float = 0.0


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """Per iteration on an [m, n] matrix (m <= n): X X^T (2 m^2 n), A A (2 m^3), B X (2 m^2 n)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


def muon_layers(config: ModelConfig, ns_steps: int = 5) -> list[MuonLayer]:
    """Each block's `MuonLayer`, from the model built on the meta device."""
    model = build_model(config, "meta")
    _, _, hidden, stacked = muon_split(model)
    experts = {id(p) for _, layer in moe_layers(model) for p in layer.experts.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    layers = [dict(dense_params=0, expert_params=0, dense_flops=0.0, expert_flops=0.0) for _ in model.blocks]
    for param in hidden + stacked:
        name = names[id(param)]
        block = layers[int(name.split(".")[1])]
        head_dim = config.head_dim if name.endswith("qkv.weight") else None
        flops = sum(
            newton_schulz_flops(m.numel() // m.shape[-1], m.shape[-1], ns_steps)
            for m in logical_matrices(param, head_dim)
        )
        kind = "expert" if id(param) in experts else "dense"
        block[f"{kind}_params"] += param.numel()
        block[f"{kind}_flops"] += flops
    return [MuonLayer(**layer) for layer in layers]


@dataclass(frozen=True)
class MuonPlan:
    """Muon's settings the plan needs: `ns_steps` (torch's 5)."""

    ns_steps: int = 5

    def stage(self, config: ModelConfig, layout: Layout, first: int, count: int, gpu: GPUSpec, gpus_per_node: int):
        """(memory delta in bytes against AdamW, optimizer seconds added, summary) of one GPU of the pipeline stage
        holding blocks [first, first + count)."""
        held = muon_layers(config, self.ns_steps)[first : first + count]
        dense = sum(layer.dense_params for layer in held) / layout.tp  # this rank's TP shard of them
        experts = sum(layer.expert_params for layer in held) / layout.ep  # this rank's experts
        replicas, zero = layout.replicas, layout.zero_stage >= 1
        expert_replicas = replicas // layout.ep if zero else 1  # ZeRO partitions experts over their replicas
        shared = dense / replicas + experts / expert_replicas  # the parameters this rank keeps the state of
        momentum = MOMENTUM * shared
        delta = momentum - ADAM_MOMENTS * (shared if zero else dense + experts)  # ZeRO partitions AdamW's too
        flops = sum(layer.dense_flops for layer in held) / replicas / layout.tp  # shared over replicas and TP ranks
        flops += sum(layer.expert_flops for layer in held) / layout.ep / expert_replicas
        ns_seconds = flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency)
        nvlink = gpu.nvlink_gbps * 1e9 * gpu.nvlink_efficiency
        # each TP-split matrix gathered to its TP rank in bf16 and its shards scattered back in fp32: the traffic of
        # an all-gather of 2 + 4 bytes per parameter of the replica's share
        gather = all_gather_seconds(6 * dense * layout.tp / replicas, layout.tp, nvlink)
        bandwidth = dp_bandwidth(gpu, layout, gpus_per_node)
        if zero:  # each rank's partition to the owners (bf16) and back (fp32): an all-gather's traffic of 6 bytes
            exchange = all_gather_seconds(6 * dense / replicas, replicas, bandwidth)
            exchange += all_gather_seconds(6 * experts / expert_replicas, expert_replicas, bandwidth)
        else:  # the owners' broadcast of the updated weights (fp32)
            exchange = all_gather_seconds(4 * dense, replicas, bandwidth)
        summary = {
            "ns_steps": self.ns_steps,
            "zero_stage": layout.zero_stage,
            "newton_schulz_tflops_per_gpu": flops / 1e12,
            "newton_schulz_seconds": ns_seconds,
            "tp_gather_seconds": gather,
            "dp_seconds": exchange,
            "momentum_gb": momentum / 1e9,
            "state_saved_gb": -delta / 1e9,
        }
        return delta, ns_seconds + gather + exchange, summary


def format_muon(summary: dict) -> str:
    return (
        f"  Muon                 momentum {summary['momentum_gb']:,.2f} GB per GPU ({summary['state_saved_gb']:,.2f} "
        f"GB less than AdamW's moments); Newton-Schulz {summary['newton_schulz_tflops_per_gpu']:,.2f} TFLOP "
        f"({summary['newton_schulz_seconds']:,.3f} s), TP gather {summary['tp_gather_seconds']:,.3f} s, "
        f"{'ZeRO all-to-alls' if summary['zero_stage'] else 'DP broadcast'} {summary['dp_seconds']:,.3f} s a step"
    )
