"""Rank <-> (pp, dp, cp, tp) coordinates, node mapping, process groups, the printed table, validation.

One layout for the whole system, row-major with tensor parallelism innermost, then context parallelism (Megatron's
order; DeepSpeed's `PipeModelDataParallelTopology` and torchtitan use the same without CP):

    rank = pp * (DP * CP * TP) + dp * (CP * TP) + cp * TP + tp

so a TP group is TP consecutive ranks and sits on one node (NVLink) whenever TP divides the node size, the CP ranks
of a sequence come next (inside the node while TP x CP fits it), then the DP replicas of one (pp, tp) shard, and
pipeline stages are outermost (one hop between stages, usually across nodes). The ranks holding the same weights
are the DP x CP "replicas": gradients are averaged and ZeRO partitions over them (Megatron's dp_cp group).
Everything here is arithmetic: no process is needed to build, print or validate a layout, which is how the
topology tests simulate 2 nodes x 4 ranks on one machine. `ProcessGroups.create` turns a layout into
torch.distributed groups once the world exists.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError


@dataclass(frozen=True)
class RankCoord:
    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """The (pp, dp, cp, tp) grid over `world_size` ranks on nodes of `gpus_per_node` ranks.

    DP is what is left: world_size // (tensor_parallel * context_parallel * pipeline_parallel).
    """

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    gpus_per_node: int | None = None  # None: one node holds the whole world
    allow_tp_across_nodes: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1  # carved out of DP: each run of EP consecutive DP ranks splits the experts

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ sizes
    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.context_parallel * self.pipeline_parallel)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weight shard: DP x CP."""
        return self.data_parallel * self.context_parallel

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
        tp, pp, cp, world = self.tensor_parallel, self.pipeline_parallel, self.context_parallel, self.world_size
        for name, value in (
            ("world size", world),
            ("tensor_parallel", tp),
            ("pipeline_parallel", pp),
            ("context_parallel", cp),
            ("expert_parallel", self.expert_parallel),
        ):
            if not isinstance(value, int) or value < 1:
                raise MTNLGError(f"{name} must be a positive integer, got {value!r}")
        if world % (tp * cp * pp):
            axes = f"tensor_parallel {tp} x context_parallel {cp}" if cp > 1 else f"tensor_parallel {tp}"
            raise MTNLGError(f"world size {world} is not divisible by {axes} x pipeline_parallel {pp} = {tp * cp * pp}")
        if self.data_parallel % self.expert_parallel:
            raise MTNLGError(
                f"expert_parallel {self.expert_parallel} does not divide the data-parallel size {self.data_parallel} "
                f"(world {world} / (tp {tp} x cp {cp} x pp {pp})): expert ranks are carved out of the DP ranks"
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
        """The model must split evenly over this layout (`check_model_split`)."""
        check_model_split(
            self.tensor_parallel, self.pipeline_parallel, num_heads, padded_vocab_size, num_layers, num_kv_heads
        )

    # ------------------------------------------------------------------ coordinates
    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise MTNLGError(f"rank {rank} is outside the world of {self.world_size}")
        tp, cp, dp = self.tensor_parallel, self.context_parallel, self.data_parallel
        return RankCoord(pp=rank // (tp * cp * dp), dp=(rank // (tp * cp)) % dp, tp=rank % tp, cp=(rank // tp) % cp)

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        tp_size, cp_size = self.tensor_parallel, self.context_parallel
        return ((pp * self.data_parallel + dp) * cp_size + cp) * tp_size + tp

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    # ------------------------------------------------------------------ groups (lists of global ranks)
    def _coords(self, *axes: str):
        sizes = {"pp": self.pipeline_parallel, "dp": self.data_parallel, "cp": self.context_parallel}
        sizes["tp"] = self.tensor_parallel
        return itertools.product(*(range(sizes[a]) for a in axes))

    def _grid(self, outer: tuple[str, ...], inner: tuple[str, ...]) -> list[list[int]]:
        """One group per coordinate of the `outer` axes, holding the ranks of every coordinate of the `inner` ones."""
        groups = []
        for fixed in self._coords(*outer):
            ranks = []
            for varying in self._coords(*inner):
                at = dict(zip(outer, fixed, strict=True)) | dict(zip(inner, varying, strict=True))
                ranks.append(self.rank(at["pp"], at["dp"], at["tp"], at["cp"]))
            groups.append(ranks)
        return groups

    def tensor_parallel_groups(self) -> list[list[int]]:
        """Same (pp, dp, cp), tp = 0..TP-1: consecutive ranks."""
        return self._grid(("pp", "dp", "cp"), ("tp",))

    def context_parallel_groups(self) -> list[list[int]]:
        """Same (pp, dp, tp): the ranks holding the chunks of one sequence."""
        return self._grid(("pp", "dp", "tp"), ("cp",))

    def data_parallel_groups(self) -> list[list[int]]:
        """Same (pp, cp, tp): the replicas that read different batches."""
        return self._grid(("pp", "cp", "tp"), ("dp",))

    def replica_groups(self) -> list[list[int]]:
        """Same (pp, tp): every rank holding this weight shard, DP x CP (gradients averaged, ZeRO partitioned)."""
        return self._grid(("pp", "tp"), ("dp", "cp"))

    def expert_parallel_groups(self) -> list[list[int]]:
        """Runs of EP consecutive ranks of each data-parallel group: together they hold every expert once (tokens
        travel between them by all-to-all). With TP = 1 they are consecutive ranks, inside a node."""
        ep = self.expert_parallel
        return [group[i : i + ep] for group in self.data_parallel_groups() for i in range(0, len(group), ep)]

    def expert_data_parallel_groups(self) -> list[list[int]]:
        """The ranks holding the same experts: the same place in their EP run, over DP and CP (context-parallel
        ranks hold the same weights): expert gradients are averaged over these only (Megatron's and DeepSpeed's
        expert-data-parallel group). Ordered by (dp, cp), as `replica_groups`."""
        ep, cp = self.expert_parallel, self.context_parallel
        return [
            [rank for j, rank in enumerate(group) if (j // cp) % ep == place]
            for group in self.replica_groups()
            for place in range(ep)
        ]

    def pipeline_parallel_groups(self) -> list[list[int]]:
        """Same (dp, cp, tp): the stages of one pipeline."""
        return self._grid(("dp", "cp", "tp"), ("pp",))

    def model_parallel_groups(self) -> list[list[int]]:
        """Same (dp, cp): the pp x tp ranks of one replica, ordered by model-parallel rank pp * TP + tp."""
        return self._grid(("dp", "cp"), ("pp", "tp"))

    @staticmethod
    def _group_of(groups: list[list[int]], rank: int) -> list[int]:
        return next(g for g in groups if rank in g)

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        return {
            "tp": self._group_of(self.tensor_parallel_groups(), rank),
            "cp": self._group_of(self.context_parallel_groups(), rank),
            "dp": self._group_of(self.data_parallel_groups(), rank),
            "replica": self._group_of(self.replica_groups(), rank),
            "pp": self._group_of(self.pipeline_parallel_groups(), rank),
            "mp": self._group_of(self.model_parallel_groups(), rank),
            "ep": self._group_of(self.expert_parallel_groups(), rank),
            "edp": self._group_of(self.expert_data_parallel_groups(), rank),
        }

    # ------------------------------------------------------------------ the printed table
    def table(self) -> str:
        cp = self.context_parallel > 1  # the CP column and group appear only when there is context parallelism
        ep = self.expert_parallel > 1  # likewise the EP group
        axes = f"dp {self.data_parallel} x " + (f"cp {self.context_parallel} x " if cp else "")
        head = (
            f"layout: world {self.world_size} = pp {self.pipeline_parallel} x {axes}"
            f"tp {self.tensor_parallel} on {self.num_nodes} node(s) of {self.ranks_per_node} rank(s)"
            + (f", experts over ep {self.expert_parallel} (runs of dp)" if ep else "")
        )
        rows = [
            head,
            f"{'rank':>5} {'node':>5} {'local':>5} {'pp':>3} {'dp':>3} " + (f"{'cp':>3} " if cp else "")
            + f"{'tp':>3}  {'tp group':<16} " + (f"{'cp group':<16} " if cp else "")
            + f"{'dp group':<16} {'pp group':<16}" + (f" {'ep group':<16}" if ep else ""),
        ]  # fmt: skip
        fmt = lambda g: ",".join(map(str, g))  # noqa: E731
        for r in range(self.world_size):
            c, g = self.coord(r), self.groups_of(r)
            rows.append(
                f"{r:>5} {self.node(r):>5} {self.local_rank(r):>5} {c.pp:>3} {c.dp:>3} " + (f"{c.cp:>3} " if cp else "")
                + f"{c.tp:>3}  {fmt(g['tp']):<16} " + (f"{fmt(g['cp']):<16} " if cp else "")
                + f"{fmt(g['dp']):<16} {fmt(g['pp']):<16}" + (f" {fmt(g['ep']):<16}" if ep else "")
            )  # fmt: skip
        return "\n".join(rows)


def check_model_split(
    tensor_parallel: int,
    pipeline_parallel: int,
    num_heads: int,
    padded_vocab_size: int,
    num_layers: int,
    num_kv_heads: int | None = None,
) -> None:
    """Whole query heads, whole (or shared) key/value heads and equal vocabulary slices per TP rank, >= 1 block
    per pipeline stage."""
    tp, pp = tensor_parallel, pipeline_parallel
    if num_heads % tp:
        raise MTNLGError(f"num_heads {num_heads} is not divisible by tensor_parallel {tp}")
    if num_kv_heads is not None:
        kv_head_copies(num_kv_heads, tp)
    if padded_vocab_size % tp:
        raise MTNLGError(f"padded vocabulary {padded_vocab_size} is not divisible by tensor_parallel {tp}")
    if num_layers < pp:
        raise MTNLGError(f"num_layers {num_layers} is fewer than pipeline_parallel {pp} stages")


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
    context_parallel_group: object = None  # None without context parallelism
    data_context_parallel_group: object = None  # DP x CP; None without context parallelism (see replica_group)
    expert_parallel_group: object = None  # None without expert parallelism
    expert_data_parallel_group: object = None  # None without expert parallelism
    ranks: dict[str, list[int]] = field(default_factory=dict)
    kv_head_groups: dict[int, object] = field(default_factory=dict)

    @property
    def replica_group(self):
        """The ranks holding this rank's weight shard, over which gradients are averaged and ZeRO partitions: DP x CP
        (Megatron's dp_cp group); without context parallelism the data-parallel group itself."""
        if self.layout.context_parallel == 1:
            return self.data_parallel_group
        return self.data_context_parallel_group

    @classmethod
    def create(cls, layout: ParallelLayout, backend: str | None = None) -> ProcessGroups:
        rank = dist.get_rank()
        if dist.get_world_size() != layout.world_size:
            raise MTNLGError(f"layout is for {layout.world_size} ranks but the world has {dist.get_world_size()}")
        mine = cls(layout=layout, rank=rank, coord=layout.coord(rank), ranks=layout.groups_of(rank))
        kinds = [
            ("tensor_parallel_group", layout.tensor_parallel_groups()),
            ("data_parallel_group", layout.data_parallel_groups()),
            ("pipeline_parallel_group", layout.pipeline_parallel_groups()),
            ("model_parallel_group", layout.model_parallel_groups()),
        ]
        if layout.context_parallel > 1:
            kinds += [
                ("context_parallel_group", layout.context_parallel_groups()),
                ("data_context_parallel_group", layout.replica_groups()),
            ]
        if layout.expert_parallel > 1:
            kinds += [
                ("expert_parallel_group", layout.expert_parallel_groups()),
                ("expert_data_parallel_group", layout.expert_data_parallel_groups()),
            ]
        for attr, groups in kinds:
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

    def expert_place(self) -> tuple[int, int]:
        """(which run of experts this rank holds: its place in its EP group, which of that run's copies: its place
        in its expert-data-parallel group, ordered by (dp, cp))."""
        copy, run = divmod(self.coord.dp, self.layout.expert_parallel)
        return run, copy * self.layout.context_parallel + self.coord.cp

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
    def context_parallel_rank(self) -> int:
        return self.coord.cp

    @property
    def replica_rank(self) -> int:
        """This rank's place among the DP x CP ranks holding its weight shard (ZeRO's data-parallel rank)."""
        return self.coord.dp * self.layout.context_parallel + self.coord.cp

    @property
    def replica_size(self) -> int:
        return self.layout.replicas

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.coord.pp

    @property
    def model_parallel_rank(self) -> int:
        return self.coord.pp * self.layout.tensor_parallel + self.coord.tp
