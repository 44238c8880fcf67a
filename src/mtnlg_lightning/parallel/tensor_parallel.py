"""Megatron-style tensor parallelism on plain tensors (so DeepSpeed's ZeRO can flatten and partition them).

Names say what is sharded along which axis:
- `ColumnParallelLinear`: weight [out/TP, in], output features split (q/k/v by whole heads, MLP fc1, gate, up).
  With grouped-query attention and TP > KV heads, each rank holds the one key/value head its query heads use, a copy
  shared with the other ranks of its group (as Megatron-style replication in vLLM): the copies' gradients, each from
  its rank's query heads, are summed over the sharing ranks, and the global norm counts the head once.
- `RowParallelLinear`: weight [out, in/TP], input features split, partial outputs summed (attn proj, MLP fc2,
  down); its bias is replicated and added once after the sum.
- `VocabParallelEmbedding`: weight [V/TP, H], vocabulary rows split; the LM head reuses that shard (tied).
- `vocab_parallel_cross_entropy`: the loss over vocabulary-split logits without gathering them.

The conjugate f/g functions (Megatron paper, Fig. 3) over the TP group: `copy_to_tensor_parallel_region` (f) is
identity forward / all-reduce backward; `reduce_from_tensor_parallel_region` (g) is all-reduce forward / identity
backward: one all-reduce per sublayer each way. Sharded parameters carry `tensor_model_parallel = True`,
`partition_dim` and which of how many shards they are (`partition_index`, `partition_count`: the checkpoint's box);
DeepSpeed and `clip.py` count them on each TP rank in the global grad norm, replicated ones only on TP rank 0.

`apply_tensor_parallel(model, tp_group)` (tensor parallelism only; `parallelize.py` applies every transform) shards
a built GPT from outside by copying the right slices of its weights, so a TP run starts from exactly the
single-process initialisation. With `sequence_parallel=True` the same layers run
Megatron's sequence parallelism (`sequence_parallel.py`): column-parallel layers all-gather a sequence-sharded
input instead of f, row-parallel layers reduce-scatter instead of g.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.families import tensor_parallel_plan
from mtnlg_lightning.family_specs import (
    COLUMN,
    EXPERTS,
    HEAD_NORM,
    HEADS,
    KV_COLUMN,
    LATENT,
    NORM,
    ROUTER,
    ROW,
    SHARED_KEY,
)
from mtnlg_lightning.linear_attention import GatedDeltaNet
from mtnlg_lightning.loss import token_mean
from mtnlg_lightning.moe import moe_layers
from mtnlg_lightning.parallel.layout import kv_head_copies
from mtnlg_lightning.parallel.sequence_parallel import (
    SequenceParallelDropout,
    all_gather_linear,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
    scatter_output_to_sequence,
    sum_gradient_over,
)


# ---------------------------------------------------------------------------------------------- f and g
class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward (each rank used x for a different shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the partial results), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTensorParallelRegion.apply(x, group)


def _mark_sharded(param: nn.Parameter, partition_dim: int, index: int, count: int, counted: bool = True):
    """`param` is shard `index` of `count` along `partition_dim`; `counted`: this rank adds it to the global grad
    norm (False on all but one of the ranks holding a copy of the same shard)."""
    param.tensor_model_parallel = counted
    param.partition_dim = partition_dim
    param.partition_stride = 1
    param.partition_index, param.partition_count = index, count
    return param


def _shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return full.detach().chunk(size, dim=dim)[rank].clone().contiguous()


# ---------------------------------------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local with W split along the output features (dim 0); output stays split.

    sequence_parallel: x arrives as this rank's sequence slice and is all-gathered (whole sequence out)."""

    def __init__(self, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None, group, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight_shard)
        self.bias = nn.Parameter(bias_shard) if bias_shard is not None else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group, rank: int, size: int, sequence_parallel: bool = False, copies: int = 1
    ) -> ColumnParallelLinear:
        """Rank `rank` of `size` takes shard rank // copies of size / copies: with copies > 1, consecutive ranks
        share a shard (a key/value head replicated over the ranks of its query heads)."""
        index, count = rank // copies, size // copies
        bias = _shard(linear.bias, 0, index, count) if linear.bias is not None else None
        layer = cls(_shard(linear.weight, 0, index, count), bias, group, sequence_parallel)
        for param in layer.parameters():
            _mark_sharded(param, 0, index, count, counted=rank % copies == 0)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return all_gather_linear(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_ranks(x_local W_local^T) + b with W split along the input features (dim 1); bias replicated.

    sequence_parallel: the sum is reduce-scattered (this rank's sequence slice out) and the bias added to the slice,
    so its gradient is summed over the TP group (`mark_sequence_parallel`)."""

    def __init__(self, weight_shard: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight_shard)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        if sequence_parallel and self.bias is not None:
            mark_sequence_parallel(self.bias, group)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group, rank: int, size: int, sequence_parallel: bool = False
    ) -> RowParallelLinear:
        layer = cls(_shard(linear.weight, 1, rank, size), linear.bias, group, sequence_parallel)
        _mark_sharded(layer.weight, 1, rank, size)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = (
            reduce_scatter_to_sequence_parallel_region if self.sequence_parallel else reduce_from_tensor_parallel_region
        )
        y = reduce(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_end) on this rank; other tokens contribute zeros, summed over TP."""

    def __init__(self, weight_shard: torch.Tensor, vocab_start: int, group):
        super().__init__()
        self.group = group
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + weight_shard.shape[0]
        self.weight = nn.Parameter(weight_shard)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group, rank: int, size: int) -> VocabParallelEmbedding:
        shard = _shard(embedding.weight, 0, rank, size)
        layer = cls(shard, rank * shard.shape[0], group)
        _mark_sharded(layer.weight, 0, rank, size)
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary slice: a tied head shares the `VocabParallelEmbedding` shard (same
    Parameter), an untied one holds its own shard of the head's rows.

    On a last pipeline stage without the embedding, a tied head's `weight` is a plain tensor: the per-step copy of
    the first stage's shard that `tied_embedding.TiedEmbedding` fills (not a parameter: the optimizer sees the
    embedding once)."""

    def __init__(self, weight: torch.Tensor, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = weight  # tied: the embedding's Parameter, or the pipeline copy

    def forward(self, h: torch.Tensor, within=None) -> torch.Tensor:
        """`within(weight)`: run inside this call (the chunked loss on `whole_input(h)`: `model.OutputHead`)."""
        if within is not None:
            return within(self.weight)
        if self.sequence_parallel:  # h is this rank's sequence slice: the loss needs every token
            return all_gather_linear(h, self.weight, None, self.group)
        return F.linear(copy_to_tensor_parallel_region(h, self.group), self.weight)

    def whole_input(self, h: torch.Tensor) -> torch.Tensor:
        """The head's input as every TP rank needs it: the whole sequence (gathered under SP), its gradient summed
        over the ranks (each projects it on its own vocabulary slice)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(h, self.group)
        return copy_to_tensor_parallel_region(h, self.group)


# ---------------------------------------------------------------------------------------------- loss
def softmax_and_nll(logits: torch.Tensor, labels: torch.Tensor, group=None):
    """Of fp32 logits [n, V_local] (this rank's vocabulary slice under TP, `group`) against labels [n]: (-log
    p(label) [n], softmax [n, V_local], the label in this slice [n] bool, its column [n]);
    three all-reduces of [n] under TP. The vocabulary-parallel loss's forward, and the fused chunks' of the output
    layer (`output_layer.py`)."""
    vocab_local = logits.shape[-1]
    start = dist.get_rank(group) * vocab_local if group is not None else 0
    peak = logits.max(dim=-1).values
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    logits = logits - peak.unsqueeze(-1)
    inside = (labels >= start) & (labels < start + vocab_local)
    column = (labels - start).masked_fill(~inside, 0)
    target = logits.gather(1, column.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
    exp = logits.exp_()
    total = exp.sum(dim=-1)
    if group is not None:
        dist.all_reduce(target, group=group)
        dist.all_reduce(total, group=group)
    return total.log() - target, exp.div_(total.unsqueeze(-1)), inside, column


def minus_label(softmax: torch.Tensor, inside: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """softmax - one_hot(label), in place: the gradient of -log p(label) with respect to this rank's logits (the
    label's column only where it lies in this rank's slice, `inside`)."""
    softmax[torch.arange(len(softmax), device=softmax.device), column] -= inside.to(softmax.dtype)
    return softmax


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE over logits split along the vocabulary: three all-reduces of [N] tensors, no gather."""

    @staticmethod
    def forward(ctx, logits, target, group):
        loss, softmax, inside, local_target = softmax_and_nll(logits, target, group)
        ctx.save_for_backward(softmax, inside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, inside, local_target = ctx.saved_tensors
        grad = minus_label(softmax.clone(), inside, local_target)
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_nll(logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """-log p(label) per row of vocabulary-split logits [N, V/TP] (fp32) against labels [N]; an ignored label's
    row holds its log-sum-exp (mask it)."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """Token-mean loss of vocabulary-split logits [B, S, V/TP] against labels [B, S] (same on every TP rank); an
    ignored label (`loss.IGNORE_INDEX`) lies outside every rank's slice, and its loss is masked out of the mean."""
    per_token = _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), labels.flatten(), group)
    return token_mean(per_token, labels.flatten())


# ------------------------------------------------------------------------------------ apply_tensor_parallel
def apply_tensor_parallel(
    model: nn.Module, group, rank: int, size: int, sequence_parallel: bool = False, kv_group=None
) -> nn.Module:
    """Shard a built GPT across the TP `group` in place (Megatron's split) and return it.

    Each block's modules as its family's tensor-parallel plan says (`families.tensor_parallel_plan`): column (a
    fused QKV, whose [heads, 3, head_dim] output layout makes contiguous shards whole heads; q; MLP fc1, gate, up),
    column by key/value heads (k and v, replicated when TP exceeds them: `kv_group` is then the ranks sharing this
    rank's key/value head, over which their gradients are summed), row (proj, fc2, down), head norms (q/k norms:
    replicated, their gradients, each from this rank's heads, summed over TP), norms (replicated), a mixture of
    experts' router and experts (whole on every TP rank: a fine-grained expert's few columns would make TP GEMMs
    too thin to pay for the all-reduce, as Megatron's expert TP of 1 and torchtitan's defaults judge; EP splits the
    experts instead) and its shared expert (column and row, as a dense MLP); multi-head latent attention's latent
    projections and norms (replicated; the column-parallel layer after them sums their gradient, or under sequence
    parallelism each rank's slice's is summed as a norm's) and its rotary key (whole on every rank, input gathered as
    a column layer's, gradient summed over TP); Gated DeltaNet by key heads (`linear_attention.py`: its projections
    column and row, its convolution's channels and per-value-head decay a rank's heads' rows, its gated norm as a
    head norm; a TP that does not divide the key heads is one line). Word embedding
    vocab-parallel; the LM head tied to its shard or (untied) its own vocab-parallel shard. Position embeddings and
    row-parallel biases stay replicated. Parts a pipeline stage does not own (None) are skipped. size == 1 leaves
    the model untouched.

    sequence_parallel: the embedding output is cut to this rank's sequence slice, blocks and the final norm run on
    slices (the norm, router, expert and row-parallel-bias gradients summed over TP, the router's losses taken
    over the whole sequence: `MoE.sequence_groups`; the blocks' dropout masks sliced from
    whole-sequence ones), the LM head gathers the sequence.
    """
    if size == 1:
        return model
    sp = sequence_parallel
    config = model.config
    copies = 1 if config.fused_qkv else kv_head_copies(config.num_kv_heads, size)
    column = partial(ColumnParallelLinear.from_linear, group=group, rank=rank, size=size, sequence_parallel=sp)
    row = partial(RowParallelLinear.from_linear, group=group, rank=rank, size=size, sequence_parallel=sp)
    plan = tensor_parallel_plan(config)
    # the multi-token prediction depths' blocks (`mtp.py`) shard as the trunk's; their eh_proj and norms stay whole
    # (their input is whole on every rank; the column-parallel layers after them sum their gradient over TP)
    mtp = getattr(model, "mtp", None)
    depth_blocks = [layer.block for layer in mtp.layers.values()] if mtp is not None else []
    for block in [*model.blocks.values(), *depth_blocks]:
        if isinstance(block.attn, GatedDeltaNet):  # its key heads split (refused in one line unless TP divides them)
            block.attn.split_heads(size, sp)
    for block in [*model.blocks.values(), *depth_blocks]:
        held = dict(block.named_modules())  # a dense block and an MoE block hold different MLP paths
        for path, style in plan.items():
            if path not in held:
                continue
            parent_path, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            module = getattr(parent, name)
            if style == COLUMN:
                setattr(parent, name, column(module))
            elif style == KV_COLUMN:
                setattr(parent, name, column(module, copies=copies))
                if copies > 1 and kv_group is not None:
                    for param in getattr(parent, name).parameters():
                        sum_gradient_over(param, kv_group)
            elif style == ROW:
                setattr(parent, name, row(module))
            elif style == SHARED_KEY:  # whole on every rank; its gradient, each from this rank's heads, summed
                setattr(parent, name, column(module, copies=size))
                for param in getattr(parent, name).parameters():
                    sum_gradient_over(param, group)
            elif style == HEADS:  # this rank's heads' rows of each parameter (sinks; GDN's decay, conv), as q's
                for name_, param in list(module.named_parameters(recurse=False)):
                    shard = _shard(param, 0, rank, size).requires_grad_(param.requires_grad)
                    setattr(module, name_, _mark_sharded(nn.Parameter(shard), 0, rank, size))
            elif style == HEAD_NORM and group is not None:
                for param in module.parameters():
                    sum_gradient_over(param, group)
            elif style in (NORM, ROUTER, EXPERTS, LATENT) and sp:  # each rank runs its own sequence slice
                for param in module.parameters():
                    mark_sequence_parallel(param, group)
        if sp:
            for _, layer in moe_layers(block):
                layer.sequence_groups.append((group, 1))
        if sp and isinstance(block.dropout, nn.Dropout):
            block.dropout = SequenceParallelDropout(block.dropout.p, group)
    embed = getattr(model, "embed", None)
    if embed is not None:
        embed.wte = VocabParallelEmbedding.from_embedding(embed.wte, group, rank, size)
        if sp:
            scatter_output_to_sequence(embed, group)
    if sp and getattr(model, "norm", None) is not None:
        for param in model.norm.parameters():
            mark_sequence_parallel(param, group)
    head = getattr(model, "lm_head", None)
    if head is not None:
        if embed is not None and config.tie_embeddings:
            model.lm_head = VocabParallelLMHead(embed.wte.weight, group, sp)
        else:  # untied, or the last pipeline stage's copy of the tied embedding: sharded like the embedding
            shard = _shard(head.weight, 0, rank, size).requires_grad_(head.weight.requires_grad)
            if isinstance(head.weight, nn.Parameter):
                shard = _mark_sharded(nn.Parameter(shard), 0, rank, size)
            model.lm_head = VocabParallelLMHead(shard, group, sp)
    depth_embed = getattr(mtp, "embed", None) if mtp is not None else None
    if depth_embed is not None and not isinstance(depth_embed.wte, VocabParallelEmbedding):
        # a last pipeline stage's copy of the embedding for its depths (`pipeline.build_stage`): sharded as the
        # embedding, still a plain tensor (the tied head's copy itself where the head is tied)
        layer = VocabParallelEmbedding.from_embedding(depth_embed.wte, group, rank, size)
        del layer.weight
        if config.tie_embeddings:
            layer.weight = model.lm_head.weight
        else:
            layer.weight = _shard(depth_embed.wte.weight, 0, rank, size).requires_grad_(True)
        depth_embed.wte = layer
        if sp:
            scatter_output_to_sequence(depth_embed, group)
    if sp and mtp is not None:  # the depths' own layers run on this rank's sequence slice, as a norm does
        for depth in mtp.layers.values():
            for module in (depth.enorm, depth.hnorm, depth.eh_proj, depth.norm):
                for param in module.parameters():
                    mark_sequence_parallel(param, group)
    return model


@torch.no_grad()
def gather_tensor_parallel(tensor: torch.Tensor, partition_dim: int, group) -> torch.Tensor:
    """Concatenate the TP shards of one parameter along its partition dimension."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=partition_dim)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))
