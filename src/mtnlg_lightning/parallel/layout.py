"""Rank <-> (pp, dp, tp) coordinates, node mapping, process groups, the printed table, validation.

One layout for the whole system, row-major with tensor parallelism innermost (Megatron, DeepSpeed's
`PipeModelDataParallelTopology` and torchtitan use the same order):

    rank = pp * (DP * TP) + dp * TP + tp

so a TP group is TP consecutive ranks and sits on one node (NVLink) whenever TP divides the node size, the DP
replicas of one (pp, tp) shard come next, and pipeline stages are outermost (one hop between stages, usually
across nodes). Everything here is arithmetic: no process is needed to build, print or validate a layout, which is
how the topology tests simulate 2 nodes x 4 ranks on one machine. `ProcessGroups.create` turns a layout into
torch.distributed groups once the world exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError


@dataclass(frozen=True)
class RankCoord:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    """The (pp, dp, tp) grid over `world_size` ranks on nodes of `gpus_per_node` ranks.

    DP is what is left: world_size // (tensor_parallel * pipeline_parallel).
    """

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    gpus_per_node: int | None = None  # None: one node holds the whole world
    allow_tp_across_nodes: bool = False

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ sizes
    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def model_parallel(self) -> int:
        """Ranks holding one replica of the model: pp x tp (DeepSpeed's model-parallel group)."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        tp, pp, world = self.tensor_parallel, self.pipeline_parallel, self.world_size
        for name, value in (("world size", world), ("tensor_parallel", tp), ("pipeline_parallel", pp)):
            if not isinstance(value, int) or value < 1:
                raise MTNLGError(f"{name} must be a positive integer, got {value!r}")
        if world % (tp * pp):
            raise MTNLGError(
                f"world size {world} is not divisible by tensor_parallel {tp} x pipeline_parallel {pp} = {tp * pp}"
            )
        gpn = self.gpus_per_node
        if gpn is not None:
            if not isinstance(gpn, int) or gpn < 1:
                raise MTNLGError(f"gpus_per_node must be a positive integer, got {gpn!r}")
            if world > gpn and world % gpn:
                raise MTNLGError(f"world size {world} is not a whole number of nodes of gpus_per_node {gpn}")
            if not self.allow_tp_across_nodes and world > gpn:
                if tp > gpn:
                    raise MTNLGError(
                        f"tensor_parallel {tp} is larger than a node ({gpn} ranks per node): TP groups would "
                        f"cross nodes; lower tensor_parallel or set allow_tp_across_nodes: true"
                    )
                if gpn % tp:
                    raise MTNLGError(
                        f"tensor_parallel {tp} does not divide the node size {gpn}: some TP groups would "
                        f"cross nodes; choose a divisor of {gpn} or set allow_tp_across_nodes: true"
                    )

    def validate_model(
        self, num_heads: int, padded_vocab_size: int, num_layers: int, num_kv_heads: int | None = None
    ) -> None:
        """The model must split evenly: whole query heads, whole (or shared) key/value heads and equal vocabulary
        slices per TP rank, >= 1 block per stage."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        if num_heads % tp:
            raise MTNLGError(f"num_heads {num_heads} is not divisible by tensor_parallel {tp}")
        if num_kv_heads is not None:
            kv_head_copies(num_kv_heads, tp)
        if padded_vocab_size % tp:
            raise MTNLGError(f"padded vocabulary {padded_vocab_size} is not divisible by tensor_parallel {tp}")
        if num_layers < pp:
            raise MTNLGError(f"num_layers {num_layers} is fewer than pipeline_parallel {pp} stages")

    # ------------------------------------------------------------------ coordinates
    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise MTNLGError(f"rank {rank} is outside the world of {self.world_size}")
        tp, dp = self.tensor_parallel, self.data_parallel
        return RankCoord(pp=rank // (tp * dp), dp=(rank // tp) % dp, tp=rank % tp)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return pp * self.data_parallel * self.tensor_parallel + dp * self.tensor_parallel + tp

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    # ------------------------------------------------------------------ groups (lists of global ranks)
    def tensor_parallel_groups(self) -> list[list[int]]:
        """Same (pp, dp), tp = 0..TP-1: consecutive ranks."""
        return [
            [self.rank(p, d, t) for t in range(self.tensor_parallel)]
            for p in range(self.pipeline_parallel)
            for d in range(self.data_parallel)
        ]

    def data_parallel_groups(self) -> list[list[int]]:
        """Same (pp, tp): the replicas of one model shard (ZeRO partitions across these)."""
        return [
            [self.rank(p, d, t) for d in range(self.data_parallel)]
            for p in range(self.pipeline_parallel)
            for t in range(self.tensor_parallel)
        ]

    def pipeline_parallel_groups(self) -> list[list[int]]:
        """Same (dp, tp): the stages of one pipeline."""
        return [
            [self.rank(p, d, t) for p in range(self.pipeline_parallel)]
            for d in range(self.data_parallel)
            for t in range(self.tensor_parallel)
        ]

    def model_parallel_groups(self) -> list[list[int]]:
        """Same dp: the pp x tp ranks of one replica, ordered by model-parallel rank pp * TP + tp."""
        return [
            [self.rank(p, d, t) for p in range(self.pipeline_parallel) for t in range(self.tensor_parallel)]
            for d in range(self.data_parallel)
        ]

    @staticmethod
    def _group_of(groups: list[list[int]], rank: int) -> list[int]:
        return next(g for g in groups if rank in g)

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        return {
            "tp": self._group_of(self.tensor_parallel_groups(), rank),
            "dp": self._group_of(self.data_parallel_groups(), rank),
            "pp": self._group_of(self.pipeline_parallel_groups(), rank),
            "mp": self._group_of(self.model_parallel_groups(), rank),
        }

    # ------------------------------------------------------------------ the printed table
    def table(self) -> str:
        head = (
            f"layout: world {self.world_size} = pp {self.pipeline_parallel} x dp {self.data_parallel} x "
            f"tp {self.tensor_parallel} on {self.num_nodes} node(s) of {self.ranks_per_node} rank(s)"
        )
        rows = [
            head,
            f"{'rank':>5} {'node':>5} {'local':>5} {'pp':>3} {'dp':>3} {'tp':>3}  "
            f"{'tp group':<16} {'dp group':<16} {'pp group':<16}",
        ]
        fmt = lambda g: ",".join(map(str, g))  # noqa: E731
        for r in range(self.world_size):
            c, g = self.coord(r), self.groups_of(r)
            rows.append(
                f"{r:>5} {self.node(r):>5} {self.local_rank(r):>5} {c.pp:>3} {c.dp:>3} {c.tp:>3}  "
                f"{fmt(g['tp']):<16} {fmt(g['dp']):<16} {fmt(g['pp']):<16}"
            )
        return "\n".join(rows)


def kv_head_copies(num_kv_heads: int, tensor_parallel: int) -> int:
    """How many TP ranks hold each key/value head: 1 when TP divides the KV heads, TP / KV heads when TP is a
    multiple of them (each rank then holds a copy of the one its query heads use)."""
    if num_kv_heads % tensor_parallel == 0:
        return 1
    if tensor_parallel % num_kv_heads == 0:
        return tensor_parallel // num_kv_heads
    raise MTNLGError(
        f"tensor_parallel {tensor_parallel} neither divides num_kv_heads {num_kv_heads} nor is a multiple of it "
        f"(key/value heads are split over TP, or each replicated over TP / num_kv_heads ranks)"
    )


def gpus_per_node_from_env(default: int | None = None) -> int | None:
    """Node size as the launcher reports it (torchrun and Lightning set LOCAL_WORLD_SIZE), else `default`."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else default


@dataclass
class ProcessGroups:
    """This rank's torch.distributed groups for a layout (created collectively, in the same order on all ranks)."""

    layout: ParallelLayout
    rank: int
    coord: RankCoord
    tensor_parallel_group: object = None
    data_parallel_group: object = None
    pipeline_parallel_group: object = None
    model_parallel_group: object = None
    ranks: dict[str, list[int]] = field(default_factory=dict)
    kv_head_groups: dict[int, object] = field(default_factory=dict)

    @classmethod
    def create(cls, layout: ParallelLayout, backend: str | None = None) -> ProcessGroups:
        rank = dist.get_rank()
        if dist.get_world_size() != layout.world_size:
            raise MTNLGError(f"layout is for {layout.world_size} ranks but the world has {dist.get_world_size()}")
        mine = cls(layout=layout, rank=rank, coord=layout.coord(rank), ranks=layout.groups_of(rank))
        for attr, groups in (
            ("tensor_parallel_group", layout.tensor_parallel_groups()),
            ("data_parallel_group", layout.data_parallel_groups()),
            ("pipeline_parallel_group", layout.pipeline_parallel_groups()),
            ("model_parallel_group", layout.model_parallel_groups()),
        ):
            for ranks in groups:  # every rank takes part in creating every group
                group = dist.new_group(ranks, backend=backend)
                if rank in ranks:
                    setattr(mine, attr, group)
        return mine

    @classmethod
    def single(cls) -> ProcessGroups:
        """The 1 x 1 x 1 layout of one process, which needs (and makes) no torch.distributed group."""
        layout = ParallelLayout(1)
        return cls(layout=layout, rank=0, coord=layout.coord(0), ranks=layout.groups_of(0))

    def kv_head_group(self, copies: int):
        """The group of this rank's TP ranks that hold a copy of its key/value heads (runs of `copies` consecutive
        TP ranks). Collective: every rank creates every group, in the same order; made once per copies."""
        made = self.kv_head_groups.get(copies)
        if made is None:
            tp_groups = self.layout.tensor_parallel_groups()
            runs = [ranks[i : i + copies] for ranks in tp_groups for i in range(0, len(ranks), copies)]
            for ranks in runs:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    made = group
            self.kv_head_groups[copies] = made
        return made

    @property
    def tensor_parallel_rank(self) -> int:
        return self.coord.tp

    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.tensor_parallel

    @property
    def data_parallel_rank(self) -> int:
        return self.coord.dp

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.coord.pp

    @property
    def model_parallel_rank(self) -> int:
        return self.coord.pp * self.layout.tensor_parallel + self.coord.tp
