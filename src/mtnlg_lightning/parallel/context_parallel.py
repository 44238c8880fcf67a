"""Context parallelism: each sequence cut over a context-parallel (CP) group, attention over the whole sequence.

Load balance (Megatron's scheme): a sequence of S tokens is cut into 2 x CP chunks of c = S / (2 x CP); CP rank r
holds chunks r and 2CP-1-r, so every rank has the same causal work (an early chunk sees few keys, a late one many).
Each rank embeds, projects and scores only its 2c tokens, at the positions of the original sequence
(`positions`); the loss of the whole sequence is the mean of the ranks' equal-sized token means, which is what
averaging the gradients over the data- and context-parallel ranks gives (`ProcessGroups.replica_group`).

Attention is a ring (p2p): the ranks pass their key/value chunks around the CP group; at step i rank r holds those
of rank s = r - i (mod CP) and attends to them as causality allows:
- i = 0, its own chunks: causal attention over its 2c tokens (chunk r before chunk 2CP-1-r, as in the sequence);
- s < r: both of its query chunks see s's first chunk whole, neither sees s's second (it comes later);
- s > r: only its second query chunk sees anything: both of s's chunks, whole.
Each block's result comes with its log-sum-exp; the partial results merge exactly (online softmax). The backward
is exact too: it runs the same ring, each block's gradient computed against the final output and log-sum-exp,
dq kept, dk/dv travelling around the ring with their key/value chunk until they reach its owner. Only key/value
heads travel (grouped-query attention expands them locally). The next chunk's send/receive is posted before the
current block is computed, so communication overlaps compute where the backend progresses it in the background.

Block kernels return their log-sum-exp: torch's flash attention on CPU and CUDA (bf16/fp16), memory-efficient
attention on CUDA (fp32); torch's math path returns none, so it cannot run a ring (`check_context_parallel`).

Packed rows (`document_ids`, whole on every CP rank: the pre-hook splits only tokens and positions): each block
takes its part of the block-diagonal causal mask, from the positions its query and key rows hold in the whole
sequence. A block no document boundary crosses is what the plain kernel computes (causal or whole) and runs it;
a block whose queries see none of its keys is skipped; the others, where a boundary falls inside, run an exact
masked kernel (`masked_block_forward`/`backward`: the scores materialised in fp32, with the log-sum-exp).

Sliding layers (`attention_kinds`): the window is a band on the same mask (`document_mask(..., window)`), packed
or not (a row of one document gets ids of zeros here), so each block is exact: one wholly outside the band is
skipped, one it cuts is masked. A window of w keys needs, for each query chunk, only the key chunks within w
positions before it; the ring still passes every chunk (what a window could save in traffic is not taken yet).
Attention sinks (GPT-OSS) join after the ring: a sink's column takes 1 - sigmoid(lse - sink) of each query's
softmax, where lse is the ring's merged log-sum-exp over every key, so the output is scaled by that sigmoid; the
backward runs the blocks on the scaled output gradient and the sinked output, and the sink's gradient is its column's
(`_RingAttention`). Exact, at no extra traffic.

Gated DeltaNet layers (`linear_attention.py`) are a recurrence in sequence order, which the load-balanced chunks
(r and 2CP-1-r) break: each such layer gathers the whole sequence's hidden states from the CP ranks (all-gather,
the chunks put back in order), runs over it, documents and all, as one process does, and keeps its rank's chunks
(`ContextGather`); backward, each rank's gradient of the whole sequence's input is summed over the CP group and it
keeps its chunks'. Exact, but each CP rank computes these layers over the whole sequence (their activations too):
CP saves nothing in them. With sequence parallelism it is refused in one line. The plan that would save it: each
rank runs its chunks from a zero state, then the final states pass between the ranks in sequence order (a state
is [n_v, d_k, d_v] per row, whatever the length; chunk r's to chunk r + 1, through every rank and back), and each
chunk's output is corrected by the incoming state read through its decayed queries (the chunked form's
inter-chunk term); the convolution needs the kernel - 1 inputs before each chunk, and a document starting inside
a chunk stops the incoming state there. Not built.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from mtnlg_lightning import torch_compat
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.linear_attention import GatedDeltaNet
from mtnlg_lightning.loss import counted_labels
from mtnlg_lightning.model import DocumentMask, document_mask
from mtnlg_lightning.moe import moe_layers

SEQUENCE_DIM = 1  # [B, S, ...]
KERNELS = ("auto", "flash", "efficient", "math")


# ---------------------------------------------------------------------------------------------- the split
def chunk_indices(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x CP) of a sequence that CP rank `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim`, in sequence order."""
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_indices(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def local_positions(cp_rank: int, cp_size: int, start: int, length: int, device) -> torch.Tensor:
    """The positions in the whole sequence of the `length` tokens this rank holds (its two chunks)."""
    c = length // 2
    first, second = chunk_indices(cp_rank, cp_size)
    chunks = [torch.arange(i * c, (i + 1) * c, device=device) for i in (first, second)]
    return start + torch.cat(chunks)


def check_context_parallel(
    context_parallel: int, seq_len: int, tensor_parallel: int, sequence_parallel: bool, kernel: str, dropout: float
) -> None:
    """What a CP layout needs of the model and the run (one line each)."""
    if context_parallel == 1:
        return
    if kernel not in KERNELS:
        raise MTNLGError(f"context_parallel_kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "math":
        raise MTNLGError(
            "context_parallel needs an attention kernel that returns its log-sum-exp to merge the ring's blocks: "
            "'math' (torch's math path) returns none; use auto, flash or efficient"
        )
    if seq_len % (2 * context_parallel):
        raise MTNLGError(
            f"seq_len {seq_len} is not divisible by 2 x context_parallel = {2 * context_parallel} (each rank holds "
            f"2 of the sequence's 2 x CP chunks)"
        )
    if sequence_parallel and (seq_len // context_parallel) % tensor_parallel:
        raise MTNLGError(
            f"sequence_parallel: a context-parallel rank's {seq_len // context_parallel} tokens are not divisible "
            f"by tensor_parallel {tensor_parallel}"
        )
    if dropout:
        raise MTNLGError("context_parallel runs attention without dropout: set attention_dropout to 0")


# ---------------------------------------------------------------------------------------------- block kernels
class BlockKernel:
    """Attention of a block of queries over a block of keys/values, returning its log-sum-exp [B, H, Lq] (fp32),
    and the matching backward given the final output and log-sum-exp of the rows."""

    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def pick(kernel: str, device: torch.device, dtype: torch.dtype) -> BlockKernel:
        if kernel == "auto":
            kernel = "efficient" if device.type == "cuda" and dtype == torch.float32 else "flash"
        return BlockKernel(kernel)

    def forward(self, q, k, v, causal: bool):
        if q.device.type == "cpu":
            return torch_compat.flash_attention_cpu(q, k, v, causal)
        if self.name == "flash":
            return torch_compat.flash_attention(q, k, v, causal)
        return torch_compat.efficient_attention(q, k, v, causal)

    def backward(self, grad, q, k, v, out, lse, causal: bool):
        if q.device.type == "cpu":
            return torch_compat.flash_attention_cpu_backward(grad, q, k, v, out, lse, causal)
        if self.name == "flash":
            return torch_compat.flash_attention_backward(grad, q, k, v, out, lse, causal)
        return torch_compat.efficient_attention_backward(grad, q, k, v, out, lse, causal)


def _masked_scores(q, k, mask: torch.Tensor) -> torch.Tensor:
    scores = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf"))


def masked_block_forward(q, k, v, mask: torch.Tensor):
    """Attention of a block of queries over a block of keys under `mask` [B, 1, Lq, Lk] (True: seen), exactly, in
    fp32, with its log-sum-exp [B, H, Lq]. A row that sees none of the keys gets output 0 and log-sum-exp -inf, so
    merging it adds nothing."""
    scores = _masked_scores(q, k, mask)
    lse = scores.logsumexp(dim=-1)
    probs = (scores - lse.masked_fill(lse.isinf(), 0.0).unsqueeze(-1)).exp()
    return probs @ v.float(), lse


def masked_block_backward(grad, q, k, v, out, lse, mask: torch.Tensor):
    """The gradient of a masked block given the rows' final output and log-sum-exp (flash attention's backward,
    written out): dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d)."""
    scale = q.shape[-1] ** -0.5
    probs = (_masked_scores(q, k, mask) - lse.unsqueeze(-1)).exp()
    grad = grad.float()
    dv = probs.transpose(-1, -2) @ grad
    dscores = probs * (grad @ v.float().transpose(-1, -2) - (grad * out.float()).sum(dim=-1, keepdim=True))
    return dscores @ k.float() * scale, dscores.transpose(-1, -2) @ q.float() * scale, dv


# ---------------------------------------------------------------------------------------------- the ring
class Ring:
    """This rank's neighbours in its CP group (global ranks): it sends to the next and receives from the previous."""

    def __init__(self, group, ranks: list[int], cp_rank: int):
        self.group, self.cp_rank, self.size = group, cp_rank, len(ranks)
        self.next, self.previous = ranks[(cp_rank + 1) % self.size], ranks[(cp_rank - 1) % self.size]

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        """Post the sends of `tensors` to the next rank and the receives of the previous rank's; (works, received)
        for `wait`."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.previous, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def wait(works) -> None:
        for work in works:
            work.wait()

    def blocks(self, step: int, length: int):
        """(query rows, key/value rows, causal) of the block this rank computes at `step`, over its 2c local rows
        and the 2c rows of the key/value chunks it then holds (those of rank cp_rank - step); None: nothing."""
        c = length // 2
        source = (self.cp_rank - step) % self.size
        if step == 0:
            return slice(0, length), slice(0, length), True
        if source < self.cp_rank:
            return slice(0, length), slice(0, c), False
        return slice(c, length), slice(0, length), False

    def block_mask(
        self, document_ids: torch.Tensor | None, step: int, rows: slice, cols: slice, length: int, window=None
    ):
        """The document mask's part of the block at `step` ([B, 1, rows, cols] bool), or None where the plain
        kernel computes the block exactly (no packed rows, or no document boundary inside the block); `window`: a
        sliding layer's band on top (blocks wholly outside it are skipped, those it cuts masked)."""
        if document_ids is None:
            return None
        device = document_ids.device
        queries = local_positions(self.cp_rank, self.size, 0, length, device)[rows]
        keys = local_positions((self.cp_rank - step) % self.size, self.size, 0, length, device)[cols]
        allowed = document_mask(document_ids, queries, keys, window)
        plain = keys[None, :] <= queries[:, None]  # causal on the diagonal block, every key elsewhere
        return None if torch.equal(allowed, plain.expand_as(allowed)) else allowed


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _reduce(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: each key/value head's query-group copies summed."""
    if groups == 1:
        return t
    B, H, S, D = t.shape
    return t.view(B, H // groups, groups, S, D).sum(dim=2)


def _merge(out, lse, block_out, block_lse, rows) -> None:
    """Fold a block's result into the running output and log-sum-exp of `rows`, exactly (online softmax)."""
    old, new = lse[..., rows], torch.logaddexp(lse[..., rows], block_lse)
    kept, added = (old - new).exp().unsqueeze(-1), (block_lse - new).exp().unsqueeze(-1)
    out[:, :, rows] = out[:, :, rows] * kept + block_out * added
    lse[..., rows] = new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, ring: Ring, kernel: BlockKernel, document_ids: torch.Tensor | None, window=None, sinks=None
    ):
        groups = q.shape[1] // k.shape[1]
        length = q.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        held_k, held_v = k, v
        for step in range(ring.size):
            works, (next_k, next_v) = ring.shift([held_k, held_v]) if step < ring.size - 1 else ([], (None, None))
            rows, cols, causal = ring.blocks(step, length)
            mask = ring.block_mask(document_ids, step, rows, cols, length, window)
            if mask is None or mask.any():  # else none of these queries sees any of these keys
                block = (
                    q[:, :, rows].contiguous(),
                    _expand(held_k[:, :, cols], groups).contiguous(),
                    _expand(held_v[:, :, cols], groups).contiguous(),
                )
                if mask is None:
                    block_out, block_lse = kernel.forward(*block, causal)
                else:
                    block_out, block_lse = masked_block_forward(*block, mask)
                _merge(out, lse, block_out.float(), block_lse.float(), rows)
            Ring.wait(works)
            held_k, held_v = next_k, next_v
        share = None
        if sinks is not None:  # the sink's column takes 1 - share of each row: sigmoid(lse - sink) stays with the keys
            share = torch.sigmoid(lse - sinks.float()[None, :, None])
            out = out * share[..., None]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, share)
        ctx.ring, ctx.kernel, ctx.document_ids, ctx.window = ring, kernel, document_ids, window
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, share = ctx.saved_tensors
        ring, kernel, document_ids = ctx.ring, ctx.kernel, ctx.document_ids
        groups, length = q.shape[1] // k.shape[1], q.shape[2]
        d_sinks = None
        if share is not None:
            # With the sink's column, p'_ij = share_i P_ij (P: the softmax over the keys, from `lse`). The blocks'
            # backward given the output gradient times share and the output with the sink (its D_i = dO'_i . O'_i)
            # gives exactly dS_ij = P_ij (share_i g_i . v_j - share_i g_i . o'_i); the sink's own column, whose value
            # is 0, gets -(1 - share_i) g_i . o'_i.
            row_dot = (grad.float() * out.float()).sum(dim=-1)
            d_sinks = -((1 - share) * row_dot).sum(dim=(0, 2))
            grad = grad * share[..., None].to(grad.dtype)
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        held_k, held_v = k, v
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(ring.size):
            last = step == ring.size - 1
            works, (next_k, next_v) = ring.shift([held_k, held_v]) if not last else ([], (None, None))
            rows, cols, causal = ring.blocks(step, length)
            mask = ring.block_mask(document_ids, step, rows, cols, length, ctx.window)
            if mask is None or mask.any():
                block = (
                    *(t[:, :, rows].contiguous() for t in (grad, q)),
                    _expand(held_k[:, :, cols], groups).contiguous(),
                    _expand(held_v[:, :, cols], groups).contiguous(),
                    out[:, :, rows].contiguous(),
                    lse[..., rows].contiguous(),
                )
                if mask is None:
                    block_dq, block_dk, block_dv = kernel.backward(*block, causal)
                else:
                    block_dq, block_dk, block_dv = masked_block_backward(*block, mask)
                dq[:, :, rows] += block_dq.float()
                dk[:, :, cols] += _reduce(block_dk.float(), groups)
                dv[:, :, cols] += _reduce(block_dv.float(), groups)
            Ring.wait(works)
            # The key/value chunk goes on; its gradient so far goes with it, and after the last step reaches its owner.
            moved, (dk, dv) = ring.shift([dk, dv])
            Ring.wait(moved)
            held_k, held_v = next_k, next_v
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, d_sinks


class RingAttentionCore(nn.Module):
    """The attention core of a block under context parallelism (it replaces `model.AttentionCore`)."""

    def __init__(self, ring: Ring, kernel: str = "auto"):
        super().__init__()
        self.ring, self.kernel = ring, kernel

    def forward(self, q, k, v, dropout_p: float = 0.0, mask: DocumentMask | None = None, sinks=None):
        kernel = BlockKernel.pick(self.kernel, q.device, q.dtype)
        document_ids = mask.document_ids if mask is not None else None
        window = mask.window if mask is not None else None
        if mask is not None and mask.one_sequence:  # a sliding layer's row of one document: its ids, whole
            document_ids = torch.zeros(1, q.shape[2] * self.ring.size, dtype=torch.long, device=q.device)
        args = (self.ring, kernel, document_ids, window, sinks)
        return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), *args)


class _GatherContext(torch.autograd.Function):
    """This rank's two chunks [B, 2c, ...] -> the whole sequence [B, 2 CP c, ...] in order, on every CP rank;
    backward, the whole sequence's gradients summed over the CP group, this rank's chunks kept."""

    @staticmethod
    def forward(ctx, x, group, cp_rank: int, cp_size: int):
        ctx.group, ctx.cp_rank, ctx.cp_size = group, cp_rank, cp_size
        parts = [torch.empty_like(x) for _ in range(cp_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        chunks = [None] * (2 * cp_size)
        for rank, part in enumerate(parts):
            first, second = chunk_indices(rank, cp_size)
            chunks[first], chunks[second] = part.chunk(2, dim=SEQUENCE_DIM)
        return torch.cat(chunks, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return split_sequence(grad, ctx.cp_rank, ctx.cp_size), None, None, None


class ContextGather:
    """What a Gated DeltaNet layer does under context parallelism (`linear_attention.GatedDeltaNet.context`): its
    input gathered whole (`whole`), its output cut back to this rank's chunks (`mine`)."""

    def __init__(self, group, cp_rank: int, cp_size: int):
        self.group, self.cp_rank, self.cp_size = group, cp_rank, cp_size

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherContext.apply(x, self.group, self.cp_rank, self.cp_size)

    def mine(self, y: torch.Tensor) -> torch.Tensor:
        return split_sequence(y, self.cp_rank, self.cp_size)


# ---------------------------------------------------------------------------------------------- applied from outside
def _split_tokens(cp_rank: int, cp_size: int, module, args, kwargs):
    """A forward pre-hook of every stage: the tokens [B, S] (the stage holding the embedding; later stages receive
    this rank's hidden states already) and the `position_ids` when given become this rank's chunks. The
    `document_ids` stay whole: the ring masks each block from the ids of both its query and its key chunks."""
    if getattr(module, "whole_sequences", False):  # decoding (`whole_sequences`): the tokens stay whole
        return None
    tokens = args[0]
    if tokens.dtype in (torch.int32, torch.int64):
        if getattr(module, "mtp", None) is not None and kwargs.get("mtp_tokens") is None:
            kwargs = {**kwargs, "mtp_tokens": tokens}  # the depths read the tokens k ahead from the whole rows
        tokens = split_sequence(tokens, cp_rank, cp_size)
    if kwargs.get("position_ids") is not None:
        kwargs = {**kwargs, "position_ids": split_sequence(kwargs["position_ids"], cp_rank, cp_size)}
    return (tokens, *args[1:]), kwargs


def apply_context_parallel(model: nn.Module, ring: Ring, kernel: str = "auto") -> nn.Module:
    """Shard a built GPT (or pipeline stage) over the CP group in place: its blocks attend through the ring (packed
    rows masked block by block), its positions are those of this rank's chunks, and the stage with the embedding
    keeps only their tokens. A mixture of experts routes this rank's chunks, its router's statistics summed over
    the CP group (the losses of the whole sequences, each rank's gradient CP x its chunks' part, as the averaging
    over DP x CP expects)."""
    if ring.size == 1:
        return model
    mtp = getattr(model, "mtp", None)  # the multi-token prediction depths' blocks attend through the ring too
    blocks = [*model.blocks.values(), *([depth.block for depth in mtp.layers.values()] if mtp else [])]
    linear = [block.attn for block in blocks if isinstance(block.attn, GatedDeltaNet)]
    if any(layer.sequence_parallel for layer in linear):
        raise MTNLGError(
            "context_parallel with sequence parallelism cannot run Gated DeltaNet (linear_attention) layers yet "
            "(each gathers the whole sequence over CP, not its TP slices): turn sequence_parallel off"
        )
    for layer in linear:  # the recurrence over the whole sequence, in order: gathered, then cut back to its chunks
        layer.context = ContextGather(ring.group, ring.cp_rank, ring.size)
    for block in blocks:
        if not isinstance(block.attn, GatedDeltaNet):
            block.attn.core = RingAttentionCore(ring, kernel)
    if mtp is not None:
        model.sequence_chunks = functools.partial(split_sequence, cp_rank=ring.cp_rank, cp_size=ring.size)
    for _, layer in moe_layers(model):
        layer.sequence_groups.append((ring.group, ring.size))
    model.positions = functools.partial(local_positions, ring.cp_rank, ring.size)
    model.document_mask_kernel = "blocks"
    model.register_forward_pre_hook(functools.partial(_split_tokens, ring.cp_rank, ring.size), with_kwargs=True)
    return model


class _SumOverContext(torch.autograd.Function):
    """Per-row sums of this rank's chunks -> the whole sequences' (an all-reduce over the CP group). Backward hands
    each rank CP x the gradient of its own chunks' part: the CP ranks' parameter gradients are averaged (as data
    parallelism's are), so their mean is the gradient of the whole sequences."""

    @staticmethod
    def forward(ctx, per_row: torch.Tensor, group, cp_size: int) -> torch.Tensor:
        ctx.cp_size = cp_size
        total = per_row.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp_size, None, None


class ContextParallelLoss:
    """The loss of this rank's chunks of the targets, as a share of the whole sequence's: the token mean over its
    chunks times (its counted labels x CP / the sequence's). Averaged over the CP group (as the gradients are) it is
    the token mean of the whole sequence, however the ignored labels fall between the chunks; with every label
    counted, the ranks' counts are equal and the factor is exactly 1.0.

    An objective on whole sequences (DPO's summed log-probabilities) takes `chunk_of` the labels, scores this rank's
    positions, and adds the ranks' parts with `sum_over_sequence`."""

    def __init__(self, loss_fn, cp_rank: int, cp_size: int, group=None):
        self.loss_fn, self.cp_rank, self.cp_size, self.group = loss_fn, cp_rank, cp_size, group

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mine = self.chunk_of(labels)
        share = torch.div(counted_labels(mine) * self.cp_size, counted_labels(labels).clamp(min=1))
        return self.loss_fn(logits, mine) * share

    def chunk_of(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's positions of whole-row labels [B, S] (the chunks its logits are for)."""
        return split_sequence(labels, self.cp_rank, self.cp_size)

    def sum_over_sequence(self, per_row: torch.Tensor) -> torch.Tensor:
        """Per-row values summed over this rank's chunks [B] -> over the whole rows, on every CP rank."""
        return _SumOverContext.apply(per_row, self.group, self.cp_size)


@contextmanager
def whole_sequences(modules):
    """Run context-parallel `modules` (a model or its pipeline stages) on whole sequences for a while: the tokens
    stay whole and the positions are the plain ones, on every rank of the CP group alike. Decoding needs it (one new
    position at a time cannot be cut into chunks; it attends through the KV cache, not the ring); the weights are
    the same tensors, nothing is copied. (A mixture of experts' router statistics: `moe.routing_alone`.)"""
    chunked = [m for m in modules if isinstance(m.__dict__.get("positions"), functools.partial)]
    saved = [m.__dict__["positions"] for m in chunked]
    # Gated DeltaNet layers: their input is already whole (no gather)
    linear = [m for root in chunked for m in root.modules() if isinstance(m, GatedDeltaNet) and m.context is not None]
    gathers = [layer.context for layer in linear]
    for module in chunked:
        del module.positions  # the model's own: contiguous positions
        module.whole_sequences = True
    for layer in linear:
        layer.context = None
    try:
        yield
    finally:
        for module, positions in zip(chunked, saved, strict=True):
            module.positions, module.whole_sequences = positions, False
        for layer, gather in zip(linear, gathers, strict=True):
            layer.context = gather
