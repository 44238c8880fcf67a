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

Gated DeltaNet layers (`linear_attention.py`) are a recurrence in sequence order, and a rank's chunks r and
2CP-1-r are not neighbours. Each rank runs such a layer over its own two chunks (`ContextStatePassing`, the default)
and the ranks pass what crosses a chunk boundary. The rule over a chunk is affine in its incoming state S0 (per row
and value head, S [d_k, d_v] fp32): its output is o_0 + reads S0 and its final state M S0 + C, one pass of the
chunked form over the state [S0 | I] (`linear_attention.chunk_gated_delta_rule_map`); a document starting inside
the chunk cuts the dependence (the runs after it start from zero, M = 0), and a chunk that starts a document reads
no S0. Per layer each rank all-gathers (1) every chunk's (C | M): per row and value head d_k x d_v + d_k x d_k fp32
per chunk, two chunks per rank, whatever the length; each rank then composes the incoming states of its two chunks
in sequence order (S_0 = 0, S_{j+1} = M_j S_j + C_j, up to 2CP small matmuls) and adds reads S0 to their outputs;
and (2) the short convolution's kernel - 1 inputs at the end of every chunk (per row (kernel - 1) x (2 n_k d_k +
n_v d_v) values, the projected q/k/v channels), the window before each chunk (zeros before the sequence and before
the chunk's document). Backward, each gathered
piece's gradient is summed over the CP group to its owner. Exact (threaded cp2 and cp3, packed or not, within 1e-11
in float64; cp2 trains like one process); each rank computes and keeps these layers' activations for its 2c tokens
only, the scan of the chunks whose state comes in carrying d_k more columns (for M): at cp2, Qwen3-Next's head dims
and 4096 tokens, a layer's activations per rank are 0.61 of the whole sequence's (`benchmarks/
bench_context_parallel_memory.py --gated-deltanet`). `ContextGather` is the other path (`apply_context_parallel(...,
linear="gather")`): the whole sequence's hidden states all-gathered (the chunks put back in order), the layer run over
it as one process does, this rank's chunks kept; backward, each rank's gradient of the whole sequence's input summed
over the CP group, its chunks' kept. Exact, but CP saves nothing in these layers. With sequence parallelism either is
refused in one line (neither takes the TP slices of the chunks yet).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning import torch_compat
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.linear_attention import (
    GatedDeltaNet,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_map,
    document_starts,
)
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
    """A Gated DeltaNet layer under context parallelism that runs over the whole sequence
    (`linear_attention.GatedDeltaNet.context`): its input gathered whole (`whole`), its output cut back to this
    rank's chunks (`mine`). Exact, but CP saves nothing in the layer; `ContextStatePassing` is the default."""

    def __init__(self, group, cp_rank: int, cp_size: int):
        self.group, self.cp_rank, self.cp_size = group, cp_rank, cp_size

    def __call__(self, layer: GatedDeltaNet, x: torch.Tensor, mask) -> torch.Tensor:
        return self.mine(layer._forward(self.whole(x), mask))

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherContext.apply(x, self.group, self.cp_rank, self.cp_size)

    def mine(self, y: torch.Tensor) -> torch.Tensor:
        return split_sequence(y, self.cp_rank, self.cp_size)


class _GatherOverContext(torch.autograd.Function):
    """Each CP rank's `x` -> every rank's stacked [CP, ...] (by CP rank), on every rank. Backward: each rank read
    every piece, so a piece's gradient is the sum of the ranks' gradients of it, handed to its owner (an all-reduce
    of the whole stack, then the owner's piece: gloo has no reduce-scatter, and the pieces here are small)."""

    @staticmethod
    def forward(ctx, x, group, cp_rank: int, cp_size: int):
        ctx.group, ctx.cp_rank = group, cp_rank
        parts = [torch.empty_like(x) for _ in range(cp_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.cp_rank], None, None, None


class ContextStatePassing:
    """A Gated DeltaNet layer under context parallelism that runs over this rank's two chunks only
    (`linear_attention.GatedDeltaNet.context`; the default). What crosses a chunk boundary in sequence order is
    exchanged over the CP group, two all-gathers per layer:

    - the convolution's kernel - 1 inputs (the projected q/k/v channels before it) at the end of each chunk: each
      chunk's window is its predecessors' (zeros before the sequence and before the chunk's document's start);
    - each chunk's recurrence as an affine map of its incoming state S0, per row and value head: the final state
      M S0 + C (M [d_k, d_k], C [d_k, d_v], fp32; `chunk_gated_delta_rule_map`), M = 0 where a document starts in
      the chunk (its final state does not see S0). Every rank composes the incoming states of its two chunks from
      the 2 x CP maps in sequence order (a scan of small matmuls), then adds reads S0 to its first run's output.

    Backward, each gathered piece's gradient is summed over the group to its owner (`_GatherOverContext`). Each
    rank's graph reaches both gathers whatever its documents (its second chunk always reads a window and an
    incoming state, times 0 where its document starts there), so every rank runs their backward collectives, in
    the same order."""

    def __init__(self, group, cp_rank: int, cp_size: int):
        self.group, self.cp_rank, self.cp_size = group, cp_rank, cp_size

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks' pieces [2, ...] -> every chunk's, [CP, 2, ...] (`of_chunk` reads them)."""
        return _GatherOverContext.apply(x, self.group, self.cp_rank, self.cp_size)

    def of_chunk(self, gathered: torch.Tensor, chunk: int) -> torch.Tensor:
        """The piece of sequence chunk `chunk` (of 2 x CP) in a `gather`ed stack."""
        if chunk < self.cp_size:
            return gathered[chunk, 0]
        return gathered[2 * self.cp_size - 1 - chunk, 1]

    def __call__(self, layer: GatedDeltaNet, x: torch.Tensor, mask) -> torch.Tensor:
        mixed, z, beta, g = layer.project(x)  # this rank's 2c tokens: chunks r and 2CP-1-r, in sequence order
        B, length, _ = mixed.shape
        c, chunks = length // 2, chunk_indices(self.cp_rank, self.cp_size)
        starts, document_start = self._documents(mask)
        windows = self._windows(mixed, layer.kernel - 1, chunks, c, document_start)
        pieces, maps = [], []
        for i, (chunk, window) in enumerate(zip(chunks, windows, strict=True)):
            part = slice(i * c, (i + 1) * c)
            groups = self._row_groups(chunk, c, B, starts, document_start, mixed.device)
            piece, state_map = self._run_chunk(layer, chunk, *(t[:, part] for t in (mixed, beta, g)), window, groups)
            pieces.append(piece)
            maps.append(state_map)
        incoming = self._incoming_states(self.gather(torch.stack(maps)), chunks, layer.dv)
        o = torch.cat([self._read_incoming(p, S0, mixed.dtype) for p, S0 in zip(pieces, incoming, strict=True)], 1)
        return layer.out_proj(layer.norm(o, z).reshape(B, length, -1))  # o: [B, 2c, n_v, d_v]

    @staticmethod
    def _documents(mask) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """For packed rows ([B, S] `document_ids`, whole on every rank): where a document starts (bool) and, for
        each position, where its document started; (None, None) for rows of one sequence."""
        ids = None if getattr(mask, "one_sequence", False) else getattr(mask, "document_ids", None)
        if ids is None:
            return None, None
        starts = document_starts(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)
        return starts, torch.where(starts, positions, 0).cummax(dim=1).values

    @staticmethod
    def _run_chunk(layer: GatedDeltaNet, chunk: int, mixed, beta, g, window, groups):
        """One chunk's runs [B, c, ...] before its incoming state is known -> (per row group: rows, whether the
        chunk continues a document, its first run's o_0 (fp32; in the model's dtype for the sequence's first
        chunk) and reads (None there), the later runs' outputs; the chunk's final state as (C | M) [B, n_v, d_k,
        d_v + d_k])."""
        pieces, maps = [], []
        for rows, bounds, continued in groups:
            m, b, d = (t[rows] for t in (mixed, beta, g))
            s, e = bounds[0]
            qkv, _ = layer.rule_inputs(m[:, s:e], window[rows] if window is not None else None)
            if chunk == 0:  # the sequence's start: the incoming state is zero
                o0, state = chunk_gated_delta_rule(*qkv, d[:, s:e], b[:, s:e])
                reads, M = None, state.new_zeros(*state.shape[:-1], state.shape[-2])
            else:
                o0, reads, state, M = chunk_gated_delta_rule_map(*qkv, d[:, s:e], b[:, s:e])
                M = M * continued[:, None, None, None]  # a chunk that starts a document ignores S0
            later = []
            for s, e in bounds[1:]:  # documents that start inside the chunk: from a zero state
                qkv, _ = layer.rule_inputs(m[:, s:e])
                o, state = chunk_gated_delta_rule(*qkv, d[:, s:e], b[:, s:e])
                later.append(o)
            if later:  # the final state is the last document's, which S0 does not reach
                M = torch.zeros_like(M)
            pieces.append((rows, continued, o0, reads, later))
            maps.append(torch.cat([state, M], dim=-1))
        return pieces, torch.cat(maps)

    @staticmethod
    def _read_incoming(pieces, S0: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A chunk's output [B, c, n_v, d_v] from its `_run_chunk` pieces and its incoming state S0: its first
        run's o_0 + reads S0 (per value head, [L, d_k] @ [d_k, d_v]; S0 times 0 where the chunk starts a
        document), then the later runs'."""
        rows_out = []
        for rows, continued, o0, reads, later in pieces:
            if reads is not None:
                S0_rows = S0[rows] * continued[:, None, None, None]
                o0 = (o0 + torch.einsum("blhk,bhkv->blhv", reads, S0_rows)).to(dtype)
            rows_out.append(torch.cat([o0, *later], dim=1))
        return torch.cat(rows_out)

    def _windows(self, mixed, width: int, chunks, c: int, document_start) -> list[torch.Tensor | None]:
        """The `width` (kernel - 1) convolution inputs before each of this rank's chunks, [B, C, width] as
        `GatedDeltaNet._convolve` takes them (None for the sequence's first chunk). Every chunk's last min(c, width)
        inputs are gathered, so a window spans several chunks when chunks are shorter than it; inputs before the
        sequence or before the document of the chunk's first token (`document_start`: each position's, or None) are
        zeros, as one process's run of that document has."""
        if width == 0:  # a kernel of 1 reads nothing before a chunk
            return [None] * len(chunks)
        tail = min(c, width)
        length = mixed.shape[1]
        tails = self.gather(torch.stack([mixed[:, c - tail : c], mixed[:, length - tail :]]))  # [CP, 2, B, t, C]
        needed = -(-width // tail)  # the chunks whose tails cover a window
        windows = []
        for chunk in chunks:
            if chunk == 0:
                windows.append(None)
                continue
            before = torch.cat([self.of_chunk(tails, j) for j in range(max(0, chunk - needed), chunk)], dim=1)
            if before.shape[1] >= width:
                before = before[:, before.shape[1] - width :]
            else:  # the window reaches before the sequence
                before = F.pad(before, (0, 0, width - before.shape[1], 0))
            positions = chunk * c - width + torch.arange(width, device=mixed.device)
            keep = (positions >= 0)[None, :]
            if document_start is not None:
                keep = keep & (positions[None, :] >= document_start[:, chunk * c, None])
            windows.append((before * keep[..., None].to(before.dtype)).transpose(1, 2))
        return windows

    @staticmethod
    def _row_groups(chunk: int, c: int, rows: int, starts, document_start, device):
        """(rows, the chunk's runs of one document [(start, end)] within it, whether each row's first run continues
        the previous chunk's document [rows] float) for each group of rows that share the runs: all rows of one
        sequence each, or each packed row alone."""
        begin = chunk * c
        if starts is None:
            continued = torch.full((rows,), float(chunk > 0), device=device)
            return [(slice(0, rows), [(0, c)], continued)]
        groups = []
        for row in range(rows):
            inside = (torch.nonzero(starts[row, begin + 1 : begin + c]).flatten() + 1).tolist()
            bounds = [0, *inside, c]
            continued = (document_start[row : row + 1, begin] < begin).float()
            groups.append((slice(row, row + 1), list(zip(bounds[:-1], bounds[1:], strict=True)), continued))
        return groups

    def _incoming_states(self, maps: torch.Tensor, chunks, dv: int) -> list[torch.Tensor]:
        """The state entering each of this rank's chunks, from every chunk's (C | M) [CP, 2, B, n_v, d_k, d_v + d_k]:
        S_0 = 0, S_{j+1} = M_j S_j + C_j, in sequence order up to this rank's later chunk."""
        S = torch.zeros_like(maps[0, 0, ..., :dv])
        incoming = {}
        for chunk in range(max(chunks)):
            incoming[chunk] = S
            C, M = self.of_chunk(maps, chunk).split([dv, maps.shape[-1] - dv], dim=-1)
            S = M @ S + C
        incoming[max(chunks)] = S
        return [incoming[chunk] for chunk in chunks]


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


LINEAR_CONTEXT = {"states": ContextStatePassing, "gather": ContextGather}  # how Gated DeltaNet layers run


def apply_context_parallel(model: nn.Module, ring: Ring, kernel: str = "auto", linear: str = "states") -> nn.Module:
    """Shard a built GPT (or pipeline stage) over the CP group in place: its blocks attend through the ring (packed
    rows masked block by block), its positions are those of this rank's chunks, and the stage with the embedding
    keeps only their tokens. A mixture of experts routes this rank's chunks, its router's statistics summed over
    the CP group (the losses of the whole sequences, each rank's gradient CP x its chunks' part, as the averaging
    over DP x CP expects). Gated DeltaNet layers run their chunks and pass the recurrence's state between the ranks
    (`linear` "states": `ContextStatePassing`), or gather the whole sequence ("gather": `ContextGather`)."""
    if ring.size == 1:
        return model
    mtp = getattr(model, "mtp", None)  # the multi-token prediction depths' blocks attend through the ring too
    blocks = [*model.blocks.values(), *([depth.block for depth in mtp.layers.values()] if mtp else [])]
    linear_layers = [block.attn for block in blocks if isinstance(block.attn, GatedDeltaNet)]
    if any(layer.sequence_parallel for layer in linear_layers):
        raise MTNLGError(
            "context_parallel with sequence parallelism cannot run Gated DeltaNet (linear_attention) layers yet "
            "(not built for TP slices of the chunks): turn sequence_parallel off"
        )
    for layer in linear_layers:  # the recurrence in sequence order across the ranks' chunks
        layer.context = LINEAR_CONTEXT[linear](ring.group, ring.cp_rank, ring.size)
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
