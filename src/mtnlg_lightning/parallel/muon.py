"""Muon (momentum orthogonalised by Newton-Schulz) for the hidden weight matrices, AdamW for the rest: one torch
optimizer, `MuonAdamW`, whose step is `torch.optim.Muon`'s and `torch.optim.AdamW`'s on the same parameter split.

Muon needs each weight matrix whole, and the layouts take matrices apart; here each is put back together for the
orthogonalisation only (the momentum, the decay and the update stay elementwise on the local shard):
- a fused QKV weight (rows [heads, 3, head_dim]) is three matrices, Q, K and V, as the unfused model's q, k, v;
- stacked experts [E, out, in] are E matrices (under expert parallelism each rank holds whole experts);
- a tensor-parallel shard is gathered to one TP rank (the TP-split matrices shared out over the TP ranks,
  balanced), in the Newton-Schulz dtype (the iteration starts from it, so the gather is exact), which
  orthogonalises the whole matrix and scatters the shards of the result (fp32) back. Cost per step: every TP-split
  hidden matrix gathered (bf16) and scattered (fp32) once, (TP-1)/TP of it over the owner's link each way; the
  Newton-Schulz FLOPs divided by TP (all TP ranks orthogonalise their share at the same time);
- a pipeline stage steps the matrices it holds;
- data-parallel replicas (ZeRO stage 0, DP x CP) share the dense matrices out (`balanced_owners`): each is stepped
  by one replica, which keeps its momentum and broadcasts the updated weight; stacked experts are stepped by every
  rank holding them;
- DeepSpeed ZeRO 1-3 hand the optimizer flat fp32 partitions that cut the matrices anywhere (`ZeroShare`): the
  momentum stays partitioned as ZeRO keeps Adam's moments (elementwise on each rank's partition); each matrix has
  an owner among the ranks of the partition (`balanced_owners`), which receives every rank's piece of its momentum-
  combined gradient (one all-to-all, in the Newton-Schulz dtype), orthogonalises the whole matrix (with the TP
  gather above among the owners) and sends each rank the update of its piece back (one all-to-all, fp32); ZeRO
  then gathers the weights as it does for AdamW.

The Newton-Schulz iteration, the learning-rate adjustment and the order of the update are torch 2.13's
(`torch/optim/_muon.py`), except that the momentum buffer is never normalised in place (torch does, for bf16
parameters without Nesterov).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.torch_compat import adamw_group_step

MOMENTUM_BUFFER = "momentum_buffer"  # Muon's one state tensor per matrix (torch's name)
ADJUST_LR = ("original", "match_rms_adamw")
NS_DTYPES = ("bfloat16", "float32")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's (Keller Jordan's quintic)


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyper-parameters, torch's names and defaults except `adjust_lr` (torch's `adjust_lr_fn`): lr and
    weight_decay default to the run's AdamW ones (None), so `match_rms_adamw` (Moonlight's scale, which lets Muon
    reuse AdamW's lr and decay) is the default. `ns_dtype` (ours): the Newton-Schulz iteration's precision, torch's
    bfloat16 or float32 (slower; its result moves smoothly with the gradient, where bf16's rounding turns the fp32
    noise of re-ordered sums, e.g. another layout's, into differences of ~1e-3 of an update)."""

    lr: float | None = None
    weight_decay: float | None = None
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    adjust_lr: str = "match_rms_adamw"
    ns_dtype: str = "bfloat16"

    @classmethod
    def from_dict(cls, values: dict | None) -> MuonSettings:
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            known = ", ".join(cls.__dataclass_fields__)
            raise MTNLGError(f"model.muon has no setting {unknown[0]!r} (it takes {known})")
        if "ns_coefficients" in values:
            values["ns_coefficients"] = tuple(float(c) for c in values["ns_coefficients"])
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        if self.ns_dtype not in NS_DTYPES:
            raise MTNLGError(f"model.muon.ns_dtype {self.ns_dtype!r} is not one of {', '.join(NS_DTYPES)}")
        if self.adjust_lr not in ADJUST_LR:
            raise MTNLGError(f"model.muon.adjust_lr {self.adjust_lr!r} is not one of {', '.join(ADJUST_LR)}")
        if len(self.ns_coefficients) != 3:
            raise MTNLGError(f"model.muon.ns_coefficients takes 3 numbers, got {len(self.ns_coefficients)}")
        if not 1 <= self.ns_steps < 100:
            raise MTNLGError(f"model.muon.ns_steps must be in [1, 100), got {self.ns_steps}")
        if not 0.0 <= self.momentum < 1.0:
            raise MTNLGError(f"model.muon.momentum must be in [0, 1), got {self.momentum}")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise MTNLGError(f"model.muon.{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class MatrixLayout:
    """How one Muon parameter's local tensor relates to the matrices Muon orthogonalises: `qkv_head_dim` for a
    fused QKV weight (rows [heads, 3, head_dim]: Q, K, V each one matrix), stacked experts by their 3 dimensions;
    `tp_dim` / `tp_index` / `tp_count`: shard `tp_index` of `tp_count` along `tp_dim` over the TP group (None when
    the tensor is whole on this rank)."""

    qkv_head_dim: int | None = None
    tp_dim: int | None = None
    tp_index: int = 0
    tp_count: int = 1


def matrix_layout(param: torch.Tensor, fused_qkv_head_dim: int | None, tp_size: int) -> MatrixLayout:
    """The layout of a parameter from the marks tensor parallelism leaves on it (`parallel/tensor_parallel.py`)."""
    sharded = tp_size > 1 and hasattr(param, "partition_dim") and getattr(param, "partition_count", 1) > 1
    if not sharded:
        return MatrixLayout(fused_qkv_head_dim)
    return MatrixLayout(fused_qkv_head_dim, param.partition_dim, param.partition_index, param.partition_count)


def newton_schulz(matrix: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch's `_zeropower_via_newtonschulz` in the precision of `matrix` (2-D; torch's: bf16): it orthogonalised."""
    a, b, c = coefficients
    x = matrix
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(adjust_lr: str, rows: int, cols: int) -> float:
    """torch's `_adjust_lr` ratio for an [rows, cols] matrix."""
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def logical_matrices(whole: torch.Tensor, qkv_head_dim: int | None) -> list[torch.Tensor]:
    """The matrices Muon orthogonalises in a whole parameter (views): each expert of stacked experts [E, out, in],
    Q, K and V of a fused QKV weight (rows [heads, 3, head_dim], each [heads, head_dim, in]), else the matrix."""
    if whole.dim() == 3:
        return list(whole.unbind(0))
    if qkv_head_dim is not None:
        return list(whole.view(-1, 3, qkv_head_dim, whole.shape[-1]).unbind(1))
    return [whole]


def update_ratio(shape, group: dict, qkv_head_dim: int | None) -> float:
    """The lr ratio of a whole parameter of `shape`: its logical matrices' (one shape for all of them: experts
    alike, and a fused QKV only under multi-head attention)."""
    matrix = logical_matrices(torch.empty(shape, device="meta"), qkv_head_dim)[0]
    return lr_ratio(group["adjust_lr"], matrix.numel() // shape[-1], shape[-1])


def orthogonalised_update(whole: torch.Tensor, group: dict, qkv_head_dim: int | None) -> torch.Tensor:
    """The update of a whole parameter (2-D, or stacked experts 3-D) from its momentum-combined gradient: each
    logical matrix orthogonalised, in the parameter's shape (fp32); its lr ratio is `update_ratio`'s."""
    steps, coefficients, eps = group["ns_steps"], group["ns_coefficients"], group["eps"]
    update = torch.empty(whole.shape, dtype=torch.float32, device=whole.device)
    cols = whole.shape[-1]
    for matrix, out in zip(logical_matrices(whole, qkv_head_dim), logical_matrices(update, qkv_head_dim), strict=True):
        out.copy_(newton_schulz(matrix.reshape(-1, cols), coefficients, steps, eps).view_as(out))
    return update


def balanced_owners(params: list, replicas: int) -> list[int]:
    """Which of `replicas` data-parallel replicas steps each matrix (a tensor or its shape): the costliest first
    (Newton-Schulz FLOPs, rows x cols x min(rows, cols)) to the least loaded; the same answer on every rank (the
    shapes are)."""
    load, owner = [0] * replicas, [0] * len(params)
    shapes = [tuple(getattr(p, "shape", p)) for p in params]
    cost = [s[-2] * s[-1] * min(s[-2:]) for s in shapes]
    for index in sorted(range(len(params)), key=lambda i: (-cost[i], i)):
        owner[index] = min(range(replicas), key=lambda r: (load[r], r))
        load[owner[index]] += cost[index]
    return owner


@dataclass(frozen=True)
class Replicas:
    """The data-parallel replicas of this rank's matrices (DP x CP: every rank holding the same shard) over which
    the Muon matrices are shared out: this rank's index among them, and their group."""

    group: object
    rank: int
    size: int


class ZeroShare:
    """The Muon matrices of one flat ZeRO partition (`deepspeed_compat.FlatPartition`: the model parameters it
    partitions over its group, this rank's pieces of them) and their owners among the group's ranks
    (`balanced_owners`), with every rank's pieces (asked once, a collective over the group): what `gather` and
    `scatter` move between the pieces and the owners, each in one all-to-all."""

    def __init__(self, partition, shapes: list[tuple[int, ...]]):
        self.flat, self.params, self.shapes = partition.flat, partition.params, shapes
        self.group, self.pieces = partition.group, partition.pieces  # pieces: (index, offset, start, count)
        self.rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.owners = balanced_owners(shapes, size)
        everyone = [None] * size
        dist.all_gather_object(everyone, [(index, start, count) for index, _, start, count in self.pieces], self.group)
        self.everyone = everyone  # each rank's pieces: (index, start, count)

    def owned(self) -> list[int]:
        """The indices of the matrices this rank orthogonalises, in order."""
        return [index for index, owner in enumerate(self.owners) if owner == self.rank]

    def gather(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each owned matrix whole (flat, its row-major elements) from every rank's pieces of `flat` (a tensor laid
        out as the partition)."""
        send = [[flat.narrow(0, offset, count) for index, offset, _, count in self.pieces if self.owners[index] == dest]
                for dest in range(len(self.everyone))]  # fmt: skip
        received = self._exchange(
            send, flat, lambda src: [p for p in self.everyone[src] if self.owners[p[0]] == self.rank]
        )
        wholes = {index: flat.new_empty(math.prod(self.shapes[index])) for index in self.owned()}
        for (index, start, count), piece in received:
            wholes[index].narrow(0, start, count).copy_(piece)
        return wholes

    def scatter(self, wholes: dict[int, torch.Tensor], like: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's pieces of the owners' whole tensors (flat, `like`'s dtype): (index, offset in the partition,
        the piece)."""
        send = [[wholes[index].narrow(0, start, count) for index, start, count in self.everyone[dest]
                 if self.owners[index] == self.rank] for dest in range(len(self.everyone))]  # fmt: skip
        mine = [(index, start, count) for index, _, start, count in self.pieces]
        received = self._exchange(send, like, lambda src: [p for p in mine if self.owners[p[0]] == src])
        offsets = {index: offset for index, offset, _, _ in self.pieces}
        return [(index, offsets[index], piece) for (index, _, _), piece in received]

    def _exchange(self, send: list[list[torch.Tensor]], like: torch.Tensor, expected) -> list:
        """One all-to-all: `send[dest]` to each rank; returns (piece description, tensor) for each piece
        `expected(src)` describes, in order of the source ranks."""
        send_sizes = [sum(t.numel() for t in tensors) for tensors in send]
        described = [expected(src) for src in range(len(send))]
        recv_sizes = [sum(count for *_, count in pieces) for pieces in described]
        flat_send = torch.cat([t for tensors in send for t in tensors]) if sum(send_sizes) else like.new_empty(0)
        received = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(received, flat_send.to(like.dtype), recv_sizes, send_sizes, group=self.group)
        out, position = [], 0
        for pieces in described:
            for piece in pieces:
                out.append((piece, received.narrow(0, position, piece[-1])))
                position += piece[-1]
        return out


class MuonAdamW(torch.optim.AdamW):
    """AdamW for the groups without `muon: True`, Muon for those with it (`momentum`, `nesterov`, `ns_steps`,
    `ns_coefficients`, `eps`, `adjust_lr`, `ns_dtype`); `layouts` maps a Muon parameter to its `MatrixLayout`
    (default: one whole 2-D matrix, or whole stacked experts), `tp_group` the group its TP shards are gathered over
    (each TP-split matrix to the TP rank `tp_owners` names, which orthogonalises it and scatters the shards back).
    `shared`: Muon parameters each stepped by one data-parallel replica of `replicas` only (balanced by
    `balanced_owners`), which keeps its momentum buffer, orthogonalises it and broadcasts the updated weight to the
    others: the Newton-Schulz FLOPs and the momentum memory divided by the replicas, for one broadcast of the weights
    (what ZeRO-1's all-gather of the updated weights costs). The others (stacked experts, whose copies live on the
    expert-data-parallel group) are stepped by every rank holding them. Under DeepSpeed ZeRO 1-3 (`use_partitions`)
    the groups hold ZeRO's flat partitions instead, and each matrix is stepped by its owner in the partition's
    group (`ZeroShare`)."""

    def __init__(self, groups: list[dict], *, layouts=None, tp_group=None, shared=(), replicas=None, **adamw):
        super().__init__(groups, **adamw)
        self.layouts: dict[torch.Tensor, MatrixLayout] = dict(layouts or {})
        # the Muon parameters' shapes, taken before ZeRO-3 empties them; ZeRO's partitions of them (`use_partitions`)
        self.shapes = {p: tuple(p.shape) for g in self.param_groups if g.get("muon") for p in g["params"]}
        self.partitions: dict[torch.Tensor, ZeroShare] = {}
        # every group in its place, empty ones too (DeepSpeed drops those from param_groups): checkpoints record them
        self.recorded_groups = list(self.param_groups)
        self.pieces_of: list[tuple[dict, dict]] = []  # (a piece of a group, the group: `even_groups`)
        self.tp_group = tp_group
        self._shard_order: dict[int, tuple] = {}  # shard index <-> TP rank, per shard count
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        shared = list(shared) if self.replicas is not None else []
        self.owners = dict(zip(shared, balanced_owners(shared, self.replicas.size), strict=True)) if shared else {}
        # The TP-split matrices, each orthogonalised by one TP rank (balanced), which gathers it and scatters it back
        split = [p for g in self.param_groups if g.get("muon") for p in g["params"] if self._split_over_tp(p)]
        tp_size = dist.get_world_size(tp_group) if split else 1
        self.tp_owners = dict(zip(split, balanced_owners(split, tp_size), strict=True)) if split else {}

    def _split_over_tp(self, param: torch.Tensor) -> bool:
        return self.layouts.get(param, MatrixLayout()).tp_dim is not None

    def use_partitions(self, partitions) -> None:
        """DeepSpeed ZeRO 1-3 took the parameters: the groups now hold its flat partitions (`partitions`:
        `deepspeed_compat.flat_partitions`). The Muon ones are stepped by `ZeroShare`; ZeRO partitions the momentum
        and the weights, so the replicas no longer share the matrices out whole."""
        self.owners, self.replicas = {}, None
        for partition in partitions:
            if partition.params and all(p in self.shapes for p in partition.params):
                self.partitions[partition.flat] = ZeroShare(partition, [self.shapes[p] for p in partition.params])

    def even_groups(self, count: int) -> None:
        """DeepSpeed ZeRO-1/2 all-reduce each param group's gradient norm over the pipeline stages in turn, so every
        stage must give it as many groups with parameters (it drops empty ones; a stage without embeddings, LM head
        or routers has no AdamW matrices): this stage's largest Muon group is cut into consecutive groups of the same
        settings until there are `count`. The pieces follow their group's settings (`step`)."""
        missing = count - sum(1 for group in self.param_groups if group["params"])
        if missing <= 0:
            return
        group = max((g for g in self.param_groups if g.get("muon")), key=lambda g: len(g["params"]))
        params = group["params"]
        if len(params) <= missing:
            raise MTNLGError(
                f"model.optimizer muon: a stage has {len(params)} matrices, too few for ZeRO: use zero_stage 0"
            )
        cuts = [round(i * len(params) / (missing + 1)) for i in range(missing + 2)]
        group["params"] = params[: cuts[1]]
        pieces = [{**group, "params": params[a:b]} for a, b in zip(cuts[1:-1], cuts[2:], strict=True)]
        at = self.param_groups.index(group) + 1
        self.param_groups[at:at] = pieces
        self.pieces_of += [(piece, group) for piece in pieces]

    def is_muon(self, tensor: torch.Tensor) -> bool:
        """Whether Muon steps a parameter (or a ZeRO partition of such), whose state is its momentum buffer."""
        return tensor in self.shapes or tensor in self.partitions

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this rank steps (and keeps the state of) a Muon parameter."""
        return param not in self.owners or self.owners[param] == self.replicas.rank

    def __setstate__(self, state: dict) -> None:
        """Adam's (which `load_state_dict` runs) reads a `step` in every parameter's state: the AdamW groups' only."""
        groups = state["param_groups"]
        state["param_groups"] = [group for group in groups if not group.get("muon")]
        super().__setstate__(state)
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for piece, group in self.pieces_of:  # a checkpoint restores (and the LR schedule sets) the group's settings
            piece.update({key: value for key, value in group.items() if key != "params"})
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _adamw_step(self, group: dict) -> None:
        """torch.optim.AdamW's step of one group."""
        adamw_group_step(self, group)

    def _muon_step(self, group: dict) -> None:
        """Three passes, so that the TP ranks orthogonalise their matrices at the same time: the momentum and each
        TP-split matrix's update gathered to the TP rank that orthogonalises it; the Newton-Schulz iterations of the
        matrices this rank holds whole; the shards scattered back, the decay and the update applied."""
        lr, decay = group["lr"], group["weight_decay"]
        dtype = getattr(torch, group["ns_dtype"])
        stepped = []  # (parameter, its layout, its whole update-to-be here or None)
        for param in group["params"]:
            if param in self.partitions:
                self._zero_muon_step(group, self.partitions[param])
                continue
            if param.grad is None or not self.owns(param):
                continue
            layout = self.layouts.get(param, MatrixLayout())
            stepped.append((param, layout, self._gather(param, self._combined(param, group).to(dtype), layout)))
        updates = {param: orthogonalised_update(whole, group, layout.qkv_head_dim) for param, layout, whole in stepped
                   if whole is not None}  # fmt: skip
        for param, layout, _ in stepped:
            update = self._scatter(param, updates.get(param), layout, param.shape)
            param.mul_(1 - lr * decay)  # torch's order: the decay with the unadjusted lr first
            param.add_(update, alpha=-lr * self._ratio(param, group))
        for param in group["params"]:  # each shared matrix from the replica that stepped it
            if param in self.owners and param.grad is not None:
                src = dist.get_global_rank(self.replicas.group, self.owners[param])
                dist.broadcast(param.data, src=src, group=self.replicas.group)

    def _combined(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum buffer moved towards the gradient, and the gradient combined with it (Nesterov) or the
        buffer: elementwise, on a parameter or a flat partition alike."""
        grad, momentum = param.grad, group["momentum"]
        state = self.state[param]
        if MOMENTUM_BUFFER not in state:
            state[MOMENTUM_BUFFER] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state[MOMENTUM_BUFFER]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _ratio(self, param: torch.Tensor, group: dict) -> float:
        """The lr ratio of a Muon parameter's update, from its whole (TP-gathered) shape."""
        layout = self.layouts.get(param, MatrixLayout())
        whole_shape = list(self.shapes[param])
        if layout.tp_dim is not None:
            whole_shape[layout.tp_dim] *= layout.tp_count
        return update_ratio(whole_shape, group, layout.qkv_head_dim)

    def _zero_muon_step(self, group: dict, share: ZeroShare) -> None:
        """One flat ZeRO partition of Muon matrices: the momentum on this rank's partition, every owned matrix
        gathered whole to its owner, orthogonalised there (TP-split ones with their TP peers, which own the same
        matrices), the updates sent back to the pieces, the decay and the update applied to the partition."""
        flat, lr, decay = share.flat, group["lr"], group["weight_decay"]
        wholes = share.gather(self._combined(flat, group).to(getattr(torch, group["ns_dtype"])))
        stepped = []  # (index, parameter, layout, whole matrix here or None)
        for index in share.owned():
            param = share.params[index]
            layout = self.layouts.get(param, MatrixLayout())
            shard = wholes[index].view(share.shapes[index])
            stepped.append((index, param, layout, self._gather(param, shard, layout)))
        updates = {index: orthogonalised_update(whole, group, layout.qkv_head_dim) for index, _, layout, whole
                   in stepped if whole is not None}  # fmt: skip
        shards = {index: self._scatter(param, updates.get(index), layout, share.shapes[index]).flatten()
                  for index, param, layout, _ in stepped}  # fmt: skip
        flat.mul_(1 - lr * decay)  # torch's order: the decay with the unadjusted lr first
        for index, offset, piece in share.scatter(shards, flat):
            flat.narrow(0, offset, piece.numel()).add_(piece, alpha=-lr * self._ratio(share.params[index], group))

    def _gather(self, param: torch.Tensor, shard: torch.Tensor, layout: MatrixLayout) -> torch.Tensor | None:
        """The whole matrix of a TP shard on the TP rank that orthogonalises it (None on the others): every TP
        rank's shard, one per shard index (ranks sharing a key/value head's copy hold the same one), concatenated
        along the partition dimension. A tensor whole on this rank is itself."""
        if layout.tp_dim is None:
            return shard
        order, _ = self._shard_places(layout)
        owner = self.tp_owners[param]
        mine = dist.get_rank(self.tp_group) == owner
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(self.tp_group))] if mine else None
        dist.gather(shard.contiguous(), parts, dst=dist.get_global_rank(self.tp_group, owner), group=self.tp_group)
        return torch.cat([parts[rank] for rank in order], dim=layout.tp_dim) if mine else None

    def _scatter(self, param: torch.Tensor, update: torch.Tensor | None, layout: MatrixLayout, shape) -> torch.Tensor:
        """This rank's shard (of `shape`) of a parameter's whole update, sent by the TP rank that computed it."""
        if layout.tp_dim is None:
            return update
        _, index_of = self._shard_places(layout)
        owner = self.tp_owners[param]
        shard = torch.empty(shape, dtype=torch.float32, device=param.device)
        shards = None
        if update is not None:
            size = update.shape[layout.tp_dim] // layout.tp_count
            shards = [update.narrow(layout.tp_dim, i * size, size).contiguous() for i in index_of]
        dist.scatter(shard, shards, src=dist.get_global_rank(self.tp_group, owner), group=self.tp_group)
        return shard

    def _shard_places(self, layout: MatrixLayout) -> tuple[list[int], list[int]]:
        """For each shard index the first TP rank holding it, and for each TP rank its shard index (asked once per
        shard count)."""
        if layout.tp_count not in self._shard_order:
            indices = [None] * dist.get_world_size(self.tp_group)
            dist.all_gather_object(indices, layout.tp_index, group=self.tp_group)
            self._shard_order[layout.tp_count] = ([indices.index(i) for i in range(layout.tp_count)], indices)
        return self._shard_order[layout.tp_count]
