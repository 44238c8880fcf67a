"""DeepSpeed ZeRO over the data-parallel groups: the mpu object DeepSpeed reads, and engine construction.

The mpu mirrors DeepSpeed's own `PipelineParallelGrid`: the data-parallel group is the ranks holding the same
(pp, tp) shard (ZeRO partitions only across it), and the **model-parallel group is the pp x tp ranks of one
replica** with model-parallel rank pp * TP + tp: DeepSpeed all-reduces the squared grad norm over that group, so
with only the TP group there each pipeline stage would clip by its own partial norm.

The optimizer is the LightningModule's own (`configure_optimizers`: torch AdamW with the decay groups, i.e.
what DeepSpeed builds for `"torch_adam": true`, or Muon with AdamW, told where ZeRO's partitions cut its matrices),
handed to DeepSpeed as a client optimizer, and its LambdaLR keeps driving the learning rate per step: one recipe
for every strategy. The caller's `engine.step()` is the accumulation boundary (`gradient_accumulation_steps: 1`,
`managed_gradient_accumulation: false`): step() does the DP reduction, the clipping by the global norm, the update
and zero_grad. `engine_update` is that step, with a
snapshot to undo it when the caller's veto comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, requires

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet

from mtnlg_lightning.config import deep_merge
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.parallel.deepspeed_compat import (
    engine_with_experts,
    expert_group_name,
    flat_partitions,
    local_partition,
    mark_expert_parameters,
    moves_gradients_in_hooks,
    register_expert_groups,
)
from mtnlg_lightning.parallel.expert_parallel import is_expert_parallel
from mtnlg_lightning.parallel.layout import ProcessGroups
from mtnlg_lightning.parallel.muon import MuonAdamW


def supported_deepspeed() -> str:
    """The DeepSpeed range of pyproject's `deepspeed` extra (read from the installed metadata: written once).
    Private DeepSpeed behaviour is relied on (unmanaged accumulation, optimizer internals for the update veto),
    so the range is pinned and the equivalence tests fail loudly if it changes."""
    try:
        for requirement in requires("mtnlg-lightning") or []:
            name, _, rest = requirement.partition(";")
            if name.strip().startswith("deepspeed") and 'extra == "deepspeed"' in rest:
                return name.strip().removeprefix("deepspeed")
    except PackageNotFoundError:  # running from a source tree that was never installed
        pass
    return ""


@dataclass
class ModelParallelUnit:
    """What `deepspeed.initialize(mpu=...)` asks of Megatron's `mpu` module, answered from our groups."""

    groups: ProcessGroups

    # ZeRO's "data parallel" is every rank holding this weight shard: DP x CP (Megatron's dp_cp group).
    def get_data_parallel_group(self):
        return self.groups.replica_group

    def get_data_parallel_rank(self) -> int:
        return self.groups.replica_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.replica_size

    def get_model_parallel_group(self):
        return self.groups.model_parallel_group

    def get_model_parallel_rank(self) -> int:
        return self.groups.model_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return self.groups.layout.model_parallel

    def get_tensor_model_parallel_group(self):
        return self.groups.tensor_parallel_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.tensor_parallel_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.tensor_parallel_size

    def get_pipeline_model_parallel_group(self):
        return self.groups.pipeline_parallel_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.groups.pipeline_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.groups.layout.pipeline_parallel


def build_deepspeed_config(
    zero_stage: int,
    micro_batch_size: int,
    grad_clip: float | None,
    precision: str = "32-true",
    overrides: dict | None = None,
    shard_numel: int | None = None,
) -> dict:
    """The DeepSpeed config for one recipe. `overrides` (the strategy's `deepspeed_config`) is merged on top.

    Buckets are capped at this rank's shard size (`shard_numel`): ZeRO allocates its reduce buckets per
    micro-step, and with `deterministic: true` torch fills every new allocation, so an oversized bucket costs.
    """
    bucket = int(min(5e7, max(shard_numel or 5e7, 1e5)))
    if zero_stage not in (1, 2, 3):
        raise MTNLGError(f"zero_stage {zero_stage} is not one of 0 (plain DP), 1, 2, 3")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,  # the module accumulates micro-batches; step() is the boundary
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(grad_clip) if grad_clip else 0.0,
        "zero_optimization": {
            "stage": zero_stage,
            "overlap_comm": zero_stage == 2,  # unmanaged accumulation allows overlap only with stage 2
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if "bf16" in str(precision):
        config["bf16"] = {"enabled": True}
    elif str(precision).startswith("16"):
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return deep_merge(config, overrides or {})


def initialize_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict, mpu: ModelParallelUnit):
    """`deepspeed.initialize` on this rank's model shard with the module's optimizer; returns the engine."""
    require_extra("deepspeed", "zero_stage >= 1")
    import deepspeed  # optional extra [deepspeed]: imported on use

    supported = supported_deepspeed()
    if supported and deepspeed.__version__.split("+")[0] not in SpecifierSet(supported):
        raise MTNLGError(f"DeepSpeed {deepspeed.__version__} is not supported; install 'deepspeed{supported}'")
    stage = config["zero_optimization"]["stage"]
    muon = isinstance(optimizer, MuonAdamW)
    if muon and config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none":
        raise MTNLGError(
            "model.optimizer muon does not run with ZeRO's offload_optimizer: remove it from deepspeed_config"
        )
    if muon and mpu.get_model_parallel_world_size() > 1:  # as many groups on every stage (`even_groups`)
        counts = [None] * mpu.get_model_parallel_world_size()
        present = sum(1 for group in optimizer.param_groups if group["params"])
        dist.all_gather_object(counts, present, group=mpu.get_model_parallel_group())
        optimizer.even_groups(max(counts))
    experts = expose_experts(model, optimizer, mpu.groups, stage)
    with engine_with_experts(experts and stage < 3):  # ZeRO-3 reads the experts' placement, not has_moe_layers
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, mpu=mpu, dist_init_required=False
        )
    if muon:  # each Muon matrix stepped whole by one rank of its partition's group
        optimizer.use_partitions(flat_partitions(engine.optimizer))
    return engine


def expose_experts(model: torch.nn.Module, optimizer, groups: ProcessGroups, zero_stage: int) -> bool:
    """Under expert parallelism, mark this rank's experts (and their optimizer group) for ZeRO: it then reduces
    their gradients over the ranks holding the same experts only, partitions their state over those ranks, and
    divides their gradients by the whole data-parallel size as the dense ones' (the sum over the EP group's tokens
    that reached an expert is its gradient). Whether the model has such experts."""
    experts = [p for p in model.parameters() if is_expert_parallel(p)]
    if not experts:
        return False
    name = expert_group_name(groups.layout.expert_parallel)
    register_expert_groups(name, groups)
    mark_expert_parameters(experts, name, groups.expert_data_parallel_group, zero_stage)
    ids = {id(p) for p in experts}
    for group in optimizer.param_groups:
        held = [id(p) in ids for p in group["params"]]
        if any(held) and not all(held):  # optimizer_recipe.decay_groups gives the experts a group of their own
            raise MTNLGError("an optimizer group mixes experts with other parameters: ZeRO cannot partition it")
        if any(held):
            group["moe"], group["name"] = True, name
    return True


def takes_gradients_in_hooks(engine) -> bool:
    """Whether the engine moves each gradient out of `p.grad` from backward hooks, so a gradient added later must
    go through autograd: ZeRO-2 (into its partitions) and bf16 ZeRO-1 (DeepSpeed's BF16_Optimizer with
    `immediate_grad_update`, into its fp32 accumulation buffers)."""
    return bool(engine.zero_optimization_partition_gradients() or moves_gradients_in_hooks(engine.optimizer))


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a ZeRO wrapper (it holds the fp32 partitions and their Adam moments)."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def engine_update(engine, model: torch.nn.Module, undoable: bool, device: torch.device):
    """One update through the engine: reduce, clip, apply in its one `step()`. The pre-clip global norm, which a
    veto needs, is only known after it, so an `undoable` update is snapshotted first. Returns the norm and the
    snapshot (None unless undoable): the caller restores it when the update is vetoed."""
    snapshot = UpdateSnapshot(model, engine.optimizer) if undoable else None
    engine.step()
    grad_norm = torch.tensor(float(engine.get_global_grad_norm()), device=device)
    return grad_norm, snapshot


class UpdateSnapshot:
    """A copy of everything `engine.step()` changes on this rank, so a vetoed update can be undone exactly.

    DeepSpeed reduces, clips and updates in one call, so the pre-clip norm a veto needs is only known after the
    update: `engine_update` snapshots (only when some callback can veto) and steps; the caller restores it if vetoed.
    """

    def __init__(self, model: torch.nn.Module, optimizer):
        inner = base_optimizer(optimizer)
        self._tensors = []
        for p in model.parameters():
            self._tensors.append(local_partition(p).data)  # ZeRO-3: this rank's partition
        for group in inner.param_groups:
            for p in group["params"]:
                self._tensors.append(p.data)
                self._tensors += [t for t in inner.state.get(p, {}).values() if torch.is_tensor(t)]
        self._copies = [t.detach().clone() for t in self._tensors]
        self._inner = inner
        self._state_keys = {id(p): set(inner.state.get(p, {})) for g in inner.param_groups for p in g["params"]}

    @torch.no_grad()
    def restore(self) -> None:
        for tensor, copy_ in zip(self._tensors, self._copies, strict=True):
            tensor.copy_(copy_)
        for group in self._inner.param_groups:  # state created by the vetoed (first) step is dropped
            for p in group["params"]:
                if not self._state_keys.get(id(p)) and p in self._inner.state:
                    del self._inner.state[p]
