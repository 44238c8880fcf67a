"""Gated DeltaNet (Qwen3-Next's linear attention, `layer_types` linear_attention) in plain torch, as transformers'
`Qwen3NextGatedDeltaNet` computes it (`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`):

- projections: `in_proj_qkvz` viewed [B, S, n_k, 2 d_k + 2 (n_v / n_k) d_v], split per key head into q, k (d_k each),
  v and z ((n_v / n_k) d_v each); `in_proj_ba` viewed [B, S, n_k, 2 n_v / n_k] -> b, a (the layout is grouped by key
  head, not [all q; all k; ...]);
- a depthwise causal convolution (kernel `linear_conv_kernel_dim`, no bias) over cat(q, k, v) channels, then SiLU;
- beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (a log decay <= 0, fp32); q and k L2-normalised (fp32,
  eps 1e-6), q scaled by d_k^-1/2, q and k repeated to the n_v value heads;
- the recurrence per value head, state S [d_k, d_v]: S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
  o_t = S^T q_t; computed in chunks of 64 for a sequence (`chunk_gated_delta_rule`: a unit-triangular solve per
  chunk, then a scan over chunks), one step at a time when decoding (`recurrent_gated_delta_rule`);
- the output normed per value head and gated: w * rmsnorm(o) * silu(z) (`GatedRMSNorm`), then `out_proj`.

Packed rows (`document_ids`): the convolution and the state restart at each document (each document's run is
computed alone), which transformers' torch path does not do. Decoding keeps, per layer, the convolution's last
kernel - 1 inputs and the state (fp32) in the `KVCache` (`states`): a constant size whatever the length.

On CUDA with flash-linear-attention installed (and causal-conv1d, for the convolution), a sequence or a prefill
runs on their kernels instead (`fla_kernels`: every document of the batch in one call, the state restarted by
offsets); a decoding step stays the torch recurrence. Everywhere else, CPU included, the torch path below runs.

Tensor parallelism splits the layer by key heads (`parallel/tensor_parallel.py`): each rank holds a contiguous run
of key heads and their value heads. `in_proj_qkvz` and `in_proj_ba` are grouped by key head already (a column split
is whole heads), so is every per-value-head parameter (A_log, dt_bias: value head j belongs to key head j // (n_v /
n_k)). The convolution's channels are cat(all q, all k, all v) in transformers' file, which no contiguous split
keeps whole: this module holds them grouped by key head instead ([q_h, k_h, v_h] per key head h, the order of
in_proj_qkvz's first 2 d_k + (n_v / n_k) d_v features per head), and the mapping permutes them on import and export
(`grouped_conv_channels`), so a rank's shard is contiguous and the checkpoint's plain dim-0 gathering is right. The
gated norm's weight [d_v] is replicated (its gradient, each rank's from its own heads, summed), `out_proj` row
parallel. Under context parallelism each CP rank runs the layer over its own two chunks of the sequence, and the
ranks pass the recurrence's state between the chunks in sequence order (`parallel/context_parallel.
ContextStatePassing`): a run whose incoming state is not known yet runs as an affine map of it
(`chunk_gated_delta_rule_map`: output o_0 + reads S0, final state M S0 + C), the convolution reads the kernel - 1
inputs before its chunk from the neighbouring chunk, and the layer's compute and activations are those of the
rank's chunks. `ContextGather` (the whole sequence gathered on every CP rank, run as one process) is the other path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning import fla_kernels
from mtnlg_lightning.errors import MTNLGError

CHUNK = 64  # transformers' chunk of the sequence


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the rule, the decay and the gated norm compute in: fp32 whatever the model's dtype, float64 for a
    float64 model (so its tests see the arithmetic, not fp32's rounding)."""
    return torch.promote_types(dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[B, L, heads, d] inputs -> fp32 [B, n_v, L, d], q and k normalised and repeated to the value heads."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    dtype = compute_dtype(v.dtype)
    q, k, v, beta, g = (x.transpose(1, 2).to(dtype).contiguous() for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None):
    """q, k [B, L, n_k, d_k], v [B, L, n_v, d_v], g and beta [B, L, n_v] -> (o [B, L, n_v, d_v] in v's dtype, the
    final state [B, n_v, d_k, d_v] fp32), from `state` (zeros: a sequence's start)."""
    out, S = _chunk_scan(*_prepare(q, k, v, g, beta), state)
    return out.transpose(1, 2).to(v.dtype).contiguous(), S


def chunk_gated_delta_rule_map(q, k, v, g, beta):
    """The rule over a run whose incoming state S0 is not known yet (context parallelism: the state comes from
    another rank's chunk), as an affine map of S0 (inputs as `chunk_gated_delta_rule`'s) -> (o_0 [B, L, n_v, d_v],
    reads [B, L, n_v, d_k], C [B, n_v, d_k, d_v], M [B, n_v, d_k, d_k]), all fp32: the output from S0 is
    o_0 + reads S0 and the final state M S0 + C (per value head, [L, d_k] @ [d_k, d_v] and [d_k, d_k] @ [d_k, d_v]).

    Each step of the chunked form acts on the state's columns one by one (v_new = U - W S, o = Qd S + A v_new,
    S' = gamma S + Kd^T v_new), so the scan of the state [0 | I] with values [v | 0] carries (C, M) in its state and
    (o_0, reads) in its output, in one pass over d_v + d_k columns."""
    out, S = _chunk_scan(*_prepare(q, k, v, g, beta), None, carry_identity=True)
    dv = v.shape[-1]
    o0, reads = out.transpose(1, 2).split([dv, out.shape[-1] - dv], dim=-1)
    C, M = S.split([dv, S.shape[-1] - dv], dim=-1)
    return o0, reads, C, M


def _chunk_scan(q, k, v, g, beta, state: torch.Tensor | None, carry_identity: bool = False):
    """The chunked form over prepared fp32 [B, n_v, L, d] inputs -> (o fp32 [B, n_v, L, d_v], the final state);
    `carry_identity`: d_k more columns, values 0 and state I (`chunk_gated_delta_rule_map`)."""
    length = q.shape[2]
    B, H, _, dk = k.shape
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, H, -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(B, H, -1, CHUNK).cumsum(dim=-1)  # the log decay from the chunk's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    within = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(
        system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=v.dtype, device=v.device) if state is None else state.to(v.dtype)
    if carry_identity:
        new_values = F.pad(new_values, (0, dk))
        S = torch.cat([S, torch.eye(dk, dtype=S.dtype, device=S.device).expand(B, H, dk, dk)], dim=-1)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_decayed[:, :, i] @ S
        out[:, :, i] = q[:, :, i] @ S + within[:, :, i] @ v_new
        S = S * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, H, -1, out.shape[-1])[:, :, :length], S


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None):
    """The same, one position at a time (decoding; the reference of the chunked form)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, length, dk = k.shape
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=v.dtype, device=v.device) if state is None else state.to(v.dtype)
    out = torch.empty_like(v)
    for t in range(length):
        S = S * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (S * k[:, :, t].unsqueeze(-1)).sum(dim=-2)) * beta[:, :, t].unsqueeze(-1)
        S = S + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (S * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).to(dtype).contiguous(), S


def grouped_conv_channels(nk: int, nv: int, dk: int, dv: int) -> torch.Tensor:
    """For each of our convolution channels (grouped by key head: [q_h, k_h, v_h] for h < nk) the index of the same
    channel in transformers' order (cat(all q, all k, all v)): ours = theirs[order], theirs = ours[argsort(order)]."""
    vw = nv // nk * dv  # one key head's value width
    q, k = torch.arange(nk * dk).view(nk, dk), nk * dk + torch.arange(nk * dk).view(nk, dk)
    v = 2 * nk * dk + torch.arange(nk * vw).view(nk, vw)
    return torch.cat([q, k, v], dim=1).flatten()


class Decay(nn.Module):
    """Each value head's log decay per token from its `a`: g = -exp(A_log) softplus(a + dt_bias) <= 0 (fp32)."""

    def __init__(self, heads: int):
        super().__init__()
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))  # decay rates A in [1, 16]

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(a.dtype)
        return -self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias)


class GatedRMSNorm(nn.Module):
    """w * rmsnorm(x) * silu(gate): the norm in fp32, weighted in x's dtype, gated in fp32 (weight init 1)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = x.to(compute_dtype(x.dtype))
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (y * F.silu(gate.to(compute_dtype(gate.dtype)))).to(x.dtype)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: True where a run of one document starts in a packed row (position 0 and each change of id)."""
    if bool((document_ids < -1).any()):
        raise MTNLGError("Gated DeltaNet layers cannot continue a prefix document in branches (GRPO's shared prompt)")
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_runs(document_ids: torch.Tensor | None, rows: int, length: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of each run of one document in a packed row ([B, S] ids), or each whole row."""
    if document_ids is None:
        return [(b, 0, length) for b in range(rows)]
    runs = []
    for b, row in enumerate(document_starts(document_ids)):
        starts = [*torch.nonzero(row).flatten().tolist(), length]
        runs += [(b, s, e) for s, e in zip(starts[:-1], starts[1:], strict=True)]
    return runs


class GatedDeltaNet(nn.Module):
    """A block's token mixer in a linear_attention layer; the same call as `model.Attention` (rotary unused)."""

    def __init__(self, config, index: int = 0):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_eps
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv, kernel = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
        self.nk, self.nv, self.dk, self.dv = nk, nv, dk, dv
        self.in_proj_qkvz = nn.Linear(h, 2 * nk * dk + 2 * nv * dv, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * nv, bias=False)
        channels = 2 * nk * dk + nv * dv  # grouped by key head (`grouped_conv_channels`): each TP shard whole heads
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False, padding=kernel - 1)
        self.decay = Decay(nv)
        self.norm = GatedRMSNorm(dv, eps=eps)
        self.out_proj = nn.Linear(nv * dv, h, bias=False)
        self.sequence_parallel = False  # set by tensor parallelism (`split_heads`)
        # how this layer runs over this rank's chunks of a sequence under context parallelism, called as
        # context(layer, x, mask) (`parallel/context_parallel.ContextStatePassing` or `ContextGather`); None: this
        # rank's input is the whole sequence
        self.context = None

    def split_heads(self, size: int, sequence_parallel: bool = False) -> None:
        """Hold the head counts of one of `size` tensor-parallel ranks (the caller shards the parameters)."""
        if self.nk % size:
            raise MTNLGError(
                f"tensor_parallel {size} does not divide Gated DeltaNet's {self.nk} key heads (linear_num_key_heads)"
            )
        self.nk, self.nv = self.nk // size, self.nv // size
        self.sequence_parallel = sequence_parallel

    @property
    def kernel(self) -> int:
        return self.conv1d.weight.shape[-1]

    def _convolve(self, x: torch.Tensor, before: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, C] -> (silu(causal depthwise conv) [B, L, C], the last kernel - 1 inputs [B, C, kernel - 1]),
        `before` the inputs preceding x (None: zeros, a sequence's start)."""
        channels = x.transpose(1, 2)
        if before is None:
            before = channels.new_zeros(*channels.shape[:2], self.kernel - 1)
        window = torch.cat([before.to(channels.dtype), channels], dim=-1)
        out = F.conv1d(window, self.conv1d.weight, groups=window.shape[1])
        return F.silu(out).transpose(1, 2), window[..., window.shape[-1] - (self.kernel - 1) :]

    def rule_inputs(self, mixed, conv_state=None):
        """One run's convolution (`_convolve`) split into the rule's q, k [B, L, n_k, d_k] and v [B, L, n_v, d_v];
        with the convolution's last kernel - 1 inputs."""
        conv, conv_state = self._convolve(mixed, conv_state)
        return self.split_convolved(conv), conv_state

    def split_convolved(self, conv: torch.Tensor):
        """The convolution's output [B, L, channels] ([q_h, k_h, v_h] per key head) -> q, k [B, L, n_k, d_k] and
        v [B, L, n_v, d_v]."""
        B, L, _ = conv.shape
        r = self.nv // self.nk
        q, k, v = conv.view(B, L, self.nk, -1).split([self.dk, self.dk, r * self.dv], dim=-1)
        return q, k, v.reshape(B, L, self.nv, self.dv)

    def _mix(self, mixed, beta, g, z, conv_state=None, state=None, recurrent=False):
        """One run (a document, a row, or a decoding step): conv, the rule, the gated norm -> [B, L, nv * dv]."""
        B, L, _ = mixed.shape
        (q, k, v), conv_state = self.rule_inputs(mixed, conv_state)
        rule = recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
        o, state = rule(q, k, v, g, beta, state)
        return self.norm(o, z).reshape(B, L, -1), conv_state, state

    def _fused(self, kernels, mixed, beta, g, z, document_ids=None, final_state=False):
        """`_mix` of every run of the batch in one call of each kernel (`fla_kernels`) -> [B, S, nv * dv], and with
        `final_state` (a prefill: one run per row) the conv inputs and the state decoding continues from."""
        B, S, C = mixed.shape
        offsets = run = None
        if document_ids is not None:  # packed rows: one row of runs, each restarting the convolution and the state
            starts = document_starts(document_ids).flatten()
            offsets, run = fla_kernels.cu_seqlens(starts), fla_kernels.run_index(starts)
            mixed, g, beta = mixed.reshape(1, B * S, C), g.reshape(1, B * S, -1), beta.reshape(1, B * S, -1)
        q, k, v = self.split_convolved(fla_kernels.convolve(kernels, mixed, self.conv1d.weight, run))
        o, state = fla_kernels.chunk_rule(kernels, q, k, v, g, beta, offsets, final_state)
        out = self.norm(o.view(B, S, self.nv, self.dv), z).reshape(B, S, -1)
        if not final_state:
            return out, None, None
        kernel = self.conv1d.weight.shape[-1]  # the last kernel - 1 inputs, zeros before a shorter prompt
        return out, F.pad(mixed.transpose(1, 2), (kernel - 1, 0))[..., S:], state

    def forward(self, x: torch.Tensor, rotary=None, cache=None, mask=None) -> torch.Tensor:
        if self.context is not None and cache is None:  # this rank's chunks of a sequence (context parallelism)
            return self.context(self, x, mask)
        return self._forward(x, mask, cache)

    def project(self, x: torch.Tensor):
        """x [B, S, hidden] -> the convolution's input channels `mixed` [B, S, 2 n_k d_k + n_v d_v] ([q_h, k_h, v_h]
        per key head), the gate z [B, S, n_v, d_v], beta and the log decay g [B, S, n_v]."""
        qkvz = self.in_proj_qkvz(x)  # the whole sequence under sequence parallelism (x: this rank's slice)
        B, S, _ = qkvz.shape
        r = self.nv // self.nk
        mixed, z = qkvz.view(B, S, self.nk, -1).split([2 * self.dk + r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, S, self.nk, 2 * r).split([r, r], dim=-1)
        beta = b.reshape(B, S, self.nv).sigmoid()
        g = self.decay(a.reshape(B, S, self.nv))
        return mixed.reshape(B, S, -1), z.reshape(B, S, self.nv, self.dv), beta, g

    def _forward(self, x: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        mixed, z, beta, g = self.project(x)
        B, S, _ = mixed.shape
        kernels = fla_kernels.kernels_for(x)  # None: the torch path (CPU, or fla not installed)
        if cache is not None:  # decoding: this layer's conv inputs and state continue, a prefill starts them
            held = cache.cache.states.setdefault(cache.name, {})
            step = S == 1 and bool(held)
            if kernels is not None and not step:  # a step is a few small ops: the torch recurrence
                out, held["conv"], held["state"] = self._fused(kernels, mixed, beta, g, z, final_state=True)
            else:
                out, held["conv"], held["state"] = self._mix(
                    mixed, beta, g, z, held.get("conv") if step else None, held.get("state") if step else None, step
                )
            return self.out_proj(out)
        ids = getattr(mask, "document_ids", None)
        if ids is None or getattr(mask, "one_sequence", False):
            ids = None
        if kernels is not None:
            return self.out_proj(self._fused(kernels, mixed, beta, g, z, ids)[0])
        if ids is None:
            return self.out_proj(self._mix(mixed, beta, g, z)[0])
        parts = [  # each document alone: the convolution and the state restart at its first token
            self._mix(*(t[row : row + 1, s:e] for t in (mixed, beta, g, z)))[0]
            for row, s, e in document_runs(ids, B, S)
        ]
        return self.out_proj(torch.cat(parts, dim=1).view(B, S, -1))
