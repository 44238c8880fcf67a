"""Expert parallelism: each of the EP ranks of an expert-parallel group holds E / EP of every MoE layer's experts,
and the routed rows travel to the rank holding their expert and back by all-to-all with uneven splits.

EP is carved out of the data-parallel ranks (as DeepSpeed-MoE and torchtitan do): the ranks of an EP group route
their own tokens with the same (replicated) router, so the router, the attention and every dense weight stay
data-parallel; an expert's gradient is the sum over the EP group's tokens that reached it (the all-to-all's
backward brings them), averaged with the copies of that expert on the other EP groups (the expert-data-parallel
group, `parallel/clip.py`).

The stacked expert weights `[E, ...]` are narrowed to this rank's rows `[E/EP, ...]` and marked with
`expert_parallel_index` / `expert_parallel_count`, which the checkpoint's model space reads as a box of the full
tensor (`checkpoint/model_space.py`), so a checkpoint holds the experts whole whatever the layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtnlg_lightning.moe import Experts, moe_layers
from mtnlg_lightning.parallel.layout import ProcessGroups
from mtnlg_lightning.parallel.sequence_parallel import mark_sequence_parallel
from mtnlg_lightning.torch_compat import all_to_all_autograd


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Whether `param` is a run of stacked experts: it carries which run (`expert_parallel_index`) of how many
    (`expert_parallel_count`) along dim 0 it holds."""
    return hasattr(param, "expert_parallel_count")


class ExpertParallelDispatch:
    """Runs a layer's routed rows on the experts of every EP rank: rows [N, H] sorted by global expert with
    `counts` [E] -> the experts' outputs [N, H] in the same order (what `Experts(rows, counts)` gives in one
    process). Differentiable: the all-to-alls' backward carries the gradients the other way."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.size
        local = counts.numel() // ep
        # how many rows each source sends to each of this rank's experts: [source, local expert]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        received = received.view(ep, local)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        arrived = all_to_all_autograd(rows.contiguous(), recv_splits, send_splits, self.group)
        # arrived rows run (source, local expert); the experts want them by (local expert, source)
        segment = torch.repeat_interleave(torch.arange(ep * local, device=counts.device), received.flatten())
        by_expert = torch.argsort((segment % local) * ep + segment // local, stable=True)
        out = experts(arrived[by_expert], received.sum(dim=0))
        back = torch.empty_like(out).index_copy(0, by_expert, out)  # (source, local expert) order again
        return all_to_all_autograd(back, send_splits, recv_splits, self.group)


def apply_expert_parallel(model: nn.Module, groups: ProcessGroups) -> None:
    """Keep this rank's run of every MoE layer's experts and route their rows through the EP group."""
    (rank, _), size = groups.expert_place(), groups.layout.expert_parallel
    dispatch = ExpertParallelDispatch(groups.expert_parallel_group, size)
    for _, layer in moe_layers(model):
        for linear in (layer.experts.gate, layer.experts.up, layer.experts.down):
            for name, full in list(linear.named_parameters(recurse=False)):  # the weight, and biases where stacked
                local = full.shape[0] // size
                shard = nn.Parameter(full.detach()[rank * local : (rank + 1) * local].clone())
                shard.requires_grad_(full.requires_grad)
                shard.expert_parallel_index, shard.expert_parallel_count = rank, size
                if getattr(full, "sequence_parallel", False):  # its TP ranks run different sequence slices
                    mark_sequence_parallel(shard, groups.tensor_parallel_group)
                setattr(linear, name, shard)
        layer.dispatch = dispatch
